"""Sidecar NATS publish -> a watching proxy's state, through a real control plane.

A real ``nats-server``, ``etcd`` and ``kvroute-controlplane`` process; this process
plays 8 sidecars publishing ``KvEventBatch``es at a fixed rate of block events (every
10 ms one batch per replica: stores of 4 chained blocks, and evictions once a replica
holds 20,000 keys) and one proxy: a :class:`StateMirror` watching over gRPC and applying
every delta. For the first key of each batch, the time from just before its publish to
the delta that adds it on the watcher is one sample (target p99 <= 100 ms at 50,000
block events/s). The first second is warm-up. The control plane's CPU time over the run
(its whole process: NATS in, ingest, deltas, gRPC out, and its idle work) is also given
per sidecar batch: at a low ``--rate`` the batches are small (8 block events at 2,000/s),
as a sidecar publishes them under short requests, one per engine step.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import nats
from nats.aio.client import Client

from bench.controlplane.mirror import StateMirror, watch
from bench.controlplane.sidecars import sidecar_batch
from kvcore import subjects
from kvcore.pb import events_pb2, routing_pb2
from kvroute.servers import EtcdServer, NatsServer

REPLICAS = 8
TICK_S = 0.01
HELD = 20_000
CONTROLPLANE = Path(sys.executable).parent / "kvroute-controlplane"


class Publisher:
    """Eight sidecars' streams at ``rate`` block events/s (of ``pool``, replicas
    ``<pool>-r0`` ...; for ``bench``, ``r0`` ...); remembers when keys left."""

    def __init__(self, nc: Client, rate: int, pool: str = "bench", seed: int = 5) -> None:
        self.nc, self.rng, self.pool = nc, random.Random(seed), pool
        self.prefix = "" if pool == "bench" else f"{pool}-"
        self.per_batch = max(int(rate * TICK_S) // REPLICAS, 8)
        self.held: list[list[int]] = [[] for _ in range(REPLICAS)]
        self.seqs = [0] * REPLICAS
        self.sent_at: dict[int, float] = {}
        self.events = 0
        self.batches = 0

    async def announce(self) -> None:
        for r in range(REPLICAS):
            msg = events_pb2.ReplicaAnnounce(
                replica_id=f"{self.prefix}r{r}",
                pool=self.pool,
                base_url="http://127.0.0.1:9",
                model="m",
            )
            await self.nc.publish(subjects.announce_subject(self.pool), msg.SerializeToString())

    async def run(self, seconds: float) -> None:
        await run_together([self], seconds)

    async def publish_tick(self) -> None:
        for r in range(REPLICAS):
            await self._publish(r)

    async def _publish(self, r: int) -> None:
        rid = f"{self.prefix}r{r}"
        batch, events = sidecar_batch(
            self.rng, self.pool, rid, self.seqs[r], self.held[r], self.per_batch, HELD
        )
        self.seqs[r] += 1
        self.events += events
        self.batches += 1
        self.sent_at[batch.events[0].stored.keys[0]] = time.monotonic()
        await self.nc.publish(subjects.events_subject(self.pool, rid), batch.SerializeToString())


async def run_together(publishers: list[Publisher], seconds: float) -> None:
    """Every publisher's batches each tick for ``seconds``."""
    start = time.monotonic()
    tick = 0
    while time.monotonic() - start < seconds:
        for publisher in publishers:
            await publisher.publish_tick()
        tick += 1
        await asyncio.sleep(max(0.0, start + tick * TICK_S - time.monotonic()))


class Samples:
    def __init__(self, publisher: Publisher, warmup_until: float) -> None:
        self.publisher, self.warmup_until = publisher, warmup_until
        self.latencies: list[float] = []

    def on_update(self, update: routing_pb2.StateUpdate) -> None:
        if update.WhichOneof("body") != "delta":
            return
        now, sent_at = time.monotonic(), self.publisher.sent_at
        for change in update.delta.residency:
            for key in change.added:
                sent = sent_at.pop(key, None)
                if sent is not None and sent >= self.warmup_until:
                    self.latencies.append(now - sent)


async def start_controlplane(
    nats_url: str, etcd: str, workdir: Path, *, pools: str = "bench", shard: str = "bench"
) -> tuple[asyncio.subprocess.Process, str]:
    """The control plane (one shard serving ``pools``, comma-separated), its records
    (the default SQLite file) kept in ``workdir``."""
    proc = await asyncio.create_subprocess_exec(
        str(CONTROLPLANE),
        *("--nats-url", nats_url, "--etcd-endpoints", etcd, "--pools", pools),
        *("--admin-port", "0", "--grpc-port", "0", "--instance-id", shard, "--shard", shard),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.DEVNULL,
        cwd=workdir,
    )
    assert proc.stdout is not None
    line = (await asyncio.wait_for(proc.stdout.readline(), 30)).decode()
    if not line.startswith("kvroute-controlplane ready"):
        raise RuntimeError(f"kvroute-controlplane did not start: {line!r}")
    return proc, dict(p.split("=", 1) for p in line.split()[2:])["grpc"]


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far."""
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True)
class Measured:
    latencies: list[float]  # seconds
    lost: int  # samples whose key never reached the watcher
    published: float  # block events/s
    busy: float  # the control plane's share of a core while publishing
    cpu_per_batch_s: float  # the control plane's CPU seconds per sidecar batch


async def measure(rate: int, seconds: float) -> Measured:
    """Publish for ``seconds`` at ``rate`` block events/s and watch; what was measured."""
    with NatsServer() as nats_server, EtcdServer() as etcd_server:
        proc, grpc_address = await start_controlplane(
            nats_server.url, etcd_server.endpoint, etcd_server.workdir
        )
        nc = await nats.connect(nats_server.url)
        publisher = Publisher(nc, rate)
        mirror = StateMirror()
        samples = Samples(publisher, time.monotonic() + 1.0)
        mirror.on_update = samples.on_update
        watching = asyncio.create_task(watch(grpc_address, mirror, pools=("bench",)))
        try:
            await publisher.announce()
            started, cpu = time.monotonic(), cpu_seconds(proc.pid)
            await publisher.run(seconds)
            elapsed = time.monotonic() - started
            published = publisher.events / elapsed
            cpu = cpu_seconds(proc.pid) - cpu
            await asyncio.sleep(0.5)  # the last deltas
        finally:
            watching.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await watching
            await nc.close()
            proc.terminate()
            await proc.wait()
    lost = sum(1 for t in publisher.sent_at.values() if t >= samples.warmup_until)
    return Measured(
        samples.latencies, lost, published, cpu / elapsed, cpu / max(publisher.batches, 1)
    )


def percentile(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=1000)[int(q * 1000) - 1] if len(values) > 1 else 0.0
