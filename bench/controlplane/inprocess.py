"""Control-plane figures measured in one process, on one core.

- **ingest**: sidecar ``KvEventBatch`` bytes (16 replicas; each batch 16 chained stores
  of 4 blocks and, once a replica holds its share, as many one-block evictions: ~64
  block events) through the control plane's own path: subject parse, protobuf decode,
  stream sequencing, residency index, change log. Measured alone, and with a delta built
  and serialized every 5,000 block events (25 ms at the target rate), as the broadcaster
  does (target >= 200,000 block events/s). Timed in CPU seconds of this process, so a
  machine shared with other work does not count against it.
- **memory**: resident set growth per resident key once the index holds ~1M keys.
- **snapshot**: a snapshot built (chunked, serialized) and sent over real gRPC on
  loopback, in both forms: residency as columns (contiguous buffers) to the proxy's own
  ``StateClient`` and ``FleetState`` over a ``CompactResidencyIndex`` (target <= 5 s at
  10M keys, built, sent and applied), and per-replica key lists to a watcher applying
  them to plain sets (target <= 2 s at 1M keys; measured up to 2M keys).
"""

from __future__ import annotations

import asyncio
import gc
import heapq
import random
import resource
import time
from collections.abc import Iterator

import numpy as np

from bench.controlplane.mirror import StateMirror, watch
from controlplane.fleet.broadcast import Broadcaster, EmptyConfig
from controlplane.fleet.fleet import Fleet
from controlplane.fleet.fleet_view import LiveFleetView
from controlplane.fleet.ingest import Ingest
from controlplane.fleet.routing_server import RoutingStateService, start_server
from controlplane.service import CountingSink
from controlplane.settings import ControlPlaneSettings
from dataplane.fleet.state import FleetState
from dataplane.settings import ProxySettings
from dataplane.state_client import Backoff, StateClient
from kvcore import subjects
from kvcore.index import READ_ALWAYS_INDEXES
from kvcore.pb import events_pb2

REPLICAS = 16
RUN = 4  # blocks per store
STORES = 16  # stores per batch


def batches(total_events: int, held_per_replica: int, seed: int = 1) -> Iterator[tuple[str, bytes]]:
    """(subject, payload) of sidecar batches until ``total_events`` block events."""
    rng = random.Random(seed)
    held: list[list[int]] = [[] for _ in range(REPLICAS)]
    seqs = [0] * REPLICAS
    produced = 0
    while produced < total_events:
        r = rng.randrange(REPLICAS)
        batch = events_pb2.KvEventBatch(replica_id=f"r{r}", pool="bench", epoch=1, seq=seqs[r])
        seqs[r] += 1
        for _ in range(STORES):
            parent = held[r][-1] if held[r] else None
            keys = [rng.getrandbits(63) for _ in range(RUN)]
            stored = batch.events.add().stored
            if parent is not None:
                stored.parent_key = parent
            stored.keys.extend(keys)
            held[r].extend(keys)
        produced += STORES * RUN
        excess = len(held[r]) - held_per_replica
        if excess > 0:
            evicted, held[r] = held[r][:excess], held[r][excess:]
            batch.events.add().removed.keys.extend(evicted)
            produced += excess
        yield subjects.events_subject("bench", f"r{r}"), batch.SerializeToString()


def ingest_rate(total_events: int, *, with_deltas: bool) -> float:
    """Block events per second through ``Ingest.handle`` (and deltas, if asked)."""
    settings = ControlPlaneSettings(pools=["bench"])
    fleet = Fleet(heartbeat_timeout_s=60.0)
    ingest = Ingest(settings, fleet)
    broadcaster = Broadcaster(fleet, EmptyConfig())
    prepared = list(batches(total_events, held_per_replica=40_000))
    now = time.monotonic()
    gc.collect()
    start, mark = time.process_time(), 0
    for subject, data in prepared:
        ingest.handle(subject, data, now)
        if fleet.stats.block_events - mark >= 5000:
            mark = fleet.stats.block_events
            if with_deltas:
                broadcaster.flush()
            else:
                fleet.changes.take()
    elapsed = time.process_time() - start
    return fleet.stats.block_events / elapsed


def _rss_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * resource.getpagesize()


def filled_fleet(distinct_keys: int, *, shared: float = 0.25) -> Fleet:
    """A fleet of 8 replicas holding ``distinct_keys`` keys, a share held by two."""
    fleet = Fleet(heartbeat_timeout_s=60.0)
    rng = random.Random(3)
    per_replica = distinct_keys // 8
    for r in range(8):
        keys = [rng.getrandbits(63) for _ in range(per_replica)]
        batch = events_pb2.KvEventBatch(replica_id=f"r{r}", pool="bench", epoch=1, seq=0)
        batch.events.add().stored.keys.extend(keys)
        fleet.on_batch(batch, "bench", 0.0)
        if r:  # the next replica also holds a share of these
            again = events_pb2.KvEventBatch(replica_id=f"r{r - 1}", pool="bench", epoch=1, seq=1)
            again.events.add().stored.keys.extend(keys[: int(per_replica * shared)])
            fleet.on_batch(again, "bench", 0.0)
        fleet.changes.take()
    return fleet


def memory_per_key(distinct_keys: int) -> tuple[float, int]:
    """Resident set growth per distinct key, and the holdings (key, replica) count."""
    gc.collect()
    before = _rss_bytes()
    fleet = filled_fleet(distinct_keys)
    gc.collect()
    grown = _rss_bytes() - before
    holdings = sum(fleet.index.key_count(o) for o in fleet.by_ordinal)
    return grown / fleet.index.key_count(), holdings


def rows_fleet(distinct_keys: int, *, replicas: int = 8) -> Fleet:
    """A fleet of ``replicas`` holding ``distinct_keys`` random keys, each key one or two
    replicas' (loaded as columns: a snapshot's measurement need not wait for ingest)."""
    fleet = Fleet(heartbeat_timeout_s=60.0)
    for r in range(replicas):
        batch = events_pb2.KvEventBatch(replica_id=f"r{r}", pool="bench", epoch=1, seq=0)
        batch.events.add().stored.keys.append(r + 1)
        fleet.on_batch(batch, "bench", 0.0)
    rng = np.random.default_rng(5)
    keys = rng.integers(1, 2**63, size=distinct_keys, dtype=np.uint64, endpoint=False)
    first = rng.integers(0, replicas, size=distinct_keys)
    second = np.where(rng.random(distinct_keys) < 0.25, (first + 1) % replicas, first)
    ordinals = [fleet.by_id[f"r{r}"].ordinal for r in range(replicas)]
    bit = np.array([1 << o for o in ordinals], dtype=np.uint64)
    fleet.index.add_rows(keys, (bit[first] | bit[second])[:, None])
    fleet.changes.take()
    return fleet


async def column_snapshot_times(distinct_keys: int) -> tuple[float, float, float, int]:
    """(build s, build+send+apply s, the same in CPU s of this process, which runs both
    ends, chunks) of a columns snapshot of ``distinct_keys`` into a proxy's state
    (compact index), checked key for key."""
    fleet = rows_fleet(distinct_keys)
    broadcaster = Broadcaster(fleet, EmptyConfig())
    start = time.perf_counter()
    chunks = broadcaster.snapshot(None, columns=True)
    built = time.perf_counter() - start
    broadcaster._snapshot_cache = None  # the timed send builds it again
    state, sent, cpu = await proxy_watch(broadcaster)
    if state.replicas.residency_keys() != fleet.index.key_count():
        raise AssertionError(
            f"the proxy holds {state.replicas.residency_keys()} keys, not {distinct_keys}"
        )
    return built, sent, cpu, len(chunks)


async def proxy_watch(broadcaster: Broadcaster) -> tuple[FleetState, float, float]:
    """A proxy's state (compact index) once its ``StateClient`` received a first
    snapshot from ``broadcaster`` over real gRPC on loopback, with the wall and CPU
    seconds (of this process, which runs both ends) that took."""
    service = RoutingStateService(broadcaster, CountingSink(), None)
    server, port = await start_server(service, ControlPlaneSettings(grpc_port=0))
    state = FleetState(index=READ_ALWAYS_INDEXES["compact"])
    proxy = ProxySettings(controlplane=[f"127.0.0.1:{port}"], pools=["bench"], proxy_id="b")
    client = StateClient(proxy, state, backoff=Backoff(base_s=0.05, cap_s=0.2))
    try:
        start, cpu = time.perf_counter(), time.process_time()
        await client.start()
        await asyncio.wait_for(client.wait_ready(), 120)
        return state, time.perf_counter() - start, time.process_time() - cpu
    finally:
        await client.aclose()
        await server.stop(grace=None)


async def snapshot_times(distinct_keys: int) -> tuple[float, float, int]:
    """(build s, build+send+apply s, chunks) for a snapshot of ``distinct_keys``."""
    fleet = filled_fleet(distinct_keys)
    broadcaster = Broadcaster(fleet, EmptyConfig())
    start = time.perf_counter()
    chunks = broadcaster.snapshot(None)
    built = time.perf_counter() - start
    broadcaster._snapshot_cache = None  # the timed send builds it again
    settings = ControlPlaneSettings(grpc_port=0)
    service = RoutingStateService(broadcaster, CountingSink(), None)
    server, port = await start_server(service, settings)
    mirror = StateMirror()
    done = asyncio.Event()
    mirror.on_update = lambda update: done.set() if mirror.complete else None
    try:
        start = time.perf_counter()
        task = asyncio.create_task(watch(f"127.0.0.1:{port}", mirror))
        await asyncio.wait_for(done.wait(), 60)
        sent = time.perf_counter() - start
        task.cancel()
    finally:
        await server.stop(grace=None)
    held = sum(len(keys) for keys in mirror.residency.values())
    expected = sum(fleet.index.key_count(o) for o in fleet.by_ordinal)
    if held != expected:
        raise AssertionError(f"the watcher holds {held} keys, the fleet {expected}")
    return built, sent, len(chunks)


async def summary_times(distinct_keys: int, top: int = 20) -> tuple[float, float, float]:
    """The control plane's residency summary (GET /v1/residency) of ``distinct_keys``:
    (the former walk of every key in Python, which held the event loop throughout, s;
    the summary now, s; the longest the event loop was held meanwhile, s), both ranking
    the same keys."""
    fleet = rows_fleet(distinct_keys)
    start = time.perf_counter()
    walked = heapq.nlargest(top, fleet.index.holdings(), key=lambda held: held[1].bit_count())
    walk_s = time.perf_counter() - start
    longest, running = 0.0, True

    async def ticking() -> None:
        nonlocal longest
        last = time.perf_counter()
        while running:
            await asyncio.sleep(0)
            now = time.perf_counter()
            longest, last = max(longest, now - last), now

    ticker = asyncio.create_task(ticking())
    await asyncio.sleep(0)
    start = time.perf_counter()
    summary = await LiveFleetView(fleet).residency_summary(top)
    summary_s = time.perf_counter() - start
    running = False
    await ticker
    assert [s.key for s in summary.most_shared] == [k for k, m in walked if m.bit_count() > 1]
    return walk_s, summary_s, longest
