"""Control-plane figures measured in one process, on one core.

- **ingest**: sidecar ``KvEventBatch`` bytes (16 replicas; each batch 16 chained stores
  of 4 blocks and, once a replica holds its share, as many one-block evictions: ~64
  block events) through the control plane's own path: subject parse, protobuf decode,
  stream sequencing, residency index, change log. Measured alone, and with a delta built
  and serialized every 5,000 block events (25 ms at the target rate), as the broadcaster
  does (target >= 200,000 block events/s). Timed in CPU seconds of this process, so a
  machine shared with other work does not count against it.
- **memory**: resident set growth per resident key once the index holds ~1M keys.
- **snapshot**: a 1M-key snapshot built (grouped by holder, chunked, serialized) and
  then sent over real gRPC on loopback to a watcher that parses and applies every chunk
  (target <= 2 s, build and send).
"""

from __future__ import annotations

import asyncio
import gc
import random
import resource
import time
from collections.abc import Iterator

from bench.controlplane.mirror import StateMirror, watch
from controlplane.broadcast import Broadcaster, EmptyConfig
from controlplane.fleet import Fleet
from controlplane.ingest import Ingest
from controlplane.routing_server import RoutingStateService, start_server
from controlplane.service import CountingSink
from controlplane.settings import ControlPlaneSettings
from kvcore import subjects
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
