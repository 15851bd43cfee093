"""Disaggregated prefill/decode through the proxy, over each engine's own protocol.

A model whose replicas include ``prefill`` or ``decode`` ones (``kvcore.roles``) is a
P/D pool: each request is computed on a prefill replica, picked by the workload's policy
as for colocated replicas (its cached prefix against its queued prefill; ``both``
replicas may take either half), and generated on a decode replica, picked by load and
then KV headroom. The two halves are driven as the engines' reference proxies do:

- vLLM (``examples/online_serving/disaggregated_serving``, NIXL): the prefill replica
  gets the request with ``kv_transfer_params`` ``{"do_remote_decode": true, ...}``,
  ``max_tokens`` 1 and no stream; the decode replica then gets the original request
  with the ``kv_transfer_params`` the prefill answered with.
- SGLang (its mini load balancer, smg's PD router): ``bootstrap_host`` (the prefill
  replica's host), ``bootstrap_port`` (its bootstrap server) and ``bootstrap_room`` (a
  random 63-bit id) are added, and both replicas get the request at once; the prefill's
  answer is read whole (it comes once the decode side read the KV) and the answer
  relayed is the decode replica's.

Transfer fields a client sent are dropped: the proxy alone sets them. Retries, all
before any byte reached the client (none after, so nothing is duplicated): a prefill
that fails goes to another prefill replica; a decode that fails, or answers that it
could not read the KV (vLLM's ``kv_load_failure_policy`` "fail": 500, or an error event
first in a stream), gets a new prefill and another decode replica, and
``kvroute_proxy_pd_reprefills_total`` counts it. A hung replica (stopped, wedged: it still
accepts connections) fails its half the same way: each half waits for its first bytes
within its replica's first-byte deadline (``Dispatcher.first_bytes``,
``dataplane.first_byte``; for the prefill, always a whole answer, a bound on its
replica's silence), past which the replica is suspect. The prefill's deadline counts the
prompt's uncached tokens; the decode's none (reading the KV is part of its replica's
typical time to first byte, times the factor, or the floor), and over SGLang's protocol
it adds the prefill's, since the decode's first bytes wait for the prefill beside it. A pool
without a prefill (or decode) replica is answered 503 naming what is missing. Usage and
the fidelity counters are the decode's answer with the prefill's cached tokens: the
prediction is the prefill replica's.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any
from urllib.parse import urlsplit

import aiohttp
from prometheus_client import Counter

from dataplane.endpoints import Endpoint
from dataplane.exchange import Attempt, Dispatcher, Exchange
from dataplane.fleet.inflight import InflightTicket
from dataplane.http_errors import NoReplica
from dataplane.relay import usage_of
from dataplane.upstream import Opened, Retriable
from kvcore.decode_choice import DecodeCandidate, choose_decode
from kvcore.policies import Decision
from kvcore.roles import Role, sglang_disaggregation, vllm_prefill_params

SGLANG_BOOTSTRAP_PORT = 8998  # SGLang's --disaggregation-bootstrap-port default
TRANSFER_FIELDS = ("kv_transfer_params", "bootstrap_host", "bootstrap_port", "bootstrap_room")


@dataclass(frozen=True, slots=True)
class _Prefilled:
    """Where a P/D request's prefill ran and what that replica reported cached."""

    endpoint: Endpoint
    cached: int | None


@dataclass(frozen=True, slots=True)
class _Pair:
    """One try of a P/D request: the request, its prefill pick and its decode replica."""

    exchange: Exchange
    path: str
    request: dict[str, Any]
    headers: Sequence[tuple[str, str]]
    picked: tuple[Endpoint, Decision, int]  # the prefill replica, the decision, predicted
    decode: Endpoint


class _Failed(Exception):
    """One half failed before any byte reached the client: try again."""

    def __init__(
        self, message: str, *, reprefill: bool = False, kv_lost: bool = False, reason: str = "pd"
    ) -> None:
        super().__init__(message)
        self.reprefill = reprefill
        self.kv_lost = kv_lost  # the decode could not read the prefill's KV: both are suspect
        self.reason = reason  # the retry's label: "pd", or the upstream failure's


class PdSplit:
    """The P/D path of a :class:`Dispatcher` (its ``split``): sends a P/D pool's
    requests in two halves, with the dispatcher's bookkeeping."""

    def __init__(self, dispatcher: Dispatcher) -> None:
        self.d = dispatcher
        self.fleet, self.router, self.upstream = (
            dispatcher.fleet,
            dispatcher.router,
            dispatcher.upstream,
        )
        self.breakers = dispatcher.breakers
        self.reprefills = Counter(
            "kvroute_proxy_pd_reprefills",
            "P/D requests prefilled again: the decode replica failed or could not read the KV",
            ["reason"],
            registry=dispatcher.metrics.registry,
        )
        self._prefilled: dict[int, _Prefilled] = {}  # by id(Exchange), until finished
        self.models: frozenset[str] = frozenset()
        self.fleet.subscribe(self._membership)
        self._membership()

    def _membership(self) -> None:
        """The models some of whose replicas have a P/D role: what this path sends."""
        models: set[str] = set()
        for endpoint in self.fleet.replicas.endpoints():
            if endpoint.role != "both":
                models.update((endpoint.model, *endpoint.served_names))
        self.models = frozenset(models)

    def _clock(self) -> float:
        return self.d._clock()

    async def send(
        self, exchange: Exchange, path: str, body: bytes, headers: Sequence[tuple[str, str]]
    ) -> Attempt:
        prefills, decodes = self._roles(exchange.prepared.model)
        _check_pool(exchange.prepared.model, prefills, decodes)
        request = _without_transfer(json.loads(body))
        tried_p: set[int] = set()
        tried_d: set[int] = set()
        last = "no replica could take the request"
        try:
            for tries in range(1, self.d.policies.retry_attempts + 2):
                prefill, decision, predicted = self._pick_prefill(exchange, prefills, tried_p)
                decode = self._pick_decode(exchange, decodes, tried_d)
                if prefill is None or decode is None:
                    break
                try:
                    return await self._both(
                        exchange, path, request, headers, (prefill, decision, predicted), decode
                    )
                except _Refused as refused:  # relayed as the prefill replica answered it
                    return Attempt(refused.opened, decision, prefill, predicted, None, tries)
                except _Failed as failure:
                    last = str(failure)
                    if failure.reprefill:
                        tried_d.add(decode.ordinal)
                        self.reprefills.labels("decode").inc()
                    if not failure.reprefill or (
                        failure.kv_lost and len(tried_p) + 1 < len(prefills)
                    ):  # a KV that could not be read is the prefill's too (a dead bootstrap)
                        tried_p.add(prefill.ordinal)
                    if not self.d._may_retry(Retriable(last, failure.reason), tries):
                        break
        finally:
            if not exchange.tried:
                self.d._routed(exchange)
        exchange.outcome = "no_replica"
        retry_after = self.d.policies.retry_after_s
        raise NoReplica(f"No P/D pair could take the request ({last}).", retry_after)

    def finish(self, exchange: Exchange) -> bool:
        """The dispatcher's ``finish`` of a request this path sent; ``False`` for others."""
        prefilled = self._prefilled.pop(id(exchange), None)
        attempt = exchange.attempt
        if prefilled is None or attempt is None:
            return False
        self.d.answered(attempt)
        self.fleet.inflight.on_done(attempt.ticket)
        if exchange.usage is not None:  # the prediction is the prefill replica's
            exchange.usage = replace(exchange.usage, cached_tokens=prefilled.cached)
        self.d.account(exchange, prefilled.endpoint, attempt.predicted, attempt.opened.status)
        return True

    # -- picking -------------------------------------------------------------------------

    def _roles(self, model: str) -> tuple[list[Endpoint], list[Endpoint]]:
        """The prefill and decode candidates of ``model``'s routable replicas (``both``
        ones in each)."""
        endpoints = [
            self.fleet.replicas.endpoint(r.ordinal) for r in self.fleet.views.view(model).replicas()
        ]
        live = [e for e in endpoints if e is not None]
        prefills = [e for e in live if e.role != "decode"]
        decodes = [e for e in live if e.role != "prefill"]
        return prefills, decodes

    def _pick_prefill(
        self, exchange: Exchange, prefills: list[Endpoint], tried: set[int]
    ) -> tuple[Endpoint | None, Decision, int]:
        """The policy's pick among the prefill replicas not tried yet."""
        now = self._clock()
        allowed = {e.ordinal for e in prefills} - tried
        others = {r.ordinal for r in self.fleet.views.view(exchange.prepared.model).replicas()}
        exclude = frozenset(others - allowed) | self.breakers.excluded(now)
        decision, predicted = self.router.choose(exchange.prepared, now=now, exclude=exclude)
        endpoint = (
            None if decision.ordinal is None else self.fleet.replicas.endpoint(decision.ordinal)
        )
        return endpoint, decision, predicted

    def _pick_decode(
        self, exchange: Exchange, decodes: list[Endpoint], tried: set[int]
    ) -> Endpoint | None:
        """The decode replica by load, KV headroom and, where decode replicas report
        residency, the prompt they hold (:func:`kvcore.decode_choice.choose_decode`)."""
        now = self._clock()
        held_out = self.breakers.excluded(now)
        states = {r.ordinal: r for r in self.fleet.views.view(exchange.prepared.model).replicas()}
        usable = {
            e.ordinal: e
            for e in decodes
            if e.ordinal not in tried and e.ordinal not in held_out and e.ordinal in states
        }
        runs = self._resident(exchange, usable, now)
        ordinal = choose_decode(
            [DecodeCandidate(o, states[o].load, states[o].kv_usage, runs.get(o, 0)) for o in usable]
        )
        return None if ordinal is None else usable[ordinal]

    def _resident(
        self, exchange: Exchange, usable: dict[int, Endpoint], now: float
    ) -> dict[int, int]:
        """The prompt's leading blocks each usable decode replica reported holding."""
        keys = exchange.prepared.block_keys
        if not keys or not usable:
            return {}
        view = self.fleet.views.view(exchange.prepared.model)
        runs = view.leading_runs(keys, now=now)
        return {o: n for o, n in runs.items() if o in usable}

    # -- the two halves ------------------------------------------------------------------

    async def _both(
        self,
        exchange: Exchange,
        path: str,
        request: dict[str, Any],
        headers: Sequence[tuple[str, str]],
        picked: tuple[Endpoint, Decision, int],
        decode: Endpoint,
    ) -> Attempt:
        pair = _Pair(exchange, path, request, headers, picked, decode)
        prefill, decision, predicted = picked
        half = self._sglang(pair) if prefill.engine_kind == "sglang" else self._vllm(pair)
        opened, ticket, cached = await half
        self._prefilled[id(exchange)] = _Prefilled(prefill, cached)
        return Attempt(opened, decision, decode, predicted, ticket, len(exchange.tried))

    async def _vllm(self, pair: _Pair) -> tuple[Opened, InflightTicket | None, int | None]:
        """Prefill, then decode with the transfer parameters the prefill answered."""
        answer = await self._prefill(pair, _vllm_prefill_body(pair.request))
        params = _json(answer.first).get("kv_transfer_params")
        if not isinstance(params, dict):
            raise _Failed(
                f"{pair.picked[0].replica_id}: the prefill answered no kv_transfer_params"
            )
        opened, ticket = await self._decode(pair, {**pair.request, "kv_transfer_params": params})
        return opened, ticket, _cached(answer.first)

    async def _sglang(self, pair: _Pair) -> tuple[Opened, InflightTicket | None, int | None]:
        """Both halves at once; the prefill's answer (read whole) comes once the decode
        replica read the KV, so a decode that fails first abandons it."""
        paired = {**pair.request, **_bootstrap(pair.picked[0])}
        whole = {k: v for k, v in paired.items() if k != "stream_options"} | {"stream": False}
        prefill_s = self._prefill_deadline_s(pair)  # the decode's first bytes wait for it too
        decoding = asyncio.create_task(self._decode(pair, paired, prefill_s))
        prefilling = asyncio.create_task(self._prefill(pair, whole))
        try:
            done, _ = await asyncio.wait((decoding, prefilling), return_when="FIRST_EXCEPTION")
            for task in sorted(done, key=lambda task: task is not prefilling):
                task.result()  # a failure: raised, the prefill's first (the cause when both)
            answer = await prefilling
            opened, ticket = await decoding
        except BaseException:
            for task in (decoding, prefilling):
                task.cancel()
            self._drop(decoding)
            raise
        return opened, ticket, _cached(answer.first)

    def _drop(self, decoding: asyncio.Task[tuple[Opened, InflightTicket | None]]) -> None:
        """A decode answer opened for a prefill that failed: closed, its count ended."""
        if decoding.done() and not decoding.cancelled() and decoding.exception() is None:
            opened, ticket = decoding.result()
            opened.close()
            self.fleet.inflight.on_done(ticket)

    async def _prefill(self, pair: _Pair, request: dict[str, Any]) -> Opened:
        """The prefill half's whole answer; its in-flight count ends with it."""
        endpoint, decision, predicted = pair.picked
        body = json.dumps(request).encode()
        pending = self.upstream.send("POST", endpoint.base_url + pair.path, body, pair.headers)
        now = self._clock()
        ticket = self.d.sent(pair.exchange, decision, endpoint, now, predicted)
        try:
            opened = await self.d.first_bytes(
                pending, endpoint, self._prefill_deadline_s(pair), streamed=False
            )
        except Retriable as failure:
            self.breakers.on_failure(endpoint.replica_id, endpoint.ordinal, self._clock())
            raise _Failed(f"{endpoint.replica_id}: {failure}", reason=failure.reason) from None
        finally:
            self.fleet.inflight.on_done(ticket)
        if 400 <= opened.status < 500:  # the request's fault: the client gets it as is
            raise _Refused(opened)
        opened.release()
        if opened.status >= 500:
            raise _Failed(f"{endpoint.replica_id}: the prefill answered {opened.status}")
        self.d.first_byte(None, endpoint.replica_id, opened.status, False, opened.ttfb_s)
        return opened

    def _prefill_deadline_s(self, pair: _Pair) -> float:
        """The prefill half's first-byte deadline: its replica's, for the prompt's tokens
        it does not hold."""
        endpoint, _, predicted = pair.picked
        return self.d.deadline_s(endpoint, pair.exchange.prepared.prompt_tokens - predicted)

    async def _decode(
        self, pair: _Pair, request: dict[str, Any], prefill_s: float = 0.0
    ) -> tuple[Opened, InflightTicket | None]:
        """The decode half's first bytes, or :class:`_Failed` (re-prefill) when it failed,
        missed its first-byte deadline or could not read the KV. Its deadline is its
        replica's with nothing to compute (reading the KV is in its typical time to first
        byte), plus ``prefill_s`` when the prefill runs meanwhile."""
        endpoint = pair.decode
        body = json.dumps(request).encode()
        pending = self.upstream.send("POST", endpoint.base_url + pair.path, body, pair.headers)
        now = self._clock()
        ticket = self.fleet.inflight.on_sent(endpoint.ordinal, time.time(), 0, 0)
        self.breakers.on_sent(endpoint.replica_id, endpoint.ordinal, now)
        deadline_s = prefill_s + self.d.deadline_s(endpoint, 0)
        try:
            opened = await self.d.first_bytes(
                pending, endpoint, deadline_s, pair.exchange.request.stream
            )
        except BaseException as exc:
            self.fleet.inflight.on_done(ticket)
            if isinstance(exc, Retriable):
                self.breakers.on_failure(endpoint.replica_id, endpoint.ordinal, self._clock())
                raise _Failed(
                    f"{endpoint.replica_id}: {exc}", reprefill=True, reason=exc.reason
                ) from None
            pending.close()
            raise
        if opened.status >= 500 or (opened.streaming and _error_event(opened.first)):
            opened.close()
            self.fleet.inflight.on_done(ticket)
            raise _Failed(
                f"{endpoint.replica_id}: could not read the KV", reprefill=True, kv_lost=True
            )
        return opened, ticket


class _Refused(Exception):
    """The prefill replica refused the request (4xx): the client's answer."""

    def __init__(self, opened: Opened) -> None:
        super().__init__(opened.status)
        self.opened = opened


def _check_pool(model: str, prefills: list[Endpoint], decodes: list[Endpoint]) -> None:
    """503 naming the half a P/D pool lacks."""
    missing = [name for name, ends in (("prefill", prefills), ("decode", decodes)) if not ends]
    if missing:
        raise NoReplica(
            f"Model `{model}` is served disaggregated but has no healthy "
            f"{' or '.join(missing)} replica.",
            5,
        )


def _without_transfer(request: Any) -> dict[str, Any]:
    """The client's request without the transfer fields only the proxy may set."""
    if not isinstance(request, dict):
        return {}
    return {k: v for k, v in request.items() if k not in TRANSFER_FIELDS}


def _vllm_prefill_body(request: dict[str, Any]) -> dict[str, Any]:
    """vLLM's proxy's prefill request: one token, no stream, ``do_remote_decode``."""
    first = {k: v for k, v in request.items() if k != "stream_options"}
    first.update(kv_transfer_params=vllm_prefill_params(), max_tokens=1, stream=False)
    if "max_completion_tokens" in first:
        first["max_completion_tokens"] = 1
    return first


def _bootstrap(prefill: Endpoint) -> dict[str, Any]:
    """SGLang's pairing fields for a request prefilled on ``prefill``."""
    return {
        "bootstrap_host": urlsplit(prefill.base_url).hostname,
        "bootstrap_port": prefill.bootstrap_port or SGLANG_BOOTSTRAP_PORT,
        "bootstrap_room": random.getrandbits(63),
    }


def _json(body: bytes) -> dict[str, Any]:
    try:
        value = json.loads(body)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def _cached(body: bytes) -> int | None:
    usage = usage_of(body)
    return None if usage is None else usage.cached_tokens


def _error_event(first: bytes) -> bool:
    """A stream that opens with an error event: the engine failed the request."""
    return first.lstrip().startswith(b'data: {"error"')


async def sglang_role(session: aiohttp.ClientSession, base_url: str) -> tuple[Role | None, int]:
    """A static SGLang replica's P/D role and bootstrap port, from its ``/server_info``;
    ``(None, 0)`` when it cannot say."""
    try:
        async with session.get(base_url + "/server_info") as response:
            if response.status != 200:
                return None, 0
            return sglang_disaggregation(await response.json(content_type=None))
    except (aiohttp.ClientError, TimeoutError, ValueError):
        return None, 0
