"""The proxy's state side against the real control plane: real NATS and etcd, a sidecar
double publishing what a sidecar publishes, ``ControlPlane`` serving RoutingState over
gRPC, and the proxy's StateClient, FleetState and Reporter."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from controlplane.service import ControlPlane, CountingSink
from controlplane.settings import ControlPlaneSettings
from dataplane.fleet.state import FleetState
from dataplane.reporter import Reporter
from dataplane.settings import ProxySettings
from dataplane.state_client import Backoff, StateClient
from kvroute.servers import EtcdServer, NatsServer, free_port
from tests.integration.controlplane_harness import SidecarDouble

pytestmark = pytest.mark.integration
POOL, MODEL = "px", "m"
KEYS = list(range(1001, 1033))


def ids(state: FleetState) -> list[str]:
    return [r.replica_id for r in state.views.view(MODEL).replicas()]


def held(state: FleetState) -> list[int]:
    return sorted(state.views.view(MODEL).leading_runs(KEYS, now=None).values())


@pytest.fixture
def cp_settings(nats_server: NatsServer, etcd_server: EtcdServer) -> ControlPlaneSettings:
    return ControlPlaneSettings(
        nats_url=nats_server.url,
        etcd_endpoints=[etcd_server.endpoint],
        etcd_prefix="/proxy-state-watch/",
        admin_port=0,
        grpc_port=free_port(),
        instance_id="cp-a",
        pools=[POOL],
        heartbeat_timeout_s=5.0,
    )


@pytest.fixture
async def sidecar(nats_server: NatsServer) -> AsyncIterator[SidecarDouble]:
    double = await SidecarDouble(nats_server.url, "px-r1", pool=POOL).start()
    yield double
    await double.stop()


async def test_the_proxy_follows_the_control_plane_and_survives_its_restart(
    cp_settings: ControlPlaneSettings, sidecar: SidecarDouble
) -> None:
    address = f"127.0.0.1:{cp_settings.grpc_port}"
    proxy = ProxySettings(controlplane=[address], pools=[POOL], proxy_id="p1")
    state = FleetState()
    client = StateClient(proxy, state, backoff=Backoff(base_s=0.05, cap_s=0.2))
    control_plane = ControlPlane(cp_settings)
    await control_plane.start()
    await client.start()
    try:
        await sidecar.announce()
        await sidecar.load(running=3)
        await sidecar.store(KEYS)
        async with asyncio.timeout(10):
            await client.wait_until(lambda s: held(s) == [len(KEYS)])
        assert ids(state) == ["px-r1"]
        assert state.views.view(MODEL).replicas()[0].running == 3
        first_epoch = state.position()[0]

        await sidecar.remove(KEYS[16:])
        async with asyncio.timeout(10):
            await client.wait_until(lambda s: held(s) == [16])

        sink = control_plane.records.reports
        assert isinstance(sink, CountingSink)
        reporter = Reporter(proxy)
        reporter.record("default", POOL, "px-r1", 512, 256, 240, error=False)
        await reporter.aclose()  # sends what it counted
        assert [(r.proxy_id, r.rows[0].counters.measured_cached_tokens) for r in sink.received] == [
            ("p1", 240)
        ]

        await control_plane.aclose()
        assert ids(state) == ["px-r1"] and held(state) == [16]  # routing goes on
        control_plane = ControlPlane(cp_settings)  # a new epoch, on the same address
        await control_plane.start()
        await sidecar.announce()
        async with asyncio.timeout(15):
            await client.wait_until(lambda s: s.position()[0] not in (0, first_epoch))
            await client.wait_until(lambda s: held(s) == [16])
        assert client.snapshots == 2
    finally:
        await client.aclose()
        await control_plane.aclose()
