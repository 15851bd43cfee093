"""Control-plane shards measured: pools split between ``kvroute-controlplane`` processes.

A real ``nats-server`` and ``etcd``; one control-plane process per shard, each serving
two pools (``--pools``, ``--shard``); this process plays 8 sidecars per pool publishing
their exact wire messages (``latency.Publisher``) at a total rate split evenly over the
pools, and one proxy per shard (a :class:`StateMirror` watching its shard's pools). Per
shard: the block events published to its pools, its process's CPU share, and publish ->
watcher latency; and whether each watcher holds only its own pools' replicas and keys.
Run with 2 and then 3 shards at one total rate, the per-shard share of the load and of
the CPU shows how a shard added takes its part.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass

import nats

from bench.controlplane.latency import (
    Publisher,
    Samples,
    cpu_seconds,
    percentile,
    run_together,
    start_controlplane,
)
from bench.controlplane.mirror import StateMirror, watch
from kvroute.servers import EtcdServer, NatsServer

POOLS_PER_SHARD = 2


@dataclass(frozen=True)
class ShardFigures:
    shard: str
    pools: tuple[str, ...]
    published: float  # block events/s to its pools
    busy: float  # its process's share of a core
    p50_s: float
    p99_s: float
    samples: int
    lost: int
    only_its_pools: bool  # its watcher held no replica or key of another shard's pools

    def row(self) -> str:
        return (
            f"{self.shard} ({','.join(self.pools)}): {self.published:,.0f} block events/s, "
            f"{self.busy:.0%} of a core, publish -> watcher p50 {self.p50_s * 1e3:.1f} ms "
            f"p99 {self.p99_s * 1e3:.1f} ms ({self.samples:,} samples, {self.lost} lost)"
            + ("" if self.only_its_pools else ", OTHER POOLS SEEN")
        )


async def measure(shards: int, rate: int, seconds: float) -> list[ShardFigures]:
    """``shards`` shards under ``rate`` block events/s in total for ``seconds``."""
    names = [f"s{i}" for i in range(shards)]
    pools = {n: tuple(f"{n}p{j}" for j in range(POOLS_PER_SHARD)) for n in names}
    per_pool = rate // (shards * POOLS_PER_SHARD)
    with NatsServer() as nats_server, EtcdServer() as etcd_server:
        procs, addresses = {}, {}
        for name in names:
            workdir = etcd_server.workdir / name
            workdir.mkdir()
            procs[name], addresses[name] = await start_controlplane(
                nats_server.url,
                etcd_server.endpoint,
                workdir,
                pools=",".join(pools[name]),
                shard=name,
            )
        nc = await nats.connect(nats_server.url)
        publishers = {
            name: [Publisher(nc, per_pool, pool, seed=i) for i, pool in enumerate(pools[name])]
            for name in names
        }
        warm = time.monotonic() + 1.0
        mirrors = {name: StateMirror() for name in names}
        samples = {name: _Samples(publishers[name], warm) for name in names}
        watching = []
        for name in names:
            mirrors[name].on_update = samples[name].on_update
            watching.append(
                asyncio.create_task(watch(addresses[name], mirrors[name], pools=pools[name]))
            )
        try:
            everyone = [p for name in names for p in publishers[name]]
            for publisher in everyone:
                await publisher.announce()
            started = time.monotonic()
            cpu = {name: cpu_seconds(procs[name].pid) for name in names}
            await run_together(everyone, seconds)
            elapsed = time.monotonic() - started
            cpu = {name: cpu_seconds(procs[name].pid) - cpu[name] for name in names}
            await asyncio.sleep(0.5)  # the last deltas
        finally:
            for task in watching:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
            await nc.close()
            for proc in procs.values():
                proc.terminate()
                await proc.wait()
    return [
        _figures(name, pools[name], publishers[name], samples[name], mirrors[name], cpu, elapsed)
        for name in names
    ]


class _Samples:
    """Latency samples of one shard's publishers, seen by its watcher."""

    def __init__(self, publishers: list[Publisher], warm: float) -> None:
        self.each = [Samples(p, warm) for p in publishers]

    def on_update(self, update: object) -> None:
        for samples in self.each:
            samples.on_update(update)  # type: ignore[arg-type]

    @property
    def latencies(self) -> list[float]:
        return [t for s in self.each for t in s.latencies]

    def lost(self) -> int:
        return sum(
            1 for s in self.each for t in s.publisher.sent_at.values() if t >= s.warmup_until
        )


def _figures(
    name: str,
    pools: tuple[str, ...],
    publishers: list[Publisher],
    samples: _Samples,
    mirror: StateMirror,
    cpu: dict[str, float],
    elapsed: float,
) -> ShardFigures:
    latencies = samples.latencies
    own_ids = {f"{p.prefix}r{r}" for p in publishers for r in range(len(p.held))}
    own_keys = {k for p in publishers for held in p.held for k in held}
    seen_ids = {r.replica_id for r in mirror.replicas.values()}
    seen_keys = {k for keys in mirror.residency.values() for k in keys}
    return ShardFigures(
        shard=name,
        pools=pools,
        published=sum(p.events for p in publishers) / elapsed,
        busy=cpu[name] / elapsed,
        p50_s=percentile(latencies, 0.5),
        p99_s=percentile(latencies, 0.99),
        samples=len(latencies),
        lost=samples.lost(),
        only_its_pools=seen_ids <= own_ids and seen_keys <= own_keys and bool(seen_keys),
    )
