"""The control plane's ingest on real NATS: resync, shards by pool, malformed messages."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager

import nats

from controlplane.fleet.fleet import Fleet
from controlplane.fleet.ingest import Ingest
from controlplane.settings import ControlPlaneSettings
from kvroute.servers import NatsServer
from tests.integration.controlplane_harness import SidecarDouble
from tests.integration.sidecar_harness import wait_until


def held(fleet: Fleet, replica: str) -> set[int]:
    record = fleet.by_id.get(replica)
    return set() if record is None else set(fleet.index.keys_of(record.ordinal))


@asynccontextmanager
async def ingesting(url: str, pools: Sequence[str] = (), **extra: object) -> AsyncIterator[Ingest]:
    settings = ControlPlaneSettings(nats_url=url, pools=list(pools), **extra)  # type: ignore[arg-type]
    fleet = Fleet(heartbeat_timeout_s=settings.heartbeat_timeout_s, resync_retry_s=0.5)
    ingest = Ingest(settings, fleet)
    await ingest.start()
    try:
        yield ingest
    finally:
        await ingest.aclose()


async def test_a_late_control_plane_resyncs_and_a_lost_batch_is_recovered(
    nats_server: NatsServer,
) -> None:
    sidecar = await SidecarDouble(nats_server.url, "late-r1", pool="late").start()
    try:
        await sidecar.store(range(1, 3001))  # before any control plane listens
        async with ingesting(nats_server.url, ["late"]) as ingest:
            await sidecar.announce()
            await wait_until(lambda: held(ingest.fleet, "late-r1") == sidecar.held)
            await sidecar.store([5000, 5001], lose=True)  # a batch NATS never delivers
            await sidecar.remove([1, 2])
            await sidecar.store([6000])
            await wait_until(lambda: held(ingest.fleet, "late-r1") == sidecar.held)
            assert sidecar.resyncs == 2, ingest.fleet.stats.resyncs
            assert ingest.fleet.by_id["late-r1"].stream.exact
    finally:
        await sidecar.stop()


async def test_two_shards_side_by_side_hold_only_their_pools(nats_server: NatsServer) -> None:
    sidecars = [
        await SidecarDouble(nats_server.url, f"{pool}-r{i}", pool=pool).start()
        for pool in ("shard-a", "shard-b", "shard-c")
        for i in range(2)
    ]
    try:
        async with (
            ingesting(nats_server.url, ["shard-a"], shard="a") as a,
            ingesting(nats_server.url, ["shard-b", "shard-c"], shard="b") as b,
        ):
            for n, sidecar in enumerate(sidecars):
                await sidecar.announce()
                await sidecar.store(range(n * 100, n * 100 + 50))
            await wait_until(lambda: len(a.fleet.by_id) == 2 and len(b.fleet.by_id) == 4)

            def exact() -> bool:
                return all(
                    held((a if s.pool == "shard-a" else b).fleet, s.replica) == s.held
                    for s in sidecars
                )

            await wait_until(exact)
            assert {r.pool for r in a.fleet.by_id.values()} == {"shard-a"}
            assert {r.pool for r in b.fleet.by_id.values()} == {"shard-b", "shard-c"}
            assert a.fleet.index.key_count() == 100 and b.fleet.index.key_count() == 200
    finally:
        for sidecar in sidecars:
            await sidecar.stop()


async def test_malformed_messages_are_counted_and_skipped(nats_server: NatsServer) -> None:
    sidecar = await SidecarDouble(nats_server.url, "m-r1", pool="malformed").start()
    nc = await nats.connect(nats_server.url)
    try:
        async with ingesting(nats_server.url, ["malformed"]) as ingest:
            await nc.publish("kvroute.v1.events.malformed.m-r1", b"\xff\xff not protobuf")
            await nc.publish("kvroute.v1.load.malformed.m-r1", b"\x08")
            await nc.publish("kvroute.v1.announce.malformed", b"\x0a\x03a.b\x12\x09malformed")
            await nc.publish("kvroute.v1.events.malformed.m-r1", b"\x0a\x04nope")
            await nc.flush()
            await sidecar.announce()
            await sidecar.store([1, 2, 3])
            await wait_until(lambda: held(ingest.fleet, "m-r1") == {1, 2, 3})
            await wait_until(lambda: sum(ingest.malformed.values()) == 4)  # other connection
            assert ingest.malformed == {"events": 2, "load": 1, "announce": 1}
            assert set(ingest.fleet.by_id) == {"m-r1"}
    finally:
        await nc.close()
        await sidecar.stop()
