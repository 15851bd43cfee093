"""A modelled engine replica in virtual time, on enginesim's own cache and timing model.

The cache is ``enginesim.blockpool.BlockPool`` itself (full blocks only, LRU free queue,
in-use blocks never evicted, stored/evicted events) keyed by router block keys, and step
durations come from ``enginesim.timing.TimingModel``. The scheduling follows
``enginesim.scheduler.EngineCore`` step for step: FCFS continuous batching within
``max_num_seqs`` and free blocks, a request reserving its whole sequence at admission,
one step = the admitted requests' prefills + one decode token for every request that was
already running, the first token delivered at the end of the admitting step, blocks freed
in the step that samples the last token.

What differs is only how time advances: ``EngineCore.step()`` runs once per token
(hashing each new block, sampling each token), which would cost minutes for 100,000
requests. Here a run of steps that admit nothing is one event: while the batch is
unchanged every such step lasts ``decode(batch)``, so the replica jumps to the step in
which its next request finishes, or to the first step boundary after a new arrival.
Output blocks are cached when the request finishes rather than as they fill (only a later
turn of the same chat can use them, and it arrives after the answer).
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import cast

from bench.sim.workloads import Request
from enginesim.blockpool import BlockPool, KVBlock
from enginesim.kv_manager import PoolEvent
from enginesim.timing import TimingModel

Schedule = Callable[[float, "ReplicaModel", int, int], None]  # (time, replica, step, version)
Publish = Callable[[int, list[PoolEvent], float], None]  # (replica, events, time)


@dataclass(frozen=True)
class EngineShape:
    """One replica's size: KV blocks, batch limit and the timing model."""

    num_blocks: int = 8192
    block_size: int = 16
    max_num_seqs: int = 128
    timing: TimingModel = field(default_factory=TimingModel)


@dataclass(slots=True, eq=False)
class _Job:
    req: Request
    blocks: list[KVBlock]
    finish_step: int
    started: float  # the start of the step that admitted it (vLLM's SCHEDULED)


@dataclass(slots=True)
class PrefillTotals:
    """The engine's own timing of its requests, as vLLM's metrics count it when each
    finishes (``enginesim/metrics.py``): requests, their seconds from the step that
    admitted each to its first token (the whole step for every request of it), their
    computed prompt tokens, their seconds waiting before that step."""

    requests: int = 0
    seconds: float = 0.0
    computed_tokens: int = 0
    queue_seconds: float = 0.0


def slowed(shape: EngineShape, factor: float) -> EngineShape:
    """``shape`` with every step ``factor`` times as long: prefill at ``1 / factor`` of
    its rate, its overhead and the decode step ``factor`` times as long."""
    timing = shape.timing
    return replace(
        shape,
        timing=replace(
            timing,
            prefill_rate=timing.prefill_rate / factor,
            prefill_overhead_s=timing.prefill_overhead_s * factor,
            prefill_quadratic_s=timing.prefill_quadratic_s * factor,
            decode_base_s=timing.decode_base_s * factor,
            decode_per_seq_s=timing.decode_per_seq_s * factor,
        ),
    )


class ReplicaModel:
    """One engine replica; the simulator calls ``arrive`` and ``wake``."""

    def __init__(self, ordinal: int, shape: EngineShape, schedule: Schedule, publish: Publish):
        self.ordinal = ordinal
        self.shape = shape
        self.pool = BlockPool(shape.num_blocks, shape.block_size)
        self._schedule = schedule
        self._publish = publish
        self.waiting: deque[Request] = deque()
        self.running = 0
        self._finishing: list[tuple[int, int, _Job]] = []
        self._seq = itertools.count()
        self.step = 0  # index of the next step to start
        self.version = 0  # invalidates superseded wake-ups
        self.wake_at = math.inf
        self._span: tuple[float, int, float] | None = None  # (start, first step, step length)
        self._busy_since: float | None = None
        self.busy_s = 0.0
        self.prefill_s = 0.0  # of busy_s, the part spent in prefills
        self.served = 0
        self.prefill_totals = PrefillTotals()
        self.finished_callback: Callable[[Request, float], None] = lambda req, now: None
        self.first_token_callback: Callable[[Request, float], None] = lambda req, now: None

    # -- what routers see ----------------------------------------------------------------

    @property
    def kv_usage(self) -> float:
        return self.pool.usage

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    # -- events ----------------------------------------------------------------------------

    def arrive(self, req: Request, now: float) -> None:
        self.waiting.append(req)
        if self.wake_at == math.inf:
            self._busy_since = now
            self.wake(now, self.step)
            return
        span = self._span
        if span is None:
            return  # a step with prefills is running; its end admits the newcomer
        start, first, length = span
        k = int((now - start) / length) + 1
        boundary = start + k * length
        if boundary < self.wake_at:
            self._set_wake(boundary, first + k)

    def wake(self, now: float, step: int) -> None:
        self.step = step
        self._finish_due(now)
        self._run_step(now)

    # -- the step ---------------------------------------------------------------------------

    def _run_step(self, now: float) -> None:
        batch = self.running
        timing = self.shape.timing
        admitted = self._admit(now) if self.waiting else []
        if admitted:
            prefill = sum(
                timing.prefill_seconds(r.prompt_tokens, r.cached_tokens) for r in admitted
            )
            self.prefill_s += prefill
            end = now + prefill + timing.decode_seconds(batch)
            for req in admitted:
                req.first_token_at = end
                self.first_token_callback(req, end)
            self._span = None
            self._set_wake(end, self.step + 1)
            self._publish_events(end)
            return
        if self.running:
            length = timing.decode_seconds(batch)
            last = self._finishing[0][0]
            self._span = (now, self.step, length)
            self._set_wake(now + (last - self.step + 1) * length, last + 1)
            return
        self._go_idle(now)

    def _admit(self, now: float) -> list[Request]:
        admitted: list[Request] = []
        pool, bs = self.pool, self.shape.block_size
        while self.waiting and self.running < self.shape.max_num_seqs:
            req = self.waiting[0]
            digests = cast(Sequence[bytes], req.keys)  # the pool treats digests as opaque ids
            hits = pool.longest_cached_prefix(digests[: (req.prompt_tokens - 1) // bs])
            needed = -(-(req.prompt_tokens + req.output_tokens - 1) // bs)
            if not pool.can_allocate(hits, needed - len(hits)):
                break
            self.waiting.popleft()
            pool.touch(hits)
            blocks = [*hits, *pool.allocate(needed - len(hits))]
            full = len(req.keys)
            pool.cache_run(blocks[len(hits) : full], digests[len(hits) : full], None, (), None)
            req.cached_tokens = len(hits) * bs
            self.running += 1
            job = _Job(req, blocks, self.step + req.output_tokens - 1, now)
            heapq.heappush(self._finishing, (job.finish_step, next(self._seq), job))
            admitted.append(req)
        return admitted

    def _finish_due(self, now: float) -> None:
        finishing = self._finishing
        done: list[_Job] = []
        while finishing and finishing[0][0] < self.step:
            done.append(heapq.heappop(finishing)[2])
        if not done:
            return
        totals = self.prefill_totals
        for job in done:
            self._cache_answer(job)
            self.pool.free(job.blocks)
            self.running -= 1
            self.served += 1
            req = job.req
            req.finished_at = now
            totals.requests += 1
            totals.seconds += req.first_token_at - job.started
            totals.computed_tokens += req.prompt_tokens - req.cached_tokens
            totals.queue_seconds += job.started - req.arrival
        self._publish_events(now)
        for job in done:
            self.finished_callback(job.req, now)

    def _cache_answer(self, job: _Job) -> None:
        req = job.req
        bs = self.shape.block_size
        full = min((req.prompt_tokens + req.output_tokens - 1) // bs, len(req.seq_keys))
        start = len(req.keys)
        if full > start:
            digests = cast(Sequence[bytes], req.seq_keys)
            self.pool.cache_run(job.blocks[start:full], digests[start:full], None, (), None)

    # -- bookkeeping -------------------------------------------------------------------------

    def _set_wake(self, at: float, step: int) -> None:
        self.version += 1
        self.wake_at = at
        self._schedule(at, self, step, self.version)

    def _go_idle(self, now: float) -> None:
        self._span = None
        self.version += 1
        self.wake_at = math.inf
        if self._busy_since is not None:
            self.busy_s += now - self._busy_since
            self._busy_since = None

    def _publish_events(self, at: float) -> None:
        events = self.pool.take_events()
        if events:
            self._publish(self.ordinal, events, at)
