"""First-byte deadlines and suspect replicas: a hung engine must not hold requests.

A stopped engine (SIGSTOP), or one wedged in a collective or on a GPU fault, still
accepts TCP connections (the kernel does) and its sidecar may go on heartbeating, so
neither ``connect_timeout_s`` nor the control plane notices it; ``upstream_timeout_s``
(600 s) is far too long to wait. What does notice is time: a streamed request's first
event comes with its first token, after its prefill, and each replica's usual time to
that event is known to the proxy. So a streamed request gets a deadline for its first
bytes on the replica it is sent to::

    min(upstream_timeout_s, max(floor_s, factor x typical_s) + uncached / slowest_tokens_per_s)

``typical_s`` is the replica's recent time to first byte (a moving average of its
streamed answers, :meth:`FirstByteDeadlines.answered`); ``factor`` leaves room for the
requests queued ahead of this one; the request's uncached tokens are added at a prefill
rate slower than any GPU's, so a long prompt is never cut for being long. Past the
deadline nothing has reached the client: the request moves to another replica
(``exchange.py``) and the replica is *suspect* (``CircuitBreakers.suspect``): no new
request goes to it until a probe of its ``/health`` answers (:class:`SuspectProber`,
Envoy's active health checking), or a request it still had answers.

A whole (non-streamed) answer's first bytes are its response head, which an engine
sends only once the whole decode is done: a legitimate answer of 4,000 tokens takes
minutes, and nothing the proxy knows bounds it (``max_tokens`` may be absent, and a
loaded engine decodes slower). So for a whole answer the deadline bounds the replica's
*silence*, not the answer: the request waits as long as its replica shows it is alive,
and moves once the replica has said nothing, to anyone, for that request's deadline
(the same ``deadline_s``) since the later of the request's sending and the replica's
last sign of life. A sign of life is any answer's first bytes from the replica
(:meth:`FirstByteDeadlines.heard_from`) or an answer to a ``/health`` probe, which the
deadlines ask for (:meth:`SuspectProber.ask`, once per replica at a time) when a waiting
whole request has heard nothing for half its deadline. A hung engine answers neither, so
a whole request costs it what a streamed one does: its deadline, then another replica;
a long generation on a live engine costs a probe per half deadline while nothing else
comes back from it. Like the suspect probe, this trusts the engine's ``/health``.

The deadlines are kept by one task that looks every ``tick_s`` (:meth:`FirstByteDeadlines.run`)
and cancels the requests past theirs, rather than a loop timer per request: arming and
cancelling one costs several times what keeping a request in a dict does (as with
``transport.client.ReadDeadlines``), and a deadline of a second or more may fire a tick late.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Protocol

from dataplane.breaker import CircuitBreakers
from dataplane.endpoints import Endpoint
from dataplane.upstream import Opened, Retriable

log = logging.getLogger("dataplane")
SMOOTHING = 0.2  # weight of the newest time to first byte in a replica's typical one
HEALTH_PATH = "/health"  # vLLM's, SGLang's and kvroute-sim's
NEVER = float("-inf")


# a whole request waiting for its answer: it moves once its replica has been silent for
# its deadline (seconds) since its sending (clock) or a later sign of life
Silence = tuple[Endpoint, float, float]  # (endpoint, sent, deadline_s)


class FirstByteDeadlines:
    """Each replica's typical time to first byte, the deadline it gives a request, and
    the requests waiting for their first bytes."""

    __slots__ = (
        "_asked", "_asking", "_clock", "_expired", "_heard", "_loop", "_typical", "_waiting",
        "_whole", "ask", "cap_s", "factor", "floor_s", "slowest_tokens_per_s", "tick_s",
    )  # fmt: skip

    def __init__(
        self,
        floor_s: float,
        factor: float,
        slowest_tokens_per_s: float,
        cap_s: float,
        clock: Callable[[], float],
        ask: Callable[[Endpoint], Awaitable[bool]] | None = None,
    ) -> None:
        self.floor_s = floor_s
        self.factor = factor
        self.slowest_tokens_per_s = slowest_tokens_per_s
        self.cap_s = cap_s
        self.tick_s = min(0.1, floor_s / 4)
        self.ask = ask  # None: whole requests move after their deadline whatever happens
        self._clock = clock
        self._typical: dict[str, float] = {}  # replica id -> seconds
        self._waiting: dict[asyncio.Task[Any], float] = {}  # request -> deadline (clock)
        self._whole: dict[asyncio.Task[Any], Silence] = {}  # whole requests waiting
        self._heard: dict[str, float] = {}  # replica id -> its last sign of life (clock)
        self._asked: dict[str, float] = {}  # replica id -> when its last probe went out
        self._asking: set[asyncio.Task[None]] = set()  # probes out
        self._expired: set[asyncio.Task[Any]] = set()  # cancelled here, not yet told
        self._loop: asyncio.AbstractEventLoop | None = None  # the one :meth:`run` runs on

    def deadline_s(self, replica_id: str, uncached_tokens: int) -> float:
        """Seconds a request sent now to ``replica_id`` may wait for its first bytes
        (streamed), or for a sign of life from its replica (whole)."""
        typical = self._typical.get(replica_id, 0.0)
        waited = max(self.floor_s, self.factor * typical)
        return min(self.cap_s, waited + max(uncached_tokens, 0) / self.slowest_tokens_per_s)

    def answered(self, replica_id: str, ttfb_s: float) -> None:
        """A streamed answer's first bytes came after ``ttfb_s``."""
        typical = self._typical.get(replica_id)
        if typical is None:
            self._typical[replica_id] = ttfb_s
        else:
            self._typical[replica_id] = typical + SMOOTHING * (ttfb_s - typical)

    def heard_from(self, replica_id: str, at: float) -> None:
        """The replica was alive at ``at`` (clock): an answer's first bytes came from it,
        or it answered a probe sent then."""
        if at > self._heard.get(replica_id, NEVER):
            self._heard[replica_id] = at

    def begin(self, deadline_s: float) -> asyncio.Task[Any]:
        """The running request waits for first bytes from now on, ``deadline_s`` at most;
        past it, :meth:`run` cancels it. Call :meth:`end` once it stops waiting."""
        task = self._current_task()
        self._waiting[task] = self._clock() + deadline_s
        return task

    def begin_whole(self, endpoint: Endpoint, deadline_s: float) -> asyncio.Task[Any]:
        """The running request waits for a whole answer from ``endpoint``: :meth:`run`
        cancels it once the replica has been silent for ``deadline_s``. Call
        :meth:`end` once it stops waiting."""
        task = self._current_task()
        self._whole[task] = (endpoint, self._clock(), deadline_s)
        return task

    def _current_task(self) -> asyncio.Task[Any]:
        """The running request: the current task of the loop :meth:`run` runs on, asked
        by that loop (``asyncio.current_task()`` finds the running loop first, which
        costs a ``getpid()`` call: a few microseconds a request on a virtual machine);
        else, or when that loop runs nothing now, of the running loop."""
        loop = self._loop
        task = None if loop is None else asyncio.current_task(loop)
        if task is None:
            task = asyncio.current_task()
        assert task is not None
        return task

    def end(self, task: asyncio.Task[Any]) -> bool:
        """The request stopped waiting; whether it was because its deadline passed (then
        its cancellation is taken back: the caller goes on with another replica)."""
        if self._waiting.pop(task, None) is None:
            self._whole.pop(task, None)
        if task not in self._expired:
            return False
        self._expired.discard(task)
        task.uncancel()
        return True

    async def run(self) -> None:
        """Cancel every request past its deadline, each ``tick_s``."""
        self._loop = asyncio.get_running_loop()
        try:
            while True:
                await asyncio.sleep(self.tick_s)  # the deadlines' resolution
                now = self._clock()
                late = [task for task, at in self._waiting.items() if at <= now]
                for task in late:
                    del self._waiting[task]
                    self._expire(task)
                if self._whole:
                    self._watch_silences(now)
        finally:
            self._loop = None
            for probe in list(self._asking):
                probe.cancel()

    def _expire(self, task: asyncio.Task[Any]) -> None:
        self._expired.add(task)
        task.cancel()

    def _watch_silences(self, now: float) -> None:
        """Cancel the whole requests whose replica has been silent too long; ask the
        replicas silent for half a request's deadline whether they are alive."""
        heard = self._heard
        late = []
        for task, (endpoint, sent, deadline_s) in self._whole.items():
            replica_id = endpoint.replica_id
            since = max(sent, heard.get(replica_id, sent))
            if now >= since + deadline_s:
                late.append(task)
            elif now >= since + deadline_s / 2 and self._asked.get(replica_id, NEVER) <= since:
                self._probe(endpoint, now)  # half its deadline silent, and no probe out since
        for task in late:
            del self._whole[task]
            self._expire(task)

    def _probe(self, endpoint: Endpoint, now: float) -> None:
        ask = self.ask
        if ask is None:
            return
        self._asked[endpoint.replica_id] = now
        probe = asyncio.create_task(self._hear(ask, endpoint, now))
        self._asking.add(probe)
        probe.add_done_callback(self._asking.discard)

    async def _hear(
        self, ask: Callable[[Endpoint], Awaitable[bool]], endpoint: Endpoint, sent: float
    ) -> None:
        if await ask(endpoint):
            self.heard_from(endpoint.replica_id, sent)


class Replicas(Protocol):
    """Where the fleet's replicas are now (``dataplane.fleet.replicas.ReplicaTable``)."""

    def endpoint(self, ordinal: int) -> Endpoint | None: ...


class Opening(Protocol):
    """How the prober asks a replica (``dataplane.upstream.Upstream``; a protocol, so
    that this compiled module takes any such object)."""

    async def open(
        self, method: str, url: str, body: bytes, headers: Sequence[tuple[str, str]]
    ) -> Opened: ...


class SuspectProber:
    """Probes each suspect replica's ``/health`` every ``interval_s`` (each probe bounded
    by ``timeout_s``); the first 2xx answer makes it routable again. A suspect that left
    the fleet, or whose ordinal now names another replica, is forgotten rather than
    probed: suspicion has no end in time, and it must not keep another replica out."""

    def __init__(
        self,
        breakers: CircuitBreakers,
        replicas: Replicas,
        upstream: Opening,
        interval_s: float,
        timeout_s: float,
        clock: Callable[[], float],
    ) -> None:
        self.breakers = breakers
        self.replicas = replicas
        self.upstream = upstream
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self._clock = clock

    async def run(self) -> None:
        while True:
            await self.probe_all()
            await asyncio.sleep(self.interval_s)  # the probes' period

    async def probe_all(self) -> None:
        probes = []
        for replica_id, (ordinal, base_url) in self.breakers.suspects().items():
            endpoint = self.replicas.endpoint(ordinal)
            if endpoint is None or endpoint.replica_id != replica_id:
                self.breakers.on_probe_answered(replica_id, self._clock())
            else:
                probes.append(self._probe(replica_id, base_url))
        await asyncio.gather(*probes)

    async def _probe(self, replica_id: str, base_url: str) -> None:
        if await self.healthy(replica_id, base_url):
            log.info("suspect replica answers its probe", extra={"replica": replica_id})
            self.breakers.on_probe_answered(replica_id, self._clock())

    async def ask(self, endpoint: Endpoint) -> bool:
        """Whether ``endpoint`` is alive: its ``/health`` answered 2xx within
        ``timeout_s`` (:class:`FirstByteDeadlines`' question for a silent replica)."""
        return await self.healthy(endpoint.replica_id, endpoint.base_url)

    async def healthy(self, replica_id: str, base_url: str) -> bool:
        try:
            async with asyncio.timeout(self.timeout_s):
                opened = await self.upstream.open("GET", base_url + HEALTH_PATH, b"", ())
        except (Retriable, TimeoutError):
            return False
        except Exception:  # a bug here must not end the probes: the replica stays out
            log.exception("probe failed", extra={"replica": replica_id})
            return False
        opened.release()
        return opened.status < 300
