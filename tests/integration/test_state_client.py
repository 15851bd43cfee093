"""The proxy's Watch client against a real grpc.aio RoutingState server (by method name)."""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
import trustme

from dataplane.fleet.state import FleetState
from dataplane.settings import ProxySettings
from dataplane.state_client import Backoff, StateClient
from kvcore.pb import routing_pb2
from kvroute.servers import free_port
from tests.integration.routing_state_server import RoutingStateServer
from tests.unit.dataplane.state_messages import MODEL, load, replica, residency_change

pytestmark = pytest.mark.integration
KEYS = [11, 12, 13, 14]
FAST = Backoff(base_s=0.01, cap_s=0.05)


def settings(*addresses: str, **fields: object) -> ProxySettings:
    return ProxySettings(controlplane=list(addresses), pools=["default"], proxy_id="p1", **fields)  # type: ignore[arg-type]


def ids(state: FleetState) -> list[str]:
    return [r.replica_id for r in state.views.view(MODEL).replicas()]


@pytest.fixture
async def server() -> AsyncIterator[RoutingStateServer]:
    server = RoutingStateServer(7, [replica(0), replica(1)], {0: KEYS, 1: KEYS[:1]})
    await server.start()
    yield server
    await server.stop()


@pytest.fixture
async def client(server: RoutingStateServer) -> AsyncIterator[StateClient]:
    client = StateClient(settings(server.address), FleetState(), backoff=FAST)
    await client.start()
    async with asyncio.timeout(10):
        await client.wait_ready()
    yield client
    await client.aclose()


async def test_a_snapshot_then_deltas_keep_the_state_current(
    server: RoutingStateServer, client: StateClient
) -> None:
    state = client.state
    assert ids(state) == ["r0", "r1"]
    assert state.views.view(MODEL).leading_runs(KEYS, now=None) == {0: 4, 1: 1}
    request = server.watch_requests[0]
    assert (request.proxy_id, list(request.pools)) == ("p1", ["default"])
    assert (request.have_epoch, request.have_version) == (0, 0)
    server.publish(
        routing_pb2.Delta(loads=[routing_pb2.LoadUpdate(ordinal=1, load=load(48, 0, 5.0))])
    )
    version = server.publish(routing_pb2.Delta(residency=[residency_change(1, added=KEYS[1:])]))
    async with asyncio.timeout(10):
        await client.wait_until(lambda s: s.position() == (7, version))
    assert state.views.view(MODEL).replicas()[1].load == 0.75
    assert state.views.view(MODEL).leading_runs(KEYS, now=None) == {0: 4, 1: 4}
    assert client.status()["controlplane"] == server.address


async def test_a_broken_stream_resumes_with_only_the_missed_deltas(
    server: RoutingStateServer, client: StateClient
) -> None:
    server.end_streams()
    version = server.publish(routing_pb2.Delta(replicas_upserted=[replica(2)]))
    async with asyncio.timeout(10):
        await client.wait_until(lambda s: s.position() == (7, version))
    resumed = server.watch_requests[-1]
    assert (resumed.have_epoch, resumed.have_version) == (7, version - 1)
    assert ids(client.state) == ["r0", "r1", "r2"]
    assert server.snapshots_sent == client.snapshots == 1


async def test_a_version_gap_asks_for_a_new_snapshot(
    server: RoutingStateServer, client: StateClient
) -> None:
    server.version += 1  # a delta the client never sees
    server.publish(routing_pb2.Delta(replicas_removed=[0]))
    async with asyncio.timeout(10):
        await client.wait_until(lambda s: ids(s) == ["r1"] and s.position()[1] == server.version)
    assert (server.watch_requests[-1].have_epoch, server.watch_requests[-1].have_version) == (0, 0)
    assert client.snapshots == 2
    assert "version" in client.last_error


async def test_a_dead_address_is_skipped(server: RoutingStateServer) -> None:
    dead = f"127.0.0.1:{free_port()}"
    rng = next(random.Random(s) for s in range(100) if random.Random(s).randrange(2) == 0)
    client = StateClient(settings(dead, server.address), FleetState(), backoff=FAST, rng=rng)
    await client.start()
    try:
        async with asyncio.timeout(10):
            await client.wait_ready()
        assert client.connected_to == server.address
        assert dead in client.last_error
    finally:
        await client.aclose()


async def test_a_restarted_control_plane_sends_a_new_snapshot(
    server: RoutingStateServer, client: StateClient
) -> None:
    port = int(server.address.rsplit(":", 1)[1])
    await server.stop()
    assert ids(client.state) == ["r0", "r1"]  # still routing on the last state
    restarted = RoutingStateServer(8, [replica(3)], {3: KEYS}, port=port)
    await restarted.start()
    try:
        async with asyncio.timeout(10):
            await client.wait_until(lambda s: s.position() == (8, restarted.version))
        assert ids(client.state) == ["r3"]
        assert client.state.views.view(MODEL).leading_runs(KEYS, now=None) == {3: 4}
    finally:
        await restarted.stop()


async def test_a_silent_stream_is_dropped_and_resumed(server: RoutingStateServer) -> None:
    server.silent = True
    client = StateClient(settings(server.address), FleetState(), backoff=FAST, idle_timeout_s=0.3)
    await client.start()
    try:
        async with asyncio.timeout(10):
            await server.wait_for_watches(2)
        assert server.watch_requests[1].have_epoch == 7  # resumed, not a new snapshot
        assert "idle timeout" in client.last_error
    finally:
        await client.aclose()


async def test_tls_with_the_configured_ca(tmp_path: Path) -> None:
    ca = trustme.CA()
    cert = ca.issue_cert("localhost", "127.0.0.1")
    credentials = grpc.ssl_server_credentials(
        [(cert.private_key_pem.bytes(), cert.cert_chain_pems[0].bytes())]
    )
    server = await RoutingStateServer(3, [replica(0)], credentials=credentials).start()
    ca_file = tmp_path / "ca.pem"
    ca.cert_pem.write_to_path(str(ca_file))
    client = StateClient(settings(server.address, controlplane_tls_ca=ca_file), FleetState())
    await client.start()
    try:
        async with asyncio.timeout(10):
            await client.wait_ready()
        assert ids(client.state) == ["r0"]
    finally:
        await client.aclose()
        await server.stop()


def test_backoff_grows_with_failures_within_its_cap() -> None:
    backoff, rng = Backoff(base_s=0.1, cap_s=2.0), random.Random(1)
    for failures, bound in ((0, 0.1), (3, 0.8), (10, 2.0), (1000, 2.0)):
        delays = [backoff.delay(failures, rng) for _ in range(200)]
        assert min(delays) >= 0 and max(delays) <= bound
        assert max(delays) > bound / 2  # jitter spreads over the whole range
