"""One inference request through the fleet: route, send, retry before the first byte,
relay the answer, and count what the engine said it had cached.

Attempts: the workload's policy picks a replica (leaving out those a circuit breaker
holds and those this request already tried); a :class:`~dataplane.upstream.Retriable`
failure (nothing reached the client yet) tries the next-best replica, at most
``retry_attempts`` times and only while the :class:`~dataplane.breaker.RetryBudget`
allows. No replica left -> 503 with ``Retry-After``. A streamed request whose first
bytes miss their deadline, or a whole one whose replica stays silent that long
(``dataplane.first_byte``), is such a failure too, and makes its replica suspect.

The critical path is kept short: what the upstream request need not wait for (the
decision's latency, the retry budget, the in-flight count, speculative residency) is done
just after it is written, and what the client need not wait for (the prefill booking's
settlement, the breaker's success, time to first byte: :meth:`Dispatcher.answered`; the
usage read and the counters of :meth:`Dispatcher.finish`) just after the answer is
written to the client, each before anything else is awaited.

Every request ends in :meth:`Dispatcher.finish`, whatever happened: the in-flight count
is released, the outcome is counted, and for a request a replica answered whole the
fidelity counters (prompt tokens, predicted and engine-reported cached tokens) go to
Prometheus and to the control-plane reporter. A request refused (an engine's 4xx or
5xx), broken off or cancelled counts none of them: its prediction would have no
measurement beside it, and the predicted and measured hit rates, both over prompt
tokens, would drift apart on errors alone. The reporter counts it as an error.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from dataplane.breaker import CircuitBreakers, RetryBudget
from dataplane.endpoints import Endpoint
from dataplane.first_byte import FirstByteDeadlines
from dataplane.fleet.inflight import InflightTicket
from dataplane.fleet.state import FleetState
from dataplane.http_errors import ApiError, NoReplica
from dataplane.metrics import ProxyMetrics
from dataplane.openai_request import InferenceRequest
from dataplane.relay import Usage
from dataplane.routing import Prepared, Router
from dataplane.upstream import Opened, Pending, Retriable, Upstream
from kvcore.policies import Decision

log = logging.getLogger("dataplane")
REPORTING_REMEMBERED = 4096  # replicas known to report cached tokens, kept before starting over


class Split(Protocol):
    """Another way to send some models' requests: disaggregated prefill/decode
    (``dataplane.pd``), which sends each in two halves with this dispatcher's
    bookkeeping."""

    # the models it sends (a set, read on every request: no call into its module, which
    # runs from source)
    models: frozenset[str]

    async def send(
        self, exchange: Exchange, path: str, body: bytes, headers: Sequence[tuple[str, str]]
    ) -> Attempt: ...

    def finish(self, exchange: Exchange) -> bool: ...


class Reporter(Protocol):
    """The control-plane reporter (``dataplane.reporter``)."""

    def record(
        self,
        workload: str,
        pool: str,
        replica_id: str,
        prompt_tokens: int,
        predicted_cached: int,
        measured_cached: int | None,
        error: bool,
    ) -> None: ...


@dataclass(slots=True)
class Policies:
    """How hard to try: from the proxy's settings."""

    retry_attempts: int
    retry_after_s: int


@dataclass(slots=True)
class Attempt:
    """The replica that answered, with what routing expected of it."""

    opened: Opened
    decision: Decision
    endpoint: Endpoint
    predicted: int
    ticket: InflightTicket | None
    tried: int  # replicas tried, this one included
    answered: bool = False  # Dispatcher.answered has settled it

    def __init__(  # written out: one per request (see dataplane/native.py)
        self,
        opened: Opened,
        decision: Decision,
        endpoint: Endpoint,
        predicted: int,
        ticket: InflightTicket | None,
        tried: int,
        answered: bool = False,
    ) -> None:
        self.opened = opened
        self.decision = decision
        self.endpoint = endpoint
        self.predicted = predicted
        self.ticket = ticket
        self.tried = tried
        self.answered = answered


@dataclass(slots=True)
class Exchange:
    """The state of one request from routing to its last byte."""

    request: InferenceRequest
    prepared: Prepared
    decision_s: float  # routing's time (Router.prepare), observed after the upstream write
    attempt: Attempt | None = None
    usage: Usage | None = None
    outcome: str = "ok"
    tried: list[str] = field(default_factory=list)
    split: bool = False  # sent by the dispatcher's split (P/D), which finishes it

    def __init__(  # written out: one per request (see dataplane/native.py)
        self,
        request: InferenceRequest,
        prepared: Prepared,
        decision_s: float,
        attempt: Attempt | None = None,
        usage: Usage | None = None,
        outcome: str = "ok",
        tried: list[str] | None = None,
        split: bool = False,
    ) -> None:
        self.request = request
        self.prepared = prepared
        self.decision_s = decision_s
        self.attempt = attempt
        self.usage = usage
        self.outcome = outcome
        self.tried = [] if tried is None else tried
        self.split = split


class Dispatcher:
    """Sends prepared requests to replicas; one per worker process."""

    def __init__(
        self,
        fleet: FleetState,
        router: Router,
        upstream: Upstream,
        metrics: ProxyMetrics,
        policies: Policies,
        breakers: CircuitBreakers,
        budget: RetryBudget,
        reporter: Reporter | None = None,
        clock: Callable[[], float] = time.monotonic,
        deadlines: FirstByteDeadlines | None = None,
    ) -> None:
        self.fleet = fleet
        self.replicas = fleet.replicas  # endpoints, speculative residency
        self.inflight = fleet.inflight  # tickets and prefill books
        self.router = router
        self.upstream = upstream
        self.metrics = metrics
        self.policies = policies
        self.breakers = breakers
        self.budget = budget
        self.reporter = reporter
        self._clock = clock
        self.deadlines = deadlines  # None: no first-byte deadline but upstream_timeout_s
        self._reporting: set[str] = set()  # replicas seen reporting cached tokens
        self.split: Split | None = None  # set by the service (dataplane.pd)

    async def send(
        self, exchange: Exchange, path: str, body: bytes, headers: Sequence[tuple[str, str]]
    ) -> Attempt:
        """The first replica that answers; raises :class:`NoReplica` when none can. Each
        attempt's request is written before its bookkeeping (in-flight count, speculative
        residency, breaker probe), which is done before anything is awaited."""
        split = self.split
        if split is not None and exchange.prepared.model in split.models:
            exchange.split = True
            return await split.send(exchange, path, body, headers)
        exclude: frozenset[int] = frozenset()
        last_failure = "no replica serves this model"
        try:
            for tries in range(1, self.policies.retry_attempts + 2):
                now = self._clock()
                held_out = self.breakers.excluded(now)
                excluded = exclude | held_out if exclude else held_out
                decision, predicted = self.router.choose(
                    exchange.prepared, now=now, exclude=excluded
                )
                ordinal = decision.ordinal
                endpoint = None if ordinal is None else self.replicas.endpoint(ordinal)
                if endpoint is None:
                    break
                pending = self.upstream.send("POST", endpoint.base_url + path, body, headers)
                try:
                    ticket = self.sent(exchange, decision, endpoint, now, predicted)
                except BaseException:
                    pending.close()
                    raise
                try:
                    if self.deadlines is None:
                        opened = await pending.opened()
                    else:
                        uncached = exchange.prepared.prompt_tokens - predicted
                        deadline_s = self.deadline_s(endpoint, uncached)
                        opened = await self.first_bytes(
                            pending, endpoint, deadline_s, exchange.request.stream
                        )
                except Retriable as failure:
                    self.inflight.on_done(ticket)
                    self.breakers.on_failure(endpoint.replica_id, endpoint.ordinal, self._clock())
                    last_failure = f"{endpoint.replica_id}: {failure}"
                    exclude |= {endpoint.ordinal}
                    if not self._may_retry(failure, tries):
                        break
                    continue
                except BaseException:
                    self.inflight.on_done(ticket)
                    self.breakers.on_abandoned(endpoint.replica_id, self._clock())
                    raise
                return Attempt(opened, decision, endpoint, predicted, ticket, tries)
        finally:
            if not exchange.tried:  # no request was written: account for it all the same
                self._routed(exchange)
        exchange.outcome = "no_replica"
        raise NoReplica(
            f"No replica could take the request ({last_failure}).", self.policies.retry_after_s
        )

    def deadline_s(self, endpoint: Endpoint, uncached: int) -> float:
        """How long a request sent now to ``endpoint`` with ``uncached`` tokens to compute
        may wait for its first bytes (``dataplane.first_byte``); ``upstream_timeout_s``
        stands when there are no deadlines."""
        deadlines = self.deadlines
        if deadlines is None:
            return math.inf
        return deadlines.deadline_s(endpoint.replica_id, uncached)

    async def first_bytes(
        self, pending: Pending, endpoint: Endpoint, deadline_s: float, streamed: bool
    ) -> Opened:
        """The answer's first bytes (a whole answer's head) within ``deadline_s`` (for a
        whole answer: before its replica has been silent that long,
        ``dataplane.first_byte``), past which the replica is suspect and the request
        :class:`Retriable` elsewhere. Also the two halves of a P/D request's
        (``dataplane.pd``)."""
        deadlines = self.deadlines
        if deadlines is None or deadline_s == math.inf:
            return await pending.opened()
        if streamed:
            task = deadlines.begin(deadline_s)
        else:
            task = deadlines.begin_whole(endpoint, deadline_s)
        try:
            opened = await pending.opened()
        except asyncio.CancelledError:
            if not deadlines.end(task):
                raise  # the client went away
            now = self._clock()
            self.breakers.suspect(endpoint.replica_id, endpoint.ordinal, endpoint.base_url, now)
            log.warning(
                "replica missed a first-byte deadline: suspect until its probe answers",
                extra={"replica": endpoint.replica_id, "deadline_s": round(deadline_s, 3)},
            )
            raise Retriable(
                f"no first byte within {deadline_s:.2f} s", "first_byte_deadline"
            ) from None
        except BaseException:
            deadlines.end(task)
            raise
        deadlines.end(task)
        return opened

    def sent(
        self, exchange: Exchange, decision: Decision, endpoint: Endpoint, now: float, predicted: int
    ) -> InflightTicket | None:
        """The bookkeeping of a request just written to ``endpoint`` (by the proxy; by the
        endpoint picker, handed to the gateway)."""
        first = not exchange.tried
        exchange.tried.append(endpoint.replica_id)
        if first:
            self._routed(exchange)
        self.replicas.apply_speculative(decision)
        prepared = exchange.prepared
        uncached = prepared.prompt_tokens - predicted
        later = self.router.later_uncached(prepared, endpoint.ordinal, now) if prepared.later else 0
        ticket = self.inflight.on_sent(endpoint.ordinal, time.time(), uncached, later)
        self.breakers.on_sent(endpoint.replica_id, endpoint.ordinal, now)
        return ticket

    def _routed(self, exchange: Exchange) -> None:
        """A request's own accounting, once, after its first upstream write."""
        self.budget.on_request()
        self.metrics.decided(exchange.prepared.workload.strategy, exchange.decision_s)

    def answered(self, attempt: Attempt) -> None:
        """The replica's first bytes went on to the client: settle what waited for them
        (the prefill booking, the breaker, time to first byte); once, and at the latest
        in :meth:`finish`."""
        if attempt.answered:
            return
        attempt.answered = True
        opened = attempt.opened
        self.first_byte(
            attempt.ticket, attempt.endpoint.replica_id, opened.status, opened.streaming,
            opened.ttfb_s,
        )  # fmt: skip

    def first_byte(
        self,
        ticket: InflightTicket | None,
        replica: str,
        status: int,
        streaming: bool,
        ttfb_s: float,
    ) -> None:
        """:meth:`answered`'s work, for a caller without an :class:`Attempt` (the
        endpoint picker, which sees the answer pass through the gateway)."""
        self.inflight.on_first_byte(ticket, status, streaming)
        now = self._clock()
        self.breakers.on_success(replica, now)
        self.metrics.first_byte(replica, ttfb_s)
        deadlines = self.deadlines
        if deadlines is not None:
            deadlines.heard_from(replica, now)
            if streaming and status < 400:
                deadlines.answered(replica, ttfb_s)

    def _may_retry(self, failure: Retriable, tries: int) -> bool:
        if tries > self.policies.retry_attempts:
            return False
        if not self.budget.try_spend(self._clock()):
            self.metrics.retries_refused.inc()
            return False
        self.metrics.retries.labels(failure.reason).inc()
        return True

    def finish(self, exchange: Exchange) -> None:
        """Release the in-flight count and count the request; call exactly once."""
        if exchange.split and self.split is not None and self.split.finish(exchange):
            return
        attempt = exchange.attempt
        if attempt is None:
            self.metrics.count(exchange.prepared.workload.name, "", exchange.outcome)
            return
        self.answered(attempt)
        self.inflight.on_done(attempt.ticket)
        self.account(exchange, attempt.endpoint, attempt.predicted, attempt.opened.status)

    def account(self, exchange: Exchange, endpoint: Endpoint, predicted: int, status: int) -> None:
        """Count a request ``endpoint`` answered with ``status``: its outcome, and for one
        answered whole its fidelity counters (:meth:`finish`'s, and the endpoint
        picker's, whose requests the gateway sends)."""
        workload = exchange.prepared.workload.name
        replica = endpoint.replica_id
        if exchange.outcome == "ok" and status >= 400:
            exchange.outcome = "client_error" if status < 500 else "upstream_error"
        self.metrics.count(workload, replica, exchange.outcome)
        if exchange.outcome == "ok":
            self._fidelity(exchange, endpoint, predicted, workload)
        elif exchange.outcome != "cancelled" and self.reporter is not None:
            # refused or broken off: an error, with no prompt served to compare
            self.reporter.record(workload, endpoint.pool, replica, 0, 0, None, True)

    def _measured(self, usage: Usage | None, replica: str) -> int | None:
        """The cached tokens an answer's usage reports; ``None``: unknown. vLLM reports
        them only when started with ``--enable-prompt-tokens-details`` (SGLang: with
        ``--enable-cache-report``), and then only when some were cached (0 reads as no
        details at all), so a final usage without details from a replica seen reporting
        them means 0, and from any other replica, unknown."""
        if usage is None:
            return None
        cached = usage.cached_tokens
        if cached is not None:
            if replica not in self._reporting:
                if len(self._reporting) >= REPORTING_REMEMBERED:
                    self._reporting.clear()  # replicas come and go: start over
                self._reporting.add(replica)
            return cached
        return 0 if usage.final and replica in self._reporting else None

    def _fidelity(
        self, exchange: Exchange, endpoint: Endpoint, predicted: int, workload: str
    ) -> None:
        usage = exchange.usage
        request = exchange.request
        measured = self._measured(usage, endpoint.replica_id)
        if request.fans_out and (not request.stream or endpoint.engine_kind == "sglang"):
            # vLLM: a whole answer to a batch or to n > 1 reports the cached tokens of its
            # last engine request (another prompt's, or a later sample's that hit the first
            # sample's blocks); a stream's is the first prompt's first sample's. SGLang sums
            # each prompt's first sample, which it runs after a warm-up of that prompt.
            measured = None
        prepared = exchange.prepared
        if usage is not None and usage.prompt_tokens is not None and not request.is_batch:
            prompt = usage.prompt_tokens
        else:  # the first prompt's, routing's subject (a short one, if not keyed yet)
            # (a prompt the engine took but the proxy cannot key counts no tokens)
            with contextlib.suppress(ApiError):
                self.router.key(prepared, request)
            prompt = prepared.prompt_tokens
        replica = endpoint.replica_id
        self.metrics.fidelity(workload, replica, prompt, predicted, measured)
        if self.reporter is not None:
            self.reporter.record(
                workload, endpoint.pool, replica, prompt, predicted, measured, False
            )
