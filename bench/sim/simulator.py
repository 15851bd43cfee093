"""The discrete-event loop: requests, routers, replicas and the residency feed in virtual time.

One run replays one workload through one router *group* (N instances of a policy behind
a round-robin L4 balancer: request i goes to instance i mod N) onto a fresh fleet of
:class:`~bench.sim.engine.ReplicaModel`. What the routers learn reaches them the way it
would in production:

- **residency**: each replica's stored/evicted blocks are delivered to every router that
  keeps a residency map ``residency_delay_s`` after the step that produced them (the
  sidecar -> NATS -> control plane -> proxy path);
- **load**: engine-reported (running, waiting, KV usage) is sampled every
  ``load_period_s`` (the sidecar's heartbeat); a router adds what it sent since;
- **its own history**: routers that count their own in-flight requests get told of each
  first token and each finished request.

Nothing here is random except through the workload's and the routers' seeded generators,
so a run is reproducible.
"""

from __future__ import annotations

import heapq
import itertools
import math
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Protocol, cast

from bench.sim.engine import EngineShape, ReplicaModel, slowed
from bench.sim.workloads import Request, Workload
from enginesim.kv_manager import BlockEvicted, BlocksStored, PoolEvent

ARRIVAL, WAKE, _RESIDENCY, _LOAD, _FIRST_TOKEN = 0, 1, 2, 3, 4


@dataclass(frozen=True, slots=True)
class LoadSample:
    """What an engine reports about its load (the sidecar's ``LoadReport``), with its
    running totals of the prefills it timed (``LoadReport.prefill_requests``,
    ``prefill_seconds``, ``prefill_computed_tokens``)."""

    running: int
    waiting: int
    kv_usage: float
    prefill_requests: int = 0
    prefill_seconds: float = 0.0
    prefill_computed_tokens: int = 0


class FleetReadout:
    """The routers' window on the fleet: load samples and the engines' truth."""

    def __init__(self, replicas: Sequence[ReplicaModel], routers: int = 1) -> None:
        self.replicas = replicas
        self.routers = routers  # router instances behind the balancer, as each is told
        self.samples: list[LoadSample] = [LoadSample(0, 0, 0.0) for _ in replicas]
        self.sampled_at = 0.0
        self.epoch = 0  # bumps at every sample

    def sample(self, now: float) -> None:
        self.samples = [
            LoadSample(
                r.running,
                r.num_waiting,
                r.kv_usage,
                r.prefill_totals.requests,
                r.prefill_totals.seconds,
                r.prefill_totals.computed_tokens,
            )
            for r in self.replicas
        ]
        self.sampled_at = now
        self.epoch += 1


class SimRouter(Protocol):
    """One router instance as the simulator drives it."""

    name: str
    wants_residency: bool
    load_period_s: float  # how often it takes a new load sample (inf: never)

    def route(self, req: Request, now: float) -> int:
        """The ordinal of the replica ``req`` goes to."""
        ...

    def apply_residency(self, replica: int, stored: list[int], removed: list[int]) -> None: ...

    def on_first_token(self, req: Request, now: float) -> None: ...

    def on_finished(self, req: Request, now: float) -> None: ...


RouterFactory = Callable[[FleetReadout, int], SimRouter]  # (fleet, instance index)


@dataclass(frozen=True)
class SimConfig:
    replicas: int = 8
    shape: EngineShape = field(default_factory=EngineShape)
    router_instances: int = 1
    residency_delay_s: float = 0.05
    load_period_s: float = 0.5
    # P/D contenders (bench/sim/pd.py): the first ``prefill_replicas`` of ``replicas`` are
    # prefill replicas, the rest decode ones (0: the scenario has none); a decode replica
    # reads a prompt's KV at this many seconds a block (enginesim's --kv-transfer-block-ms)
    prefill_replicas: int = 0
    kv_transfer_block_s: float = 0.00005
    # replica ordinal -> how many times slower than ``shape`` it runs every step (a
    # smaller GPU, a larger model): prefill and decode alike
    slowdown: tuple[tuple[int, float], ...] = ()

    def shape_of(self, ordinal: int) -> EngineShape:
        """Replica ``ordinal``'s shape: ``shape``, slowed down if ``slowdown`` says so."""
        factor = dict(self.slowdown).get(ordinal, 1.0)
        return self.shape if factor == 1.0 else slowed(self.shape, factor)


@dataclass
class RunOutcome:
    """Everything a run produced, for :mod:`bench.sim.metrics`."""

    requests: list[Request]
    rejected: int
    busy_s: list[float]
    prefill_s: list[float]
    served: list[int]
    routed: int
    decide_s: float  # wall time spent in routers' decisions
    wall_s: float
    cpu_s: float  # this process's CPU time during the run (wall time less waiting for a core)
    end: float
    adapter_loads: int | None = None  # LoRA adapters loaded onto replicas (bench.sim.lora)

    @classmethod
    def of(
        cls,
        replicas: Sequence[ReplicaModel],
        requests: list[Request],
        rejected: int,
        decide_s: float,
        started: RunClock,
        end: float,
    ) -> RunOutcome:
        """What a run on ``replicas``, begun at ``started``, produced."""
        return cls(
            requests=requests,
            rejected=rejected,
            busy_s=[r.busy_s for r in replicas],
            prefill_s=[r.prefill_s for r in replicas],
            served=[r.served for r in replicas],
            routed=len(requests) - rejected,
            decide_s=decide_s,
            wall_s=time.perf_counter() - started.wall,
            cpu_s=time.process_time() - started.cpu,
            end=end,
        )


@dataclass(frozen=True, slots=True)
class RunClock:
    """When a run began, on the wall clock and on this process's CPU clock."""

    wall: float
    cpu: float

    @classmethod
    def start(cls) -> RunClock:
        return cls(time.perf_counter(), time.process_time())


def residency_batches(events: list[PoolEvent]) -> Iterator[tuple[list[int], list[int]]]:
    """An engine's events as (stored keys, then the removals that followed them) batches,
    in order, as routers apply them."""
    stored: list[int] = []
    removed: list[int] = []
    for event in events:
        if isinstance(event, BlocksStored):
            if removed:
                yield stored, removed
                stored, removed = [], []
            stored.extend(event.digests)  # type: ignore[arg-type]  # router keys
        elif isinstance(event, BlockEvicted):
            removed.append(event.digest)  # type: ignore[arg-type]
    yield stored, removed


def too_large(req: Request, shape: EngineShape) -> bool:
    """Whether ``req`` needs more blocks than one replica has (no engine could run it)."""
    return -(-(req.prompt_tokens + req.output_tokens - 1) // shape.block_size) > shape.num_blocks


Dispatch = Callable[[int, object, float], None]  # (kind, payload, time)


def shared_event(
    kind: int, payload: object, now: float, arrive: Callable[[Request, float], None]
) -> bool:
    """Handle the kinds of event every simulation has: a replica's step (``WAKE``, with
    ``(replica, step, version)``: it steps unless it changed since, by its version) and
    an arrival (to ``arrive``); ``False`` for any other kind, the caller's own."""
    if kind == WAKE:
        replica, step, version = cast(tuple[ReplicaModel, int, int], payload)
        if version == replica.version:
            replica.wake(now, step)
        return True
    if kind == ARRIVAL:
        arrive(cast(Request, payload), now)
        return True
    return False


def drain(
    arrivals: Iterable[Request],
    heap: list[tuple[float, int, int, object]],
    period: float,
    sample: Callable[[float], None],
    dispatch: Dispatch,
) -> float:
    """The event loop: each arrival (kind ``ARRIVAL``) or heap event in time order to
    ``dispatch``, the load sampled every ``period`` (at every event when 0); the time of
    the last event."""
    pending_arrivals = iter(arrivals)
    pending = next(pending_arrivals, None)
    next_sample = period if period > 0 else math.inf
    now = 0.0
    payload: object
    while pending is not None or heap:
        if pending is not None and (not heap or pending.arrival <= heap[0][0]):
            at, kind, payload = pending.arrival, ARRIVAL, pending
            pending = next(pending_arrivals, None)
        else:
            at, _, kind, payload = heapq.heappop(heap)
        while next_sample <= at:
            sample(next_sample)
            next_sample += period
        now = at
        if period <= 0:
            sample(now)
        dispatch(kind, payload, now)
    return now


class Simulation:
    """One workload through one router group on a fresh fleet."""

    def __init__(self, config: SimConfig, workload: Workload, router: RouterFactory) -> None:
        self.config = config
        self.workload = workload
        self._heap: list[tuple[float, int, int, object]] = []
        self._seq = itertools.count()
        self.replicas = [
            ReplicaModel(i, config.shape_of(i), self._schedule_wake, self._publish)
            for i in range(config.replicas)
        ]
        for replica in self.replicas:
            replica.finished_callback = self._finished
            replica.first_token_callback = self._first_token
        self.readout = FleetReadout(self.replicas, config.router_instances)
        self.routers = [router(self.readout, i) for i in range(config.router_instances)]
        self._owner: dict[int, SimRouter] = {}
        self._feeds = [r for r in self.routers if r.wants_residency]
        self.requests: list[Request] = []
        self.rejected = 0
        self._decide_s = 0.0

    # -- scheduling --------------------------------------------------------------------------

    def _push(self, at: float, kind: int, payload: object) -> None:
        heapq.heappush(self._heap, (at, next(self._seq), kind, payload))

    def _schedule_wake(self, at: float, replica: ReplicaModel, step: int, version: int) -> None:
        self._push(at, WAKE, (replica, step, version))

    def _publish(self, replica: int, events: list[PoolEvent], at: float) -> None:
        if not self._feeds:
            return
        delay = self.config.residency_delay_s
        if delay <= 0:
            self._apply_residency(replica, events)
        else:
            self._push(at + delay, _RESIDENCY, (replica, events))

    def _apply_residency(self, replica: int, events: list[PoolEvent]) -> None:
        for stored, removed in residency_batches(events):
            for router in self._feeds:
                router.apply_residency(replica, stored, removed)

    # -- callbacks from replicas ---------------------------------------------------------

    def _first_token(self, req: Request, at: float) -> None:
        # a replica knows when a step's first tokens will be out as the step starts;
        # the router sees them only then
        self._push(at, _FIRST_TOKEN, req)

    def _finished(self, req: Request, now: float) -> None:
        self._owner.pop(req.rid).on_finished(req, now)
        follow = self.workload.follow_up(req, now)
        if follow is not None:
            self._push(follow.arrival, ARRIVAL, follow)

    # -- the loop ----------------------------------------------------------------------------

    def _arrive(self, req: Request, now: float) -> None:
        self.requests.append(req)
        if too_large(req, self.config.shape):
            self.rejected += 1
            return
        # behind the round-robin L4 balancer: a client's keep-alive connection stays on
        # the router it was given; a request of its own is the next connection
        turn = len(self.requests) if req.client is None else req.client
        router = self.routers[turn % len(self.routers)]
        started = time.perf_counter()
        ordinal = router.route(req, now)
        self._decide_s += time.perf_counter() - started
        req.replica = ordinal
        self._owner[req.rid] = router
        self.replicas[ordinal].arrive(req, now)

    def run(self) -> RunOutcome:
        started = RunClock.start()
        period = min([self.config.load_period_s, *(r.load_period_s for r in self.routers)])
        arrivals = self.workload.arrivals()
        end = drain(arrivals, self._heap, period, self.readout.sample, self._dispatch)
        return RunOutcome.of(
            self.replicas, self.requests, self.rejected, self._decide_s, started, end
        )

    def _dispatch(self, kind: int, payload: object, now: float) -> None:
        if shared_event(kind, payload, now, self._arrive):
            return
        if kind == _FIRST_TOKEN:
            req = cast(Request, payload)
            owner = self._owner.get(req.rid)  # None: it already finished (one output token)
            if owner is not None:
                owner.on_first_token(req, now)
        elif kind == _RESIDENCY:
            ordinal, events = cast(tuple[int, list[PoolEvent]], payload)
            self._apply_residency(ordinal, events)
