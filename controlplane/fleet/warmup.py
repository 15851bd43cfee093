"""The leader warms replicas that join empty with the workloads' hot prefixes.

Proxies report each workload's hot prefixes (``ProxyReport.hot_prefixes``: token ids
that many distinct requests began with); :class:`HotPrefixStore` keeps them, the rates
of the proxies' latest reports summed, and forgets a prefix no proxy reported for
``ttl_s``. Every ``interval_s`` the :class:`Warmer`, on the leader only, looks for a
replica that joined empty: announced, healthy, its residency known exactly (the stream
is in sync) and holding nothing; new, restarted, or its cache cleared. For each workload
with ``warmup.enabled`` it plans (:func:`kvcore.warmup.plan`: first the prefixes whose
holders are the most loaded, by the requests running and waiting on the least busy
holder as last reported, then the most valuable, requests per second times uncached
tokens, within ``warmup.max_tokens``) and sends each prefix once as a ``max_tokens`` 1
completion by token ids to the engine's own API, at most ``warmup.tokens_per_s``, one
at a time. Replicas found empty in the same check (a scale-out) are planned together,
each in a staggered order (:func:`kvcore.warmup.stagger`) and each with its share of
the prefixes (:func:`kvcore.warmup.share`: ``1 / n`` of their requests per second with
``n`` replicas warming), not every hot prefix. A prefix the replica holds by then (traffic
brought it) is skipped. A failed send is counted and not retried; three in a row, or an
answer refusing the request (4xx), end the warm-up. It ends too when its prefixes are
confirmed by the replica's KV events, after ``warmup.max_duration_s``, or when the
replica goes away.

While it warms, the replica's ``Replica.warmup`` (streamed to proxies) says so and
names the prefixes sent or queued and not yet confirmed: the proxies give it only
``warmup.new_prefix_share`` of new prefixes and none of those (``kvcore.warmup.gate``).
Routing never waits on any of this. The state is also shared (``share``: through etcd, see
:class:`~controlplane.fleet.leadership.Leadership`) with the standby, whose proxies apply
it alike.

A drained replica's hot prefixes that no other replica holds are first sent to the
least busy healthy replica (:meth:`Warmer.rehome`), so that they survive its leaving.

An instance that loses the leadership drops all of it (:meth:`Warmer.step_down`): its
sends are cancelled, its warm-ups end (outcome ``stepped_down``), the replicas' warm-up
state it published is withdrawn, and what it had warmed or re-homed is forgotten. The
new leader plans afresh from the fleet as it finds it; so does this instance if it leads
again, never from a plan (pending prefixes, a budget half spent) made in a past term.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from array import array
from collections.abc import Awaitable, Callable, Coroutine, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from controlplane.fleet.fleet import Fleet, ReplicaRecord
from kvcore.keys import chain_keys, root_key
from kvcore.pb import events_pb2, routing_pb2
from kvcore.warmup import (
    TRANSFERS_IN_FLIGHT,
    HotPrefix,
    Pacer,
    Step,
    Warming,
    moves_it,
    plan,
    share,
    stagger,
)
from kvcore.workload import InvalidWorkload, Workload, parse_workload
from kvruntime.tasks import BackgroundTasks

log = logging.getLogger(__name__)

MAX_PREFIX_TOKENS = 131_072
MAX_STORED = 4096  # hot prefixes kept in all
FAILURES_IN_A_ROW = 3


class WarmupRefused(RuntimeError):
    """The engine refused a warm-up request (a 4xx): the warm-up ends."""


class WarmupFailed(RuntimeError):
    """A warm-up request failed (connection, timeout, 5xx): counted, not retried."""


# base URL, model, token ids -> None, or raises WarmupRefused / WarmupFailed
Send = Callable[[str, str, list[int]], Awaitable[None]]
Share = Callable[[str, str, frozenset[int] | None], None]  # (pool, replica id, pending)
# source base URL, target base URL, model, token ids -> None, or raises WarmupFailed
# (warmup_transfer.EngineTransfers.move: the prefix read by the target, not computed)
Move = Callable[[str, str, str, list[int]], Awaitable[None]]


@dataclass
class _Stored:
    prefix: HotPrefix
    workload: str
    rates: dict[str, tuple[float, float]] = field(default_factory=dict)  # proxy -> rate, at


class HotPrefixStore:
    """The proxies' hot prefixes by (workload, last key), rates summed over proxies."""

    def __init__(self, ttl_s: float = 60.0) -> None:
        self.ttl_s = ttl_s
        self._stored: dict[tuple[str, int], _Stored] = {}
        self.rejected = 0
        self.version = 0  # bumped when a prefix not kept is added

    def add(self, report: routing_pb2.ProxyReport, now: float) -> None:
        for hot in report.hot_prefixes:
            problem = _problem(hot)
            if problem:
                self.rejected += 1
                continue
            key = (hot.workload, hot.key)
            stored = self._stored.get(key)
            if stored is None:
                if len(self._stored) >= MAX_STORED:
                    self.expire(now, keep=MAX_STORED // 2)
                tokens = array("I", hot.token_ids)
                prefix = HotPrefix(hot.model, hot.key, tokens, hot.block_size, 0.0)
                stored = self._stored[key] = _Stored(prefix, hot.workload)
                self.version += 1
            stored.rates[report.proxy_id] = (hot.requests_per_s, now)

    def expire(self, now: float, keep: int | None = None) -> None:
        for key, stored in list(self._stored.items()):
            stored.rates = {p: r for p, r in stored.rates.items() if now - r[1] <= self.ttl_s}
            if not stored.rates:
                del self._stored[key]
        if keep is not None and len(self._stored) > keep:
            ranked = sorted(self._stored, key=lambda k: self._rate(self._stored[k]))
            for key in ranked[: len(self._stored) - keep]:
                del self._stored[key]

    def prefixes(self, workload: str, model: str, now: float) -> list[HotPrefix]:
        self.expire(now)
        return [
            HotPrefix(s.prefix.model, s.prefix.key, s.prefix.tokens, s.prefix.block_size, rate)
            for s in self._stored.values()
            if s.workload == workload and s.prefix.model == model and (rate := self._rate(s)) >= 0
        ]

    def all_prefixes(self, now: float) -> list[HotPrefix]:
        self.expire(now)
        return [s.prefix for s in self._stored.values()]

    def __len__(self) -> int:
        return len(self._stored)

    @staticmethod
    def _rate(stored: _Stored) -> float:
        return sum(rate for rate, _ in stored.rates.values())


def _problem(hot: routing_pb2.HotPrefix) -> str:
    size = hot.block_size
    if not hot.workload or not hot.model or size < 1:
        return "names"
    if not hot.token_ids or len(hot.token_ids) % size or len(hot.token_ids) > MAX_PREFIX_TOKENS:
        return "tokens"
    if not math.isfinite(hot.requests_per_s) or hot.requests_per_s < 0:
        return "rate"
    return ""


@dataclass
class _Job:
    """One replica's warm-up: one :class:`Warming` per workload, sent in turn."""

    record: ReplicaRecord
    warmings: list[Warming]
    term: int  # the warmer's leadership term it was planned in
    keys: dict[int, list[int]] = field(default_factory=dict)  # last key -> all its keys
    task: asyncio.Task[None] | None = None  # its sends

    @property
    def active(self) -> bool:
        return any(w.warming for w in self.warmings)

    def pending(self) -> frozenset[int]:
        return frozenset(k for w in self.warmings if w.warming for k in w.pending)

    def queue(self) -> list[int]:
        """The keys still to send, in order."""
        return [k for w in self.warmings if w.warming for k in w.queue()]


@dataclass
class WarmupCounters:
    started: int = 0
    sent: int = 0
    sent_tokens: int = 0
    skipped: int = 0
    confirmed: int = 0
    failed: int = 0
    rehomed: int = 0
    moved: int = 0  # source transfer: prefixes read from a replica holding them
    # source transfer: computed by the warming replica instead (no holder, the holders
    # queued while it was idle, the move failed, SGLang)
    fell_back: int = 0
    outcomes: dict[str, int] = field(default_factory=dict)


class Warmer:
    """See the module docstring."""

    def __init__(
        self,
        fleet: Fleet,
        workloads: Callable[[], Iterable[Workload]],
        is_leader: Callable[[], bool],
        send: Send,
        *,
        interval_s: float = 0.25,
        clock: Callable[[], float] = time.monotonic,
        share: Share | None = None,
        move: Move | None = None,
    ) -> None:
        self.fleet = fleet
        self.store = HotPrefixStore()
        self.counters = WarmupCounters()
        self._workloads = workloads
        self._is_leader = is_leader
        self._send = send
        self._interval_s = interval_s
        self._clock = clock
        self._share = share
        self._move = move
        self._jobs: dict[str, _Job] = {}  # replica id -> its warm-up, running or last
        self._done: set[str] = set()  # warm-up planned since it was last empty
        # empty replicas found with nothing to warm -> the store's version then: planned
        # again, while they stay empty, once a prefix is added (becomes hot)
        self._nothing: dict[str, int] = {}
        self._rehomed: set[str] = set()  # drained replicas whose prefixes were sent away
        self._term = 0  # bumped when this instance stops leading: older plans are void
        self._tasks = BackgroundTasks()
        self._sends: set[asyncio.Task[None]] = set()  # warm-ups' and re-homings' sends

    # -- inputs -------------------------------------------------------------------------

    def on_report(self, report: routing_pb2.ProxyReport) -> None:
        if report.hot_prefixes:
            self.store.add(report, self._clock())

    # -- lifecycle ----------------------------------------------------------------------

    async def start(self) -> None:
        if not self._tasks.running:
            self._tasks.spawn(self._run(), name="warmup")

    async def aclose(self) -> None:
        await self._tasks.aclose()

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self._interval_s)  # the check period, not a readiness wait
            if self._is_leader():
                self.tick()

    def step_down(self) -> None:
        """This instance no longer leads: cancel its sends, end its warm-ups, withdraw the
        warm-up state it gave the replicas, forget what it warmed and re-homed (see the
        module docstring). Counters and the proxies' hot prefixes stay."""
        self._term += 1
        for task in self._sends:
            task.cancel()
        self._sends.clear()
        now = self._clock()
        for job in self._jobs.values():
            if not job.active:
                continue
            for warming in job.warmings:
                if warming.warming:
                    warming.end("stepped_down", now)
                    self._count_outcome(warming)
            record = job.record
            if record.warmup is not None:  # the next leader's state comes through etcd
                record.warmup = None
                self.fleet.changes.replica(record.ordinal)
        self._jobs.clear()
        self._done.clear()
        self._nothing.clear()
        self._rehomed.clear()

    # -- what /v1/replicas and the metrics read -------------------------------------------

    def state_of(self, replica_id: str) -> dict[str, object] | None:
        job = self._jobs.get(replica_id)
        if job is None:
            return None
        return {
            "warming": job.active,
            "pending": len(job.pending()),
            "workloads": [w.summary() for w in job.warmings],
        }

    def warming_count(self) -> int:
        return sum(1 for job in self._jobs.values() if job.active)

    # -- the check ------------------------------------------------------------------------

    def tick(self) -> None:
        """Start warm-ups of replicas found empty, confirm and end running ones, send
        away drained replicas' prefixes."""
        now = self._clock()
        joining = []
        for record in list(self.fleet.by_id.values()):
            job = self._jobs.get(record.replica_id)
            if job is not None and job.active:
                self._check(job, now)
            elif self._empty(record) and record.replica_id not in self._done:
                if self._nothing.get(record.replica_id) != self.store.version:
                    joining.append(record)
            elif self.fleet.index.key_count(record.ordinal) > 0:
                self._done.discard(record.replica_id)  # empty again later: warm again
                self._nothing.pop(record.replica_id, None)
            if record.is_draining and record.replica_id not in self._rehomed:
                self._rehomed.add(record.replica_id)
                self.rehome(record)
            elif not record.is_draining:
                self._rehomed.discard(record.replica_id)
        together = len(joining) + self.warming_count()
        for record in joining:
            self._start(record, now, together)

    def _empty(self, record: ReplicaRecord) -> bool:
        return (
            record.announced
            and not record.down
            and not record.stale
            and not record.is_draining
            and not record.state_incomplete
            and record.stream.exact
            and self.fleet.index.key_count(record.ordinal) == 0
        )

    def _start(self, record: ReplicaRecord, now: float, together: int) -> None:
        """Plan ``record``'s warm-up, its share of ``together`` replicas warming."""
        announce = record.announce
        assert announce is not None
        job = _Job(record, [], self._term)
        running = [other.queue() for other in self._jobs.values() if other.active]
        for workload in self._workloads():
            if not workload.warmup.enabled:
                continue
            warming = Warming(record.replica_id, workload.name, now, workload.warmup)
            prefixes = self.store.prefixes(workload.name, announce.model, now)
            steps = self._plan(job, prefixes, warming.settings.max_tokens)
            # moved by transfer a prefix costs the joiner no prefill: each warms all
            shared = together if warming.settings.source == "recompute" else 1
            warming.steps = share(stagger(steps, running), shared, running)
            warming.pending = {s.prefix.key: s for s in warming.steps}
            if not warming.steps:
                warming.end("nothing", now)
            job.warmings.append(warming)
        if not job.active:
            # nothing to send (nothing hot yet, or no workload warms): planned again,
            # while it stays empty, once a prefix becomes hot
            self._nothing[record.replica_id] = self.store.version
            if job.warmings:
                self._jobs[record.replica_id] = job
                for warming in job.warmings:
                    self._count_outcome(warming)
            return
        self._done.add(record.replica_id)
        self._nothing.pop(record.replica_id, None)
        self._jobs[record.replica_id] = job
        self.counters.started += 1
        self._publish(job)
        job.task = self._spawn_send(self._warm(job), f"warmup-{record.replica_id}")
        log.info(
            "warming replica %s: %d prefixes",
            record.replica_id,
            sum(len(w.steps) for w in job.warmings),
        )

    def _plan(self, job: _Job, prefixes: list[HotPrefix], max_tokens: int) -> list[Step]:
        """:func:`kvcore.warmup.plan` for ``job``'s replica, each prefix's leading runs
        read once (what the replica holds and its holders' load)."""
        runs = {p.key: self._runs(job, p) for p in prefixes}
        ordinal = job.record.ordinal
        return plan(
            prefixes,
            lambda p: runs[p.key].get(ordinal, 0),
            max_tokens,
            lambda p: self._pressure(job, p, runs[p.key]),
        )

    def _runs(self, job: _Job, prefix: HotPrefix) -> dict[int, int]:
        """Each replica's leading blocks of ``prefix`` (ordinal -> blocks)."""
        return self.fleet.index.leading_runs(self._keys(job, prefix))

    def _held(self, job: _Job, record: ReplicaRecord, prefix: HotPrefix) -> int:
        return self._runs(job, prefix).get(record.ordinal, 0)

    def _pressure(self, job: _Job, prefix: HotPrefix, runs: dict[int, int]) -> float:
        """The requests (running and waiting, as last reported) of the least busy other
        serving replica holding all of ``prefix`` (``runs``: its leading runs); inf when
        none does."""
        holders = self._holders(job, prefix, _serving, runs)
        return float(min(map(_busy, holders))) if holders else math.inf

    def _holders(
        self,
        job: _Job,
        prefix: HotPrefix,
        usable: Callable[[ReplicaRecord], bool],
        runs: dict[int, int] | None = None,
    ) -> list[ReplicaRecord]:
        """The ``usable`` replicas other than ``job``'s whose KV events show they hold
        all of ``prefix`` (``runs``: its leading runs, read now if not given)."""
        if runs is None:
            runs = self._runs(job, prefix)
        return [
            other
            for ordinal, run in runs.items()
            if run >= prefix.blocks
            and (other := self.fleet.by_ordinal.get(ordinal)) is not None
            and other is not job.record
            and usable(other)
        ]

    @staticmethod
    def _keys(job: _Job, prefix: HotPrefix) -> list[int]:
        keys = job.keys.get(prefix.key)
        if keys is None:
            root = root_key(model=prefix.model)
            keys = job.keys[prefix.key] = chain_keys(root, prefix.tokens, prefix.block_size)
        return keys

    def _check(self, job: _Job, now: float) -> None:
        record = job.record
        gone = (
            record.down
            or record.is_draining
            or self.fleet.by_id.get(record.replica_id) is not record
        )
        index = self.fleet.index
        keys_of = job.keys
        for warming in job.warmings:
            if not warming.warming:
                continue
            before = warming.confirmed
            warming.confirm(lambda key: self._confirmed(index, keys_of, key, record.ordinal))
            self.counters.confirmed += warming.confirmed - before
            if gone:
                warming.end("left", now)
            elif now >= warming.deadline():
                warming.end("timeout", now)
            elif warming.sent >= len(warming.steps) and not warming.pending:
                warming.end("done" if not warming.failed else "failed", now)
        self._publish(job)
        if not job.active:
            for warming in job.warmings:
                self._count_outcome(warming)

    def _count_outcome(self, warming: Warming) -> None:
        outcome = warming.outcome or "done"
        self.counters.outcomes[outcome] = self.counters.outcomes.get(outcome, 0) + 1

    @staticmethod
    def _confirmed(index: object, keys_of: dict[int, list[int]], key: int, ordinal: int) -> bool:
        keys = keys_of.get(key)
        if not keys:
            return False
        runs = index.leading_runs(keys)  # type: ignore[attr-defined]
        return bool(runs.get(ordinal, 0) >= len(keys))

    def _publish(self, job: _Job) -> None:
        """Put the replica's warm-up state where proxies get it (its next upsert)."""
        record = job.record
        pending = job.pending() if job.active else None
        changed = pending != record.warmup
        record.warmup = pending
        self.fleet.changes.replica(record.ordinal)
        if changed and self._share is not None:
            self._share(record.pool, record.replica_id, pending)

    # -- sending --------------------------------------------------------------------------

    def _spawn_send(self, coroutine: Coroutine[Any, Any, None], name: str) -> asyncio.Task[None]:
        task = self._tasks.spawn(coroutine, name=name)
        self._sends.add(task)
        task.add_done_callback(self._sends.discard)
        return task

    def _current(self, job: _Job) -> bool:
        """Whether ``job`` may go on: planned in this term, and this instance leads."""
        return job.term == self._term and self._is_leader()

    async def _warm(self, job: _Job) -> None:
        for warming in job.warmings:
            if warming.warming and self._current(job):
                await self._warm_workload(job, warming)
        if self._current(job):
            self._check(job, self._clock())

    async def _warm_workload(self, job: _Job, warming: Warming) -> None:
        record = job.record
        announce = record.announce
        assert announce is not None
        pacer = Pacer(warming.settings.tokens_per_s, self._clock())
        in_a_row = 0
        moves = self._moves(record, warming)
        for step in warming.steps:
            if moves is not None:
                await moves.room()
            if not warming.warming or not self._current(job):
                return
            warming.cursor += 1
            if self._held(job, record, step.prefix) >= step.prefix.blocks:
                warming.pending.pop(step.prefix.key, None)  # traffic brought it: skip
                warming.confirmed += 1
                self.counters.skipped += 1
                continue
            tokens = len(step.prefix.tokens)
            if warming.sent_tokens + tokens > warming.settings.max_tokens:
                warming.end("budget", self._clock())
                return
            wait = pacer.wait_s(tokens, self._clock())
            if wait > 0:
                await asyncio.sleep(wait)  # the budget's pace, not a readiness wait
                if not self._current(job):
                    return
            pacer.take(tokens, self._clock())
            if moves is not None:
                self._count_sent(warming, step)  # now: the budget counts moves in flight
                name = f"warmup-move-{record.replica_id}"
                moves.add(self._spawn_send(self._move_one(job, warming, step, moves), name))
                continue
            if warming.settings.source == "transfer":
                self.counters.fell_back += 1  # an SGLang replica: recomputed
            in_a_row = await self._send_one(announce.base_url, warming, step, in_a_row)
            if in_a_row < 0:
                return
        if moves is not None:
            await moves.drain()

    async def _send_one(
        self, base_url: str, warming: Warming, step: Step, in_a_row: int, counted: bool = False
    ) -> int:
        """Send one prefix; the failures in a row after it (-1: the warm-up ended).
        ``counted``: its tokens are counted sent already (a move falling back)."""
        if not counted:
            self._count_sent(warming, step)
        try:
            await self._send(base_url, step.prefix.model, list(step.prefix.tokens))
        except WarmupRefused as exc:
            self._failed(warming, step, str(exc))
            warming.end("refused", self._clock())
            return -1
        except WarmupFailed as exc:
            self._failed(warming, step, str(exc))
            if in_a_row + 1 >= FAILURES_IN_A_ROW:
                warming.end("failed", self._clock())
                return -1
            return in_a_row + 1
        return 0

    # -- by transfer (source: transfer) ----------------------------------------------------

    def _moves(self, record: ReplicaRecord, warming: Warming) -> _Moves | None:
        """The moves in flight of a warm-up by transfer (None: by recompute, also for an
        SGLang replica, which cannot read a transfer: the recompute path whole, one
        prefix at a time, each counted fell_back)."""
        if warming.settings.source != "transfer" or self._move is None:
            return None
        announce = record.announce
        if announce is not None and announce.engine_kind == events_pb2.ENGINE_KIND_SGLANG:
            log.info(
                "warm-up of %s: source transfer needs vLLM engines with a KV connector in "
                "kv_both role; %s is SGLang: its prefixes are recomputed",
                record.replica_id,
                record.replica_id,
            )
            return None
        return _Moves(TRANSFERS_IN_FLIGHT)

    async def _move_one(self, job: _Job, warming: Warming, step: Step, moves: _Moves) -> None:
        """Move one prefix to the warming replica from the least loaded replica holding
        it, or compute it there (counted fell_back): when none holds it, when every
        holder has requests waiting and the warming replica is idle
        (:func:`kvcore.warmup.moves_it`), or when the move fails. The warming replica
        computes one prefix at a time."""
        record = job.record
        announce = record.announce
        assert announce is not None
        source = self._source(job, step.prefix)
        waiting = None if source is None else _waiting(source)
        if (
            source is not None
            and source.announce is not None
            and self._move is not None
            and moves_it(waiting, moves.computing > 0 or _busy(record) > 0)
        ):
            tokens = list(step.prefix.tokens)
            try:
                await self._move(
                    source.announce.base_url, announce.base_url, announce.model, tokens
                )
            except WarmupFailed as exc:
                log.warning(
                    "moving a warm-up prefix from %s to %s failed, recomputing it: %s",
                    source.replica_id,
                    record.replica_id,
                    exc,
                )
            else:
                self.counters.moved += 1
                moves.in_a_row = 0
                return
        self.counters.fell_back += 1
        moves.computing += 1
        try:
            async with moves.lane:
                if warming.warming and self._current(job):
                    in_a_row = await self._send_one(
                        announce.base_url, warming, step, moves.in_a_row, counted=True
                    )
                    moves.in_a_row = max(0, in_a_row)
        finally:
            moves.computing -= 1

    def _source(self, job: _Job, prefix: HotPrefix) -> ReplicaRecord | None:
        """The least loaded other replica whose KV events show it holds all of
        ``prefix``: announced with the warming replica's model, up, not draining, a vLLM
        engine not in the decode role; None when there is none."""
        record = job.record
        if record.announce is None or record.announce.engine_kind == events_pb2.ENGINE_KIND_SGLANG:
            return None
        model = record.announce.model
        return min(
            self._holders(job, prefix, lambda r: _can_send(r, model)), key=_busy, default=None
        )

    def _count_sent(self, warming: Warming, step: Step) -> None:
        tokens = len(step.prefix.tokens)
        warming.sent += 1
        warming.sent_tokens += tokens
        self.counters.sent += 1
        self.counters.sent_tokens += tokens

    def _failed(self, warming: Warming, step: Step, why: str) -> None:
        warming.failed += 1
        warming.pending.pop(step.prefix.key, None)
        self.counters.failed += 1
        log.warning("warm-up request to %s failed: %s", warming.replica_id, why)

    # -- drains ----------------------------------------------------------------------------

    def rehome(self, record: ReplicaRecord) -> None:
        """Send a draining replica's hot prefixes that no other replica holds to the
        least busy healthy replica of its model, once each (no wait, no retry)."""
        announce = record.announce
        if announce is None:
            return
        target = self._least_busy(record, announce.model)
        if target is None or target.announce is None:
            return
        now, index = self._clock(), self.fleet.index
        for prefix in self.store.all_prefixes(now):
            if prefix.model != announce.model:
                continue
            keys = chain_keys(root_key(model=prefix.model), prefix.tokens, prefix.block_size)
            runs = index.leading_runs(keys)
            if runs.get(record.ordinal, 0) and not any(
                run for ordinal, run in runs.items() if ordinal != record.ordinal
            ):
                self.counters.rehomed += 1
                self._spawn_send(
                    self._send_quietly(target.announce.base_url, prefix),
                    f"rehome-{record.replica_id}",
                )

    async def _send_quietly(self, base_url: str, prefix: HotPrefix) -> None:
        try:
            await self._send(base_url, prefix.model, list(prefix.tokens))
        except (WarmupRefused, WarmupFailed) as exc:
            self.counters.failed += 1
            log.warning("re-homing a drained replica's prefix failed: %s", exc)

    def _least_busy(self, leaving: ReplicaRecord, model: str) -> ReplicaRecord | None:
        candidates = [
            r
            for r in self.fleet.by_id.values()
            if r is not leaving
            and r.announce is not None
            and r.announce.model == model
            and not r.down
            and not r.is_draining
        ]
        return min(candidates, key=_busy, default=None)


def _busy(record: ReplicaRecord) -> int:
    """Requests running and waiting on ``record`` at its last load report."""
    return (record.load.running + record.load.waiting) if record.load else 0


def _waiting(record: ReplicaRecord) -> int:
    """Requests waiting on ``record`` at its last load report."""
    return record.load.waiting if record.load else 0


def _serving(record: ReplicaRecord) -> bool:
    return not record.down and not record.is_draining and not record.stale


def _can_send(record: ReplicaRecord, model: str) -> bool:
    """Whether ``record`` may be a warm-up transfer's source for ``model``: serving, a
    vLLM engine of that model not in the decode role."""
    announce = record.announce
    return (
        announce is not None
        and announce.model == model
        and announce.engine_kind != events_pb2.ENGINE_KIND_SGLANG
        and announce.role != events_pb2.REPLICA_ROLE_DECODE
        and _serving(record)
    )


class _Moves:
    """A warm-up by transfer's moves in flight (at most ``limit``), its prefixes computed
    by the warming replica (one at a time: ``lane``; ``computing``: running or queued)
    and its failures in a row (a move that fell back and whose recompute failed too)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.tasks: set[asyncio.Task[None]] = set()
        self.in_a_row = 0
        self.lane = asyncio.Lock()
        self.computing = 0

    def add(self, task: asyncio.Task[None]) -> None:
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def room(self) -> None:
        """Until fewer than ``limit`` moves are in flight."""
        while len(self.tasks) >= self.limit:
            await asyncio.wait(set(self.tasks), return_when=asyncio.FIRST_COMPLETED)

    async def drain(self) -> None:
        """Until every move is answered."""
        if self.tasks:
            await asyncio.wait(set(self.tasks))


def workloads_of(config: routing_pb2.RoutingConfig) -> list[Workload]:
    """The config's workloads, parsed (one that does not parse is left out)."""
    found = []
    for entry in config.workloads:
        try:
            found.append(parse_workload(entry.policy_json))
        except InvalidWorkload:
            continue
    return found


class WarmupCollector(Collector):
    """The warm-up's Prometheus metrics, read from the warmer's counters at scrape time."""

    def __init__(self, warmer: Warmer) -> None:
        self.warmer = warmer

    def collect(self) -> Iterator[Metric]:
        counters = self.warmer.counters
        yield GaugeMetricFamily(
            "kvroute_controlplane_warmup_replicas",
            "Replicas being warmed by this instance (the leader)",
            value=self.warmer.warming_count(),
        )
        yield GaugeMetricFamily(
            "kvroute_controlplane_hot_prefixes",
            "Hot prefixes the proxies reported, kept for warm-ups",
            value=len(self.warmer.store),
        )
        prefixes = CounterMetricFamily(
            "kvroute_controlplane_warmup_prefixes",
            "Warm-up prefixes by what became of them: sent, confirmed (by the replica's KV "
            "events), skipped (held already), failed, rehomed (a drained replica's, sent "
            "elsewhere); with source transfer, moved (read from a replica holding it) and "
            "fell_back (recomputed instead: no holder, every holder had requests waiting "
            "while the warming replica was idle, the move failed, or SGLang)",
            labels=["result"],
        )
        for result in ("sent", "confirmed", "skipped", "failed", "rehomed", "moved", "fell_back"):
            prefixes.add_metric([result], getattr(counters, result))
        yield prefixes
        yield CounterMetricFamily(
            "kvroute_controlplane_warmup_tokens",
            "Prompt tokens sent in warm-up requests",
            value=counters.sent_tokens,
        )
        ended = CounterMetricFamily(
            "kvroute_controlplane_warmups",
            "Warm-ups (per replica and workload) by how they ended: done, nothing (no hot "
            "prefix to send), budget, timeout, refused, failed, left, stepped_down (this "
            "instance lost the leadership)",
            labels=["outcome"],
        )
        for outcome, count in sorted(counters.outcomes.items()):
            ended.add_metric([outcome], count)
        yield ended
