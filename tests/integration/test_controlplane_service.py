"""One control-plane instance on real NATS and etcd, watched over real gRPC."""

from __future__ import annotations

import asyncio
import json
import subprocess
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import grpc
import pytest

from bench.controlplane.mirror import REPORT_METHOD, StateMirror, watch
from controlplane.service import ControlPlane, CountingSink
from controlplane.settings import ControlPlaneSettings
from kvcore.pb import routing_pb2
from kvroute.servers import EtcdServer, NatsServer, free_port
from tests.integration.controlplane_harness import (
    CONTROLPLANE_BIN,
    SidecarDouble,
    server_certificate,
)
from tests.integration.sidecar_harness import wait_until


@pytest.fixture
async def control_plane(
    nats_server: NatsServer, etcd_server: EtcdServer, request: pytest.FixtureRequest
) -> AsyncIterator[ControlPlane]:
    name = request.node.name.replace("_", "-")[:40]
    settings = ControlPlaneSettings(
        nats_url=nats_server.url,
        etcd_endpoints=[etcd_server.endpoint],
        etcd_prefix=f"/{name}/",
        admin_port=0,
        grpc_port=0,
        instance_id="cp-a",
        pools=["svc"],
        heartbeat_timeout_s=1.0,
        panic_threshold=1.0,  # one replica: its silence downs it (the guard: test_fleet_liveness)
    )
    service = ControlPlane(settings)
    await service.start()
    yield service
    await service.aclose()


async def test_a_watcher_follows_the_sidecars_and_sees_drains(
    control_plane: ControlPlane, nats_server: NatsServer
) -> None:
    sidecar = await SidecarDouble(nats_server.url, "svc-r1", pool="svc").start()
    address = f"127.0.0.1:{control_plane.grpc_port}"
    mirror = StateMirror()
    watching = asyncio.create_task(watch(address, mirror, pools=("svc",)))
    try:
        await sidecar.announce()
        await sidecar.store(range(1, 501))
        await wait_until(lambda: mirror.keys_of("svc-r1") == sidecar.held)
        await sidecar.remove(range(1, 101))
        await sidecar.load(running=4)
        await wait_until(lambda: mirror.keys_of("svc-r1") == sidecar.held)
        await wait_until(lambda: any(r.load.running == 4 for r in mirror.replicas.values()))
        await wait_until(control_plane.view.is_leader)
        info = await control_plane.view.set_draining("svc-r1", True)
        assert info.status == "draining"
        await wait_until(
            lambda: (
                [r.status for r in mirror.replicas.values()]
                == [routing_pb2.REPLICA_STATUS_DRAINING]
            )
        )
        # silent past the heartbeat timeout: down, residency dropped, and the proxy sees it
        await wait_until(lambda: mirror.keys_of("svc-r1") == set(), deadline_s=5)
        assert [r.status for r in mirror.replicas.values()] == [
            routing_pb2.REPLICA_STATUS_UNHEALTHY
        ]
    finally:
        watching.cancel()
        await sidecar.stop()


async def test_the_shard_and_its_leader_are_in_etcd_and_in_snapshots(
    control_plane: ControlPlane,
) -> None:
    await wait_until(control_plane.view.is_leader)
    mirror = StateMirror()
    watching = asyncio.create_task(watch(f"127.0.0.1:{control_plane.grpc_port}", mirror))
    await wait_until(lambda: mirror.complete)
    watching.cancel()
    assert [(s.pool, s.shard, s.leader_instance) for s in mirror.shards] == [("svc", "all", "cp-a")]
    keys = control_plane.leadership.keys
    await wait_until(lambda: keys.pool_shard("svc") in control_plane.leadership._written)
    found = await control_plane.etcd.get(keys.pool_shard("svc").encode())
    assert json.loads(found.value) == {"shard": "all", "leader": "cp-a"}


async def test_an_unserved_pool_is_refused_with_a_clear_error(
    control_plane: ControlPlane,
) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await watch(f"127.0.0.1:{control_plane.grpc_port}", StateMirror(), pools=("other",))
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "other" in (caught.value.details() or "")


async def test_reports_reach_the_sink_and_malformed_ones_are_counted(
    control_plane: ControlPlane,
) -> None:
    report = routing_pb2.ProxyReport(proxy_id="p1", ts=1.0, interval_s=10.0)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{control_plane.grpc_port}") as channel:
        send = channel.stream_unary(REPORT_METHOD)
        ack = routing_pb2.ReportAck.FromString(
            await send(iter([report.SerializeToString(), b"\xff\xfe", report.SerializeToString()]))
        )
    assert ack.reports == 2
    sink = control_plane.records.reports
    assert isinstance(sink, CountingSink) and len(sink.received) == 2
    async with (
        aiohttp.ClientSession() as session,
        session.get(f"http://127.0.0.1:{control_plane.admin_port}/metrics") as response,
    ):
        text = await response.text()
    assert "kvroute_controlplane_reports_malformed_total 1.0" in text
    assert "kvroute_controlplane_reports_failed_total 0.0" in text
    assert "kvroute_controlplane_leader" in text


async def test_grpc_serves_tls_when_given_a_certificate(
    nats_server: NatsServer, etcd_server: EtcdServer, tmp_path: Path
) -> None:
    ca, cert, key = server_certificate(tmp_path, "127.0.0.1")
    settings = ControlPlaneSettings(
        nats_url=nats_server.url,
        etcd_endpoints=[etcd_server.endpoint],
        etcd_prefix="/grpc-tls/",
        admin_port=0,
        grpc_port=0,
        grpc_tls_cert=cert,
        grpc_tls_key=key,
    )
    service = ControlPlane(settings)
    await service.start()
    address = f"127.0.0.1:{service.grpc_port}"
    try:
        mirror = StateMirror()
        credentials = grpc.ssl_channel_credentials(ca.cert_pem.bytes())
        watching = asyncio.create_task(watch(address, mirror, credentials=credentials))
        await wait_until(lambda: mirror.complete)
        watching.cancel()
        with pytest.raises(grpc.aio.AioRpcError):  # plaintext is refused
            async with asyncio.timeout(5):
                await watch(address, StateMirror())
    finally:
        await service.aclose()


async def test_many_watchers_and_a_slow_one_dropped_without_stalling_them(
    nats_server: NatsServer, etcd_server: EtcdServer
) -> None:
    settings = ControlPlaneSettings(
        nats_url=nats_server.url,
        etcd_endpoints=[etcd_server.endpoint],
        etcd_prefix="/many-watchers/",
        admin_port=0,
        grpc_port=0,
        watcher_queue=4,
    )
    service = ControlPlane(settings)
    await service.start()
    address = f"127.0.0.1:{service.grpc_port}"
    sidecar = await SidecarDouble(nats_server.url, "mw-r1").start()
    mirrors = [StateMirror() for _ in range(12)]
    tasks = [asyncio.create_task(watch(address, m)) for m in mirrors]
    # a proxy that never reads: no BDP probing, so its HTTP/2 window stays at 64 KiB
    slow_channel = grpc.aio.insecure_channel(address, options=[("grpc.http2.bdp_probe", 0)])
    slow = slow_channel.unary_stream(
        "/kvroute.v1.RoutingState/Watch",
        request_serializer=routing_pb2.WatchRequest.SerializeToString,
        response_deserializer=routing_pb2.StateUpdate.FromString,
    )(routing_pb2.WatchRequest(proxy_id="slow"))
    try:
        await wait_until(lambda: all(m.complete for m in mirrors))
        await sidecar.announce()
        for n in range(20):  # one version each, 40 KB of keys in each
            await sidecar.store(range(n * 5000 + 1, n * 5000 + 5001))
            await wait_until(lambda: all(m.keys_of("mw-r1") == sidecar.held for m in mirrors))
        assert service.broadcaster is not None
        await wait_until(lambda: service.broadcaster.stats.watchers_dropped == 1)  # type: ignore[union-attr]
        assert len(service.broadcaster.watchers) == len(mirrors)
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            async with asyncio.timeout(10):
                async for _ in slow:
                    pass
        assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    finally:
        for task in tasks:
            task.cancel()
        await slow_channel.close()
        await sidecar.stop()
        await service.aclose()


def test_an_unreachable_etcd_is_one_line_and_exit_status_1(nats_server: NatsServer) -> None:
    port = free_port()
    done = subprocess.run(
        [
            str(CONTROLPLANE_BIN),
            *("--nats-url", nats_server.url, "--etcd-endpoints", f"127.0.0.1:{port}"),
            *("--admin-port", "0", "--grpc-port", "0"),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 1
    assert done.stdout == ""
    assert done.stderr.splitlines()[-1] == (
        f"kvroute-controlplane: etcd at 127.0.0.1:{port} did not answer (ConnectionFailedError)"
    )
