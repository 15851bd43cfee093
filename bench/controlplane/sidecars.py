"""Many sidecars' event streams, published from several processes.

One Python process publishing every sidecar's batches tops out near 200,000 block
events/s; the shards benchmark asks for 256 sidecars and up to 1M events/s, so each of
several worker processes plays a share of the sidecars (:func:`play`, run in a process
pool): its own NATS connection, each sidecar's announce, then every ``tick_s`` one
``KvEventBatch`` per sidecar on its own subject, with the sidecar's epoch and sequence
numbers, stores of 4 chained blocks and, once a sidecar holds ``held`` keys, evictions
of its oldest: the messages a sidecar publishes, byte for byte in form.

Latency samples: the first key of each batch has its top bit set (every other key is
below 2^63), so a watcher recognises a sample in a delta without knowing the keys; the
worker returns when it published each (``time.monotonic``, one clock for every process
on the machine).
"""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass, field

import nats

from kvcore import subjects
from kvcore.pb import events_pb2

SAMPLE_BIT = 1 << 63


@dataclass(frozen=True)
class Plan:
    """What one worker process publishes."""

    nats_url: str
    sidecars: tuple[tuple[str, str], ...]  # (pool, replica id)
    batch_events: int  # block events per sidecar batch
    tick_s: float  # one batch per sidecar every tick
    seconds: float
    start_at: float  # time.monotonic() of the first tick, the same in every process
    held: int  # keys a sidecar holds before it evicts
    seed: int


@dataclass
class Played:
    """What one worker published."""

    events: dict[str, int] = field(default_factory=dict)  # pool -> block events
    batches: int = 0
    late_ticks: int = 0  # ticks that began a whole tick behind schedule
    cpu_s: float = 0.0  # the worker's CPU time while publishing
    sent_at: dict[str, dict[int, float]] = field(default_factory=dict)  # pool -> samples
    replica_ids: dict[str, list[str]] = field(default_factory=dict)  # pool -> its sidecars


def play(plan: Plan) -> Played:
    """Run in a worker process: the plan's sidecars for ``plan.seconds``."""
    return asyncio.run(_play(plan))


async def _play(plan: Plan) -> Played:
    nc = await nats.connect(plan.nats_url, pending_size=64 * 1024 * 1024)
    rng = random.Random(plan.seed)
    pools = {pool for pool, _ in plan.sidecars}
    played = Played(events=dict.fromkeys(pools, 0), sent_at={pool: {} for pool in pools})
    for pool, rid in plan.sidecars:
        played.replica_ids.setdefault(pool, []).append(rid)
    held: list[list[int]] = [[] for _ in plan.sidecars]
    seqs = [0] * len(plan.sidecars)
    topics = [subjects.events_subject(pool, rid) for pool, rid in plan.sidecars]
    for pool, rid in plan.sidecars:
        announce = events_pb2.ReplicaAnnounce(
            replica_id=rid, pool=pool, base_url="http://127.0.0.1:9", model="m"
        )
        await nc.publish(subjects.announce_subject(pool), announce.SerializeToString())
    await nc.flush()
    await asyncio.sleep(max(0.0, plan.start_at - time.monotonic()))
    cpu = time.process_time()
    tick = 0
    while (now := time.monotonic()) < plan.start_at + plan.seconds:
        if now - (plan.start_at + tick * plan.tick_s) > plan.tick_s:
            played.late_ticks += 1
        for number, (pool, rid) in enumerate(plan.sidecars):
            batch = _batch(plan, rng, pool, rid, seqs[number], held[number], played)
            seqs[number] += 1
            played.sent_at[pool][batch.events[0].stored.keys[0]] = time.monotonic()
            await nc.publish(topics[number], batch.SerializeToString())
        tick += 1
        await asyncio.sleep(max(0.0, plan.start_at + tick * plan.tick_s - time.monotonic()))
    played.cpu_s = time.process_time() - cpu
    await nc.flush()
    await nc.close()
    return played


def _batch(
    plan: Plan,
    rng: random.Random,
    pool: str,
    rid: str,
    seq: int,
    held: list[int],
    played: Played,
) -> events_pb2.KvEventBatch:
    batch, events = sidecar_batch(rng, pool, rid, seq, held, plan.batch_events, plan.held)
    played.events[pool] += events
    played.batches += 1
    return batch


def sidecar_batch(
    rng: random.Random, pool: str, rid: str, seq: int, held: list[int], budget: int, limit: int
) -> tuple[events_pb2.KvEventBatch, int]:
    """A sidecar's next batch of about ``budget`` block events: stores of 4 new chained
    blocks (the first key a sample: :data:`SAMPLE_BIT`), and evictions of its oldest
    keys once it holds ``limit``; ``held`` (its keys, oldest first) follows. The batch
    and its number of block events."""
    evict = min(max(len(held) + budget // 2 - limit, 0), budget // 2)
    stores = max((budget - evict) // 4, 1)
    keys = [rng.getrandbits(63) for _ in range(stores * 4)]
    keys[0] |= SAMPLE_BIT
    batch = events_pb2.KvEventBatch(replica_id=rid, pool=pool, epoch=1, seq=seq)
    for i in range(stores):
        batch.events.add().stored.keys.extend(keys[i * 4 : i * 4 + 4])
    if evict:
        batch.events.add().removed.keys.extend(held[:evict])
        del held[:evict]
    held.extend(keys)
    return batch, len(keys) + evict
