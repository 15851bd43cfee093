"""Control-plane shards measured: pools split between ``kvroute-controlplane`` processes.

A real ``nats-server`` and ``etcd``; one control-plane process per shard, each serving
two pools (``--pools``, ``--shard``); ``sidecars`` simulated sidecars spread over the
pools, played by ``publishers`` worker processes publishing their exact wire messages
(:mod:`bench.controlplane.sidecars`) at ``rate`` block events/s in total; and a proxy's
watch of every shard (one :class:`StateMirror` per shard, watching that shard's pools,
in this process), and ``watchers - 1`` more streams per shard read and dropped (what
each further proxy costs a shard: the control plane serializes each version once and
sends it to every watcher). Every sidecar batch holds ``batch_events`` events, as at 1M events/s
from 256 sidecars publishing every 10 ms (39), whatever the rate: a lower rate means
fewer batches a second, not smaller ones, so the cost per event measured is the one
that holds at full rate (:func:`tick_s`).

Per shard: the block events published to its pools, its process's CPU (share of a
core, and events per CPU second), publish -> watcher latency (p50, p99, lost samples),
and whether its watcher held only its own pools' replicas and keys. For the whole run:
what the machine's cores did (busy, and stolen by the hypervisor), the publishers' and
this process's CPU, and the ticks the publishers started late (they could not keep up).
Run with 2 and then 3 shards at one total rate, the per-shard share of the load and of
the CPU shows how a shard added takes its part.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from multiprocessing import get_context

from bench.controlplane.latency import cpu_seconds, percentile, start_controlplane
from bench.controlplane.mirror import StateMirror, drain, watch
from bench.controlplane.sidecars import SAMPLE_BIT, Plan, Played, play
from kvcore.pb import routing_pb2
from kvroute.servers import EtcdServer, NatsServer

POOLS_PER_SHARD = 2
WARMUP_S = 1.0  # samples published in the first second are not counted
SETTLE_S = 2.0  # how long the watchers may take after the last publish


@dataclass(frozen=True)
class Load:
    shards: int
    rate: int  # block events/s in total
    seconds: float
    sidecars: int = 256
    publishers: int = 4  # worker processes playing the sidecars
    batch_events: int = 40  # per sidecar batch: 1M/s from 256 sidecars every 10 ms
    held: int = 4_000  # keys a sidecar holds before it evicts its oldest
    watchers: int = 1  # watch streams per shard: one applied (a proxy), the others drained


def tick_s(load: Load) -> float:
    """How often each sidecar publishes: ``rate`` = sidecars x batch_events / tick."""
    return load.batch_events * load.sidecars / load.rate


@dataclass(frozen=True)
class ShardFigures:
    shard: str
    pools: tuple[str, ...]
    published: float  # block events/s to its pools
    seconds: float  # publishing
    busy: float  # its process's share of a core, from the first publish until caught up
    cpu_s: float  # its process's CPU time over the same
    p50_s: float
    p99_s: float
    samples: int
    lost: int
    only_its_pools: bool  # its watcher held no replica or key of another shard's pools

    @property
    def events_per_cpu_s(self) -> float:
        """Block events per second of its CPU (its idle work counted in: conservative)."""
        return self.published * self.seconds / self.cpu_s if self.cpu_s else 0.0

    def row(self) -> str:
        return (
            f"{self.shard} ({','.join(self.pools)}): {self.published:,.0f} block events/s, "
            f"{self.busy:.0%} of a core ({self.events_per_cpu_s:,.0f} events per CPU s), "
            f"publish -> watcher p50 {self.p50_s * 1e3:.1f} ms p99 {self.p99_s * 1e3:.1f} ms "
            f"({self.samples:,} samples, {self.lost} lost)"
            + ("" if self.only_its_pools else ", OTHER POOLS SEEN")
        )


@dataclass(frozen=True)
class RunFigures:
    load: Load
    shards: list[ShardFigures]
    machine_busy: float  # cores busy from the first publish until caught up (of cpu_count)
    machine_steal: float  # cores' time taken by the hypervisor
    publishers_cpu: float  # the publisher processes' cores
    watcher_cpu: float  # this process's cores (every shard's watch, applied)
    late_ticks: int
    drained: int  # updates the further watchers read (all of them)
    load_average: tuple[float, float, float]

    def row(self) -> str:
        return (
            f"machine {self.machine_busy:.2f} of {os.cpu_count()} cores busy "
            f"({self.machine_steal:.2f} stolen); publishers {self.publishers_cpu:.2f}, "
            f"watchers {self.watcher_cpu:.2f}; {self.late_ticks} late ticks; "
            f"{self.drained:,} updates read by further watchers; "
            f"load average {self.load_average[0]:.1f}"
        )


async def measure(shards: int, rate: int, seconds: float, **options: int) -> list[ShardFigures]:
    """``shards`` shards under ``rate`` block events/s in total for ``seconds``."""
    return (await measure_run(Load(shards, rate, seconds, **options))).shards


async def measure_run(load: Load) -> RunFigures:
    names = [f"s{i}" for i in range(load.shards)]
    pools = {n: tuple(f"{n}p{j}" for j in range(POOLS_PER_SHARD)) for n in names}
    every_pool = [pool for name in names for pool in pools[name]]
    sidecars = [
        (
            every_pool[n % len(every_pool)],
            f"{every_pool[n % len(every_pool)]}-r{n // len(every_pool)}",
        )
        for n in range(load.sidecars)
    ]
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
        mirrors = {name: StateMirror() for name in names}
        arrived: dict[str, dict[int, float]] = {name: {} for name in names}
        watching: list[asyncio.Task[object]] = []
        drained = [0]  # updates the further watchers read
        for name in names:
            mirrors[name].on_update = _arrivals(arrived[name])
            watching.append(
                asyncio.create_task(watch(addresses[name], mirrors[name], pools=pools[name]))
            )
            for _ in range(load.watchers - 1):  # (more proxies: what each costs the shard)
                reading = drain(addresses[name], pools[name], drained)
                watching.append(asyncio.create_task(reading))
        start_at = time.monotonic() + 2.0 + 0.25 * load.publishers  # (workers start)
        plans = [
            Plan(
                nats_server.url,
                tuple(sidecars[w :: load.publishers]),
                load.batch_events,
                tick_s(load),
                load.seconds,
                start_at,
                load.held,
                seed=w,
            )
            for w in range(load.publishers)
        ]
        loop = asyncio.get_running_loop()
        try:
            with ProcessPoolExecutor(load.publishers, mp_context=get_context("spawn")) as pool:
                running = [loop.run_in_executor(pool, play, plan) for plan in plans]
                await asyncio.sleep(max(0.0, start_at - time.monotonic()))
                cpu = {name: cpu_seconds(procs[name].pid) for name in names}
                machine, mine = _machine_jiffies(), time.process_time()
                played: list[Played] = await asyncio.gather(*running)
            await _settle(arrived, played)  # (the work behind, if any, counted too)
            wall = time.monotonic() - start_at
            cpu = {name: cpu_seconds(procs[name].pid) - cpu[name] for name in names}
            machine = [b - a for a, b in zip(machine, _machine_jiffies(), strict=True)]
            mine = time.process_time() - mine
        finally:
            for task in watching:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
            for proc in procs.values():
                proc.terminate()
                await proc.wait()
    total = sum(machine)
    figures = [
        _figures(name, pools[name], played, arrived[name], mirrors[name], cpu[name], wall, load)
        for name in names
    ]
    cores = os.cpu_count() or 1
    return RunFigures(
        load,
        figures,
        machine_busy=cores * (total - machine[3] - machine[4]) / total,
        machine_steal=cores * machine[7] / total,
        publishers_cpu=sum(p.cpu_s for p in played) / load.seconds,
        watcher_cpu=mine / wall,
        late_ticks=sum(p.late_ticks for p in played),
        drained=drained[0],
        load_average=os.getloadavg(),
    )


def _arrivals(arrived: dict[int, float]) -> Callable[[routing_pb2.StateUpdate], None]:
    """A watcher's hook: when each sample key first arrived in a delta."""

    def on_update(update: routing_pb2.StateUpdate) -> None:
        if update.WhichOneof("body") != "delta":
            return
        now = time.monotonic()
        for change in update.delta.residency:
            for key in change.added:
                if key >= SAMPLE_BIT:
                    arrived.setdefault(key, now)

    return on_update


async def _settle(arrived: dict[str, dict[int, float]], played: list[Played]) -> None:
    """Until every sample arrived, or none for ``SETTLE_S``."""
    wanted = sum(len(sent) for p in played for sent in p.sent_at.values())
    seen, quiet_since = -1, time.monotonic()
    while time.monotonic() - quiet_since < SETTLE_S:
        now_seen = sum(len(a) for a in arrived.values())
        if now_seen >= wanted:
            return
        if now_seen != seen:
            seen, quiet_since = now_seen, time.monotonic()
        await asyncio.sleep(0.05)


def _machine_jiffies() -> list[int]:
    """The first line of /proc/stat: user nice system idle iowait irq softirq steal."""
    with open("/proc/stat") as stat:
        return [int(v) for v in stat.readline().split()[1:9]]


def _figures(
    name: str,
    pools: tuple[str, ...],
    played: list[Played],
    arrived: dict[int, float],
    mirror: StateMirror,
    cpu: float,
    wall: float,
    load: Load,
) -> ShardFigures:
    sent = {k: t for p in played for pool in pools for k, t in p.sent_at.get(pool, {}).items()}
    counted = {k: t for k, t in sent.items() if t >= min(sent.values(), default=0) + WARMUP_S}
    latencies = [arrived[k] - t for k, t in counted.items() if k in arrived]
    own_ids = {rid for p in played for pool in pools for rid in _ids(p, pool)}
    seen_ids = {r.replica_id for r in mirror.replicas.values()}
    seen_samples = {k for keys in mirror.residency.values() for k in keys if k >= SAMPLE_BIT}
    events = sum(p.events.get(pool, 0) for p in played for pool in pools)
    return ShardFigures(
        shard=name,
        pools=pools,
        published=events / load.seconds,
        seconds=load.seconds,
        busy=cpu / wall,
        cpu_s=cpu,
        p50_s=percentile(latencies, 0.5),
        p99_s=percentile(latencies, 0.99),
        samples=len(latencies),
        lost=len(counted) - len(latencies),
        only_its_pools=bool(seen_samples) and seen_samples <= set(sent) and seen_ids <= own_ids,
    )


def _ids(played: Played, pool: str) -> set[str]:
    return set(played.replica_ids.get(pool, ()))
