"""Records wired into the real ControlPlane service: what an operator writes through the
admin port reaches a proxy's gRPC watch, drains reach the fleet, and proxies' reports
through gRPC Report become stats, and the prefill rates a proxy learned show in
``/v1/replicas``."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import grpc
import pytest

from bench.controlplane.mirror import REPORT_METHOD, StateMirror, watch
from controlplane.records import Records
from controlplane.service import ControlPlane
from controlplane.settings import ControlPlaneSettings
from dataplane.reporter import Reporter
from dataplane.settings import ProxySettings
from kvcore.pb import routing_pb2
from kvroute.servers import EtcdServer, NatsServer
from tests.integration.controlplane.records.conftest import ADMIN_TOKEN, AdminClient
from tests.integration.controlplane.records.test_database_and_reports import report
from tests.integration.controlplane_harness import SidecarDouble
from tests.integration.sidecar_harness import wait_until
from tests.unit.dataplane.test_prefill_books import Clock, fleet, time_r1_at_2000

pytestmark = pytest.mark.integration


@pytest.fixture
async def service(
    nats_server: NatsServer, etcd_server: EtcdServer, etcd_prefix: str, tmp_path: Path
) -> AsyncIterator[ControlPlane]:
    settings = ControlPlaneSettings(
        nats_url=nats_server.url,
        etcd_endpoints=[etcd_server.endpoint],
        etcd_prefix=etcd_prefix,
        database_url=f"sqlite+aiosqlite:///{tmp_path / 'records.db'}",
        admin_token=ADMIN_TOKEN,
        admin_port=0,
        grpc_port=0,
        instance_id="cp-a",
        pools=["wired"],
        rollup_interval_s=600,  # rolled up by the test
    )
    control_plane = ControlPlane(settings, records=Records)
    await control_plane.start()
    yield control_plane
    await control_plane.aclose()


async def test_admin_writes_reach_watchers_drains_reach_the_fleet_reports_become_stats(
    service: ControlPlane, nats_server: NatsServer
) -> None:
    sidecar = await SidecarDouble(nats_server.url, "wired-r1", pool="wired").start()
    mirror = StateMirror()
    watching = asyncio.create_task(
        watch(f"127.0.0.1:{service.grpc_port}", mirror, pools=("wired",))
    )
    try:
        async with aiohttp.ClientSession() as http:
            admin = AdminClient(http, f"http://127.0.0.1:{service.admin_port}", ADMIN_TOKEN)
            await wait_until(lambda: any(w.name == "default" for w in mirror.config.workloads))
            status, _, _ = await admin.call(
                "PUT", "/v1/workloads/chat", json={"strategy": "session_affinity"}
            )
            assert status == 201
            await wait_until(lambda: any(w.name == "chat" for w in mirror.config.workloads))

            await sidecar.announce()
            await wait_until(lambda: len(mirror.replicas) == 1)
            await wait_until(service.view.is_leader)
            status, body, _ = await admin.call("POST", "/v1/replicas/wired-r1/drain")
            assert status == 200 and body["draining"] is True
            await wait_until(
                lambda: (
                    [r.status for r in mirror.replicas.values()]
                    == [routing_pb2.REPLICA_STATUS_DRAINING]
                )
            )

            async with grpc.aio.insecure_channel(f"127.0.0.1:{service.grpc_port}") as channel:
                send = channel.stream_unary(
                    REPORT_METHOD,
                    request_serializer=routing_pb2.ProxyReport.SerializeToString,
                    response_deserializer=routing_pb2.ReportAck.FromString,
                )
                sent = report("proxy-1", time.time(), ("chat", "wired-r1", 7, 700, 350))
                await send(iter([sent]))

            # the report was stored before it was acknowledged; the leader rolls it up
            records = service.records
            assert isinstance(records, Records)
            assert await records.reports.rollup() == 1
            _, stats, _ = await admin.call("GET", "/v1/workloads/chat/stats?minutes=5")
            assert stats["total"]["requests"] == 7
            assert stats["total"]["measured_hit_rate"] == pytest.approx(0.5)
    finally:
        watching.cancel()
        await sidecar.stop()


async def test_the_prefill_rate_a_proxy_learned_shows_in_the_replicas_list(
    service: ControlPlane, nats_server: NatsServer
) -> None:
    """A kv_cost proxy's books time r1 at 2,000 tokens/s plus 20 ms (r0 untimed); its
    real Reporter sends the next report over gRPC, and ``GET /v1/replicas`` shows r1's
    learned figures and ``null`` for r0."""
    sidecars = [await SidecarDouble(nats_server.url, f"r{i}", pool="wired").start() for i in (0, 1)]
    try:
        for sidecar in sidecars:
            await sidecar.announce()
        await wait_until(lambda: len(service.view.replicas("wired")) == 2)
        clock = Clock()
        proxy_state = fleet(clock)  # r0 and r1, as the control plane streams them
        time_r1_at_2000(proxy_state, clock)
        proxy = ProxySettings(controlplane=[f"127.0.0.1:{service.grpc_port}"], proxy_id="p1")
        reporter = Reporter(proxy, rates=proxy_state.inflight.learned_rates)
        reporter.close_interval()
        await reporter.flush()
        assert reporter.sent == 1, reporter.last_error
        async with aiohttp.ClientSession() as http:
            admin = AdminClient(http, f"http://127.0.0.1:{service.admin_port}", ADMIN_TOKEN)
            status, body, _ = await admin.call("GET", "/v1/replicas?pool=wired")
        assert status == 200
        learned = {r["replica_id"]: r["learned"] for r in body["replicas"]}
        assert learned["r0"] is None
        r1 = learned["r1"]
        assert r1["proxies"] == 1
        assert r1["prefill_tokens_per_s"] == pytest.approx(2_000, rel=0.01)
        assert r1["line_tokens_per_s"] == pytest.approx(2_000, rel=0.01)
        assert r1["line_fixed_s"] == pytest.approx(0.02, abs=0.001)
    finally:
        for sidecar in sidecars:
            await sidecar.stop()
