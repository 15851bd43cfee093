"""Proxies behind one balancer are numbered by the control planes they watch: each a
place of its own across both instances of the shard (etcd), the lowest free one, given
back when its watch ends. kv_aware's and kv_cost's turns for new prompts start at a
proxy's place, so that proxies of a Deployment, all started alike, do not send a burst
of new prompts to the same replica at once."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import aetcd
import pytest

from controlplane.service import ControlPlane
from controlplane.settings import ControlPlaneSettings
from dataplane.fleet.state import FleetState
from dataplane.settings import ProxySettings
from dataplane.state_client import Backoff, StateClient
from kvroute.servers import EtcdServer, NatsServer, free_port

pytestmark = pytest.mark.integration
POOL = "pl"
PREFIX = "/proxy-places/"


def settings(nats: NatsServer, etcd: EtcdServer, instance: str) -> ControlPlaneSettings:
    return ControlPlaneSettings(
        nats_url=nats.url,
        etcd_endpoints=[etcd.endpoint],
        etcd_prefix=PREFIX,
        admin_port=0,
        grpc_port=free_port(),
        instance_id=instance,
        pools=[POOL],
    )


@pytest.fixture
async def planes(
    nats_server: NatsServer, etcd_server: EtcdServer
) -> AsyncIterator[list[ControlPlane]]:
    started = [ControlPlane(settings(nats_server, etcd_server, i)) for i in ("cp-a", "cp-b")]
    for plane in started:
        await plane.start()
    yield started
    for plane in started:
        await plane.aclose()


class Proxy:
    """A proxy's state client watching one control plane, with the places it was told."""

    def __init__(self, plane: ControlPlane, name: str) -> None:
        self.places: list[int] = []
        self.client = StateClient(
            ProxySettings(
                controlplane=[f"127.0.0.1:{plane.grpc_port}"], pools=[POOL], proxy_id=name
            ),
            FleetState(),
            backoff=Backoff(base_s=0.05, cap_s=0.2),
            on_place=self.places.append,
        )

    async def start(self) -> Proxy:
        await self.client.start()
        async with asyncio.timeout(10):
            await self.client.wait_ready()
        return self


async def held_places(etcd_server: EtcdServer) -> dict[int, str]:
    async with aetcd.Client(host="127.0.0.1", port=etcd_server.port, timeout=10) as etcd:
        found = await etcd.get_prefix(f"{PREFIX}shards/all/proxies/".encode())
        return {int(kv.key.rsplit(b"/", 1)[1]): kv.value.decode() for kv in found}


async def given_back(etcd_server: EtcdServer, place: int) -> None:
    """Until etcd no longer holds ``place`` (its deletion watched, not polled)."""
    key = f"{PREFIX}shards/all/proxies/{place}".encode()
    async with aetcd.Client(host="127.0.0.1", port=etcd_server.port, timeout=10) as etcd:
        found = await etcd.get(key)
        if found is not None:
            await etcd.watch_once(key, timeout=10, start_revision=found.mod_revision + 1)


async def test_each_proxy_of_the_shard_gets_a_place_of_its_own_and_gives_it_back(
    planes: list[ControlPlane], etcd_server: EtcdServer
) -> None:
    first, second = planes
    proxies = [
        await Proxy(first, "p-0").start(),
        await Proxy(second, "p-1").start(),  # the other instance numbers on from the first's
        await Proxy(first, "p-2").start(),
    ]
    try:
        assert [p.places for p in proxies] == [[0], [1], [2]]
        assert [p.client.status()["place"] for p in proxies] == [0, 1, 2]  # /readyz shows it
        assert await held_places(etcd_server) == {0: "p-0", 1: "p-1", 2: "p-2"}

        await proxies[1].client.aclose()  # its watch ends: place 1 is free again
        await given_back(etcd_server, 1)
        proxies[1] = await Proxy(first, "p-3").start()
        assert proxies[1].places == [1]
        assert await held_places(etcd_server) == {0: "p-0", 1: "p-3", 2: "p-2"}
    finally:
        for proxy in proxies:
            await proxy.client.aclose()
