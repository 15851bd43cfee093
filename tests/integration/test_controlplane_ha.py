"""Two control-plane processes on real NATS and etcd: kill -9 the leader mid-stream.

The standby ingests all along, so when the leader's lease expires it takes over with
its map warm, and a proxy watching it sees a state equal to what the sidecars hold.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import time

import aetcd

from bench.controlplane.mirror import StateMirror, watch
from kvcore.pb import routing_pb2
from kvcore.subjects import EtcdKeys
from kvroute.servers import EtcdServer, NatsServer
from tests.integration.controlplane_harness import ControlPlaneProcess, SidecarDouble
from tests.integration.sidecar_harness import wait_until

TTL_S = 3


async def churn(sidecars: list[SidecarDouble], stop: asyncio.Event) -> None:
    """Store and evict keys on every replica until told to stop."""
    rng = random.Random(7)
    while not stop.is_set():
        for sidecar in sidecars:
            start = rng.randrange(1, 1 << 40)
            await sidecar.store(range(start, start + 32))
            if len(sidecar.held) > 2000:
                await sidecar.remove(rng.sample(sorted(sidecar.held), 64))
            await sidecar.load(running=rng.randrange(8))
        await asyncio.sleep(0.005)


async def leader_of(etcd: aetcd.Client, key: str) -> str | None:
    found = await etcd.get(key.encode())
    return None if found is None else found.value.decode()


async def wait_for_leader(etcd: aetcd.Client, key: str, want: str, deadline_s: float) -> None:
    """Until ``want`` holds the leader key (watching it: no polling)."""
    async with asyncio.timeout(deadline_s):
        watch = await etcd.watch(key.encode())
        try:
            if await leader_of(etcd, key) == want:
                return
            async for event in watch:
                if event.kind == "PUT" and event.kv.value.decode() == want:
                    return
        finally:
            await watch.cancel()


async def membership_written_by(
    etcd: aetcd.Client, keys: EtcdKeys, instance: str, deadline_s: float
) -> dict[str, dict[str, object]]:
    """The pool's membership records once ``instance`` wrote them all (a deadline bounds a
    failure): a one-shot read right after a takeover can land before its first write."""
    async with asyncio.timeout(deadline_s):
        while True:
            members = await etcd.get_prefix(keys.replicas_prefix("ha").encode())
            written = {json.loads(kv.value)["replica_id"]: json.loads(kv.value) for kv in members}
            if len(written) >= 2 and all(m["instance"] == instance for m in written.values()):
                return written
            await asyncio.sleep(0.05)


async def test_kill_the_leader_mid_stream_and_the_standby_serves_a_consistent_state(
    nats_server: NatsServer, etcd_server: EtcdServer
) -> None:
    keys = EtcdKeys("/ha-kill/")
    common = [
        "--nats-url", nats_server.url, "--etcd-endpoints", etcd_server.endpoint,
        "--etcd-prefix", keys.prefix, "--pools", "ha", "--lease-ttl-s", str(TTL_S),
    ]  # fmt: skip
    host, port = etcd_server.endpoint.split(":")
    etcd = aetcd.Client(host, int(port))
    sidecars = [await SidecarDouble(nats_server.url, f"ha-r{i}", pool="ha").start() for i in (1, 2)]
    leader = await ControlPlaneProcess([*common, "--instance-id", "cp-a"]).start()
    standby = await ControlPlaneProcess([*common, "--instance-id", "cp-b"]).start()
    stop, mirror = asyncio.Event(), StateMirror()
    tasks = [asyncio.create_task(churn(sidecars, stop))]
    try:
        for sidecar in sidecars:
            await sidecar.announce()
        leader_key = keys.shard_leader("all")
        await wait_for_leader(etcd, leader_key, "cp-a", 10)
        tasks.append(asyncio.create_task(watch(standby.grpc, mirror, pools=("ha",))))
        await wait_until(lambda: all(mirror.keys_of(s.replica) for s in sidecars))

        leader.kill()
        killed_at = time.monotonic()
        await wait_for_leader(etcd, leader_key, "cp-b", TTL_S + 5)
        took = time.monotonic() - killed_at
        assert took <= TTL_S + 0.5, f"standby took over after {took:.2f} s"

        stop.set()
        await tasks[0]
        await wait_until(lambda: all(mirror.keys_of(s.replica) == s.held for s in sidecars))
        consistent = time.monotonic() - killed_at
        assert consistent <= TTL_S + 1, f"consistent only {consistent:.2f} s after the kill"
        # the new leader rewrites membership under its own lease in its first term step
        # (the old leader's records went with its lease): wait for that write, bounded
        written = await membership_written_by(etcd, keys, "cp-b", 10)
        assert set(written) == {"ha-r1", "ha-r2"}
        assert {m["instance"] for m in written.values()} == {"cp-b"}
        # a drain written by anyone (here by hand, as etcdctl would) reaches the proxies
        await etcd.put(keys.replica_drain("ha", "ha-r1").encode(), b"1")
        await wait_until(
            lambda: (
                {r.replica_id: r.status for r in mirror.replicas.values()}
                == {
                    "ha-r1": routing_pb2.REPLICA_STATUS_DRAINING,
                    "ha-r2": routing_pb2.REPLICA_STATUS_HEALTHY,
                }
            )
        )
    finally:
        stop.set()
        for task in tasks:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        await standby.stop()
        await leader.stop()
        for sidecar in sidecars:
            await sidecar.stop()
        await etcd.close()
