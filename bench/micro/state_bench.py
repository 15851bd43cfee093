"""The proxy's routing state (``dataplane.fleet``): its cost per request (with and
without kv_cost's prefill books), and how fast and how smoothly it applies what the
control plane streams, with each residency index a proxy may hold (``--residency-index``)."""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable

from bench.micro.report import Figure, median_us
from dataplane.fleet.state import FleetState
from kvcore.index import READ_ALWAYS_INDEXES, BitmaskResidencyIndex, ResidencyIndex
from kvcore.pb import events_pb2, routing_pb2

REPLICAS = 64
MODEL = "m"
SNAPSHOT_KEYS = 1_000_000
CHUNK_KEYS = 400_000  # about 3.6 MB of fixed64 keys: a chunk below the 4 MiB cap


def _replica(ordinal: int) -> routing_pb2.Replica:
    return routing_pb2.Replica(
        ordinal=ordinal,
        replica_id=f"r{ordinal}",
        pool="default",
        base_url=f"http://127.0.0.1:{9000 + ordinal}",
        model=MODEL,
        status=routing_pb2.REPLICA_STATUS_HEALTHY,
        capacity_seqs=256,
        load=events_pb2.LoadReport(running=10, waiting=2, kv_usage=0.3, ts=100.0),
    )


def _snapshot(keys_per_replica: int, rng: random.Random) -> list[routing_pb2.StateUpdate]:
    """One snapshot of ``REPLICAS`` replicas, cut into chunks of about ``CHUNK_KEYS``."""
    chunks = [routing_pb2.SnapshotChunk(chunk_index=0, replicas=map(_replica, range(REPLICAS)))]
    held = 0
    for ordinal in range(REPLICAS):
        if held >= CHUNK_KEYS:
            chunks.append(routing_pb2.SnapshotChunk(chunk_index=len(chunks)))
            held = 0
        keys = [rng.getrandbits(64) for _ in range(keys_per_replica)]
        chunks[-1].residency.append(routing_pb2.ReplicaBlocks(ordinal=ordinal, keys=keys))
        held += keys_per_replica
    chunks[-1].last_chunk = True
    return [routing_pb2.StateUpdate(epoch=1, version=1, snapshot=c) for c in chunks]


def _delta(version: int, rng: random.Random) -> routing_pb2.StateUpdate:
    """A busy 50 ms delta: every replica's load, ten replicas storing 100 blocks each."""
    loads = [
        routing_pb2.LoadUpdate(
            ordinal=o, load=events_pb2.LoadReport(running=o % 7, ts=100.0 + version)
        )
        for o in range(REPLICAS)
    ]
    residency = [
        routing_pb2.ResidencyChange(
            ordinal=rng.randrange(REPLICAS), added=[rng.getrandbits(64) for _ in range(100)]
        )
        for _ in range(10)
    ]
    delta = routing_pb2.Delta(loads=loads, residency=residency)
    return routing_pb2.StateUpdate(epoch=1, version=version, delta=delta)


def _request_figures(state: FleetState) -> list[Figure]:
    cached = median_us(lambda: state.views.view(MODEL).replicas(), repeat=2000)
    ordinals = iter(range(10**9))

    def one_request() -> None:
        ticket = state.inflight.on_sent(next(ordinals) % REPLICAS, 200.0)
        state.views.view(MODEL).replicas()
        state.inflight.on_done(ticket)

    per_request = median_us(one_request, repeat=2000)
    return [
        Figure(f"view(model).replicas(), nothing changed, {REPLICAS} replicas", cached, "us", 2),
        Figure("  a request's bookkeeping: on_sent + view + on_done", per_request, "us", 25),
    ]


def _apply_figures(
    rng: random.Random, name: str, index: Callable[[], ResidencyIndex]
) -> tuple[list[Figure], FleetState]:
    state = FleetState(index=index)
    updates = _snapshot(SNAPSHOT_KEYS // REPLICAS, rng)
    steps: list[float] = []
    started = time.perf_counter()
    for update in updates:
        step = time.perf_counter()
        for _ in state.apply_steps(update):
            steps.append(time.perf_counter() - step)
            step = time.perf_counter()
        steps.append(time.perf_counter() - step)
    total_ms = (time.perf_counter() - started) * 1000
    deltas = iter([_delta(version, rng) for version in range(2, 2 + 3 + 5 * 50)])
    delta_us = median_us(lambda: state.apply(next(deltas)), repeat=50)
    snapshot = f"{name}: apply a {SNAPSHOT_KEYS / 1e6:.0f}M-key snapshot ({len(updates)} chunks)"
    return [
        Figure(snapshot, total_ms, "ms"),
        Figure("  median step between event-loop yields", statistics.median(steps) * 1000, "ms", 5),
        Figure(
            "  longest step (a dict resize or a table rebuild is one call)", max(steps) * 1000, "ms"
        ),
        Figure(f"{name}: apply a delta ({REPLICAS} loads, 1000 stored keys)", delta_us, "us", 2000),
    ], state


class _Clock:
    """Monotonic seconds the benchmark moves by hand."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _kv_cost_state(clock: _Clock) -> FleetState:
    """64 replicas routed by a kv_cost workload: the proxy keeps its prefill books."""
    workload = routing_pb2.Workload(name="default", policy_json='{"strategy": "kv_cost"}')
    chunk = routing_pb2.SnapshotChunk(
        chunk_index=0,
        last_chunk=True,
        replicas=map(_replica, range(REPLICAS)),
        config=routing_pb2.RoutingConfig(workloads=[workload]),
    )
    state = FleetState(clock=clock)
    state.apply(routing_pb2.StateUpdate(epoch=1, version=1, snapshot=chunk))
    return state


def _books_figures() -> list[Figure]:
    clock = _Clock()
    state = _kv_cost_state(clock)
    ordinals = iter(range(10**9))

    def one_request() -> None:
        ticket = state.inflight.on_sent(next(ordinals) % REPLICAS, 200.0, 2_000)
        state.views.view(MODEL).replicas()
        state.inflight.on_first_byte(ticket, 200, streaming=True)
        state.inflight.on_done(ticket)

    per_request = median_us(one_request, repeat=2000)
    for ordinal in range(REPLICAS):  # every replica prefilling for minutes
        state.inflight.on_sent(ordinal, 200.0, 10**9)

    def one_step() -> None:
        clock.now += 0.01  # past the 5 ms step: every replica's state is re-aged
        state.views.view(MODEL).replicas()

    step = median_us(one_step, repeat=200)
    return [
        Figure("  the same with kv_cost's prefill books (+ on_first_byte)", per_request, "us", 25),
        Figure(f"  re-aging {REPLICAS} draining replicas (at most once per 5 ms)", step, "us"),
    ]


def run() -> list[Figure]:
    figures: list[Figure] = []
    for name, index in READ_ALWAYS_INDEXES.items():
        applied, state = _apply_figures(random.Random(5), name, index)
        figures += applied
        if index is BitmaskResidencyIndex:  # (the rest reads no index: once)
            figures += _request_figures(state) + _books_figures()
    return figures
