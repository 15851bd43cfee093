"""The proxy's Report sender against a real grpc.aio RoutingState server."""

from __future__ import annotations

import asyncio
import time
from collections import Counter

import grpc
import pytest

from dataplane.reporter import COUNTERS, Reporter
from dataplane.settings import ProxySettings
from dataplane.state_client import CHANNEL_OPTIONS
from kvcore.pb import routing_pb2
from kvroute.servers import free_port
from tests.integration.routing_state_server import RoutingStateServer

pytestmark = pytest.mark.integration


def settings(*addresses: str, interval: float = 10.0) -> ProxySettings:
    return ProxySettings(controlplane=list(addresses), proxy_id="p1", report_interval_s=interval)


def totals(reports: list[routing_pb2.ProxyReport]) -> dict[tuple[str, str, str], Counter[str]]:
    out: dict[tuple[str, str, str], Counter[str]] = {}
    for report in reports:
        for row in report.rows:
            counter = out.setdefault((row.workload, row.pool, row.replica_id), Counter())
            counter.update({name: getattr(row.counters, name) for name in COUNTERS})
    return out


def mismatch() -> list[routing_pb2.ModelHealth]:
    return [routing_pb2.ModelHealth(model="m", tokenizer_mismatch=True, detail="ids differ")]


async def test_counters_reach_the_control_plane_every_interval() -> None:
    server = await RoutingStateServer(1).start()
    reporter = Reporter(settings(server.address, interval=0.05), health=mismatch)
    reporter.record("chat", "default", "r0", 100, 64, 48, error=False)
    reporter.record("chat", "default", "r0", 50, 32, None, error=False)
    reporter.record("batch", "default", "r1", 10, 0, 0, error=True)
    await reporter.start()
    try:
        async with asyncio.timeout(10):
            await server.wait_for_reports(1)
        report = server.reports[0]
        assert report.proxy_id == "p1" and 0 < report.interval_s < 5
        assert abs(report.ts - time.time()) < 5
        assert [(m.model, m.tokenizer_mismatch) for m in report.models] == [("m", True)]
        assert totals([report]) == {
            ("chat", "default", "r0"): Counter(
                requests=2,
                prompt_tokens=150,
                predicted_cached_tokens=96,
                measured_cached_tokens=48,
                measured_requests=1,
            ),
            ("batch", "default", "r1"): Counter(
                requests=1, prompt_tokens=10, measured_requests=1, errors=1
            ),  # it reported 0 cached tokens: a measurement
        }
    finally:
        await reporter.aclose()
        await server.stop()


async def test_nothing_is_lost_while_the_control_plane_is_down() -> None:
    port = free_port()
    reporter = Reporter(settings(f"127.0.0.1:{port}"), max_pending=3, send_timeout_s=1.0)
    for interval in range(8):  # 8 intervals while nobody listens
        started = time.perf_counter()
        for _ in range(100):
            reporter.record("chat", "default", f"r{interval % 2}", 10, 5, 4, error=False)
        assert time.perf_counter() - started < 0.05  # recording never waits
        reporter.close_interval()
        await reporter.flush()
    assert len(reporter.pending) == 3  # bounded: the oldest merged
    assert reporter.failures == 8 and "UNAVAILABLE" in reporter.last_error
    server = await RoutingStateServer(1, port=port).start()
    try:
        await reporter.flush()
        assert not reporter.pending
        assert totals(server.reports) == {
            ("chat", "default", f"r{r}"): Counter(
                requests=400,
                prompt_tokens=4000,
                predicted_cached_tokens=2000,
                measured_cached_tokens=1600,
                measured_requests=400,
            )
            for r in (0, 1)
        }
        assert sum(r.interval_s for r in server.reports) > 0
    finally:
        await reporter.aclose()
        await server.stop()


async def test_a_control_plane_back_gets_the_report_while_another_channel_waits_on_it() -> None:
    """Another channel to the same address (the proxy's Watch) failed and waits out gRPC's
    reconnect backoff: the report sent once the control plane is back still arrives (with
    gRPC's process-wide connection pool it took that connection over and failed at once)."""
    address = f"127.0.0.1:{free_port()}"
    reporter = Reporter(settings(address), send_timeout_s=2.0)
    watch = grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)
    with pytest.raises(grpc.aio.AioRpcError):
        await watch.unary_unary("/kvroute.RoutingState/Nothing")(b"", timeout=2.0)
    reporter.record("chat", "default", "r0", 10, 5, 4, error=False)
    reporter.close_interval()
    server = await RoutingStateServer(1, port=int(address.rsplit(":", 1)[1])).start()
    try:
        await reporter.flush()
        assert not reporter.pending and reporter.failures == 0, reporter.last_error
        assert totals(server.reports)[("chat", "default", "r0")]["requests"] == 1
    finally:
        await watch.close()
        await reporter.aclose()
        await server.stop()


async def test_closing_sends_what_was_counted_since_the_last_report() -> None:
    server = await RoutingStateServer(1).start()
    reporter = Reporter(settings(server.address))
    await reporter.start()
    reporter.record("default", "default", "r0", 7, 0, None, error=False)
    await reporter.aclose()
    try:
        assert totals(server.reports) == {
            ("default", "default", "r0"): Counter(requests=1, prompt_tokens=7)
        }
    finally:
        await server.stop()


async def test_hot_prefixes_reach_every_control_plane_the_counters_one() -> None:
    servers = [await RoutingStateServer(1).start() for _ in range(2)]
    hot = routing_pb2.HotPrefix(
        workload="chat", model="m", token_ids=list(range(32)), key=7, block_size=16
    )
    reporter = Reporter(settings(*(s.address for s in servers)), hot=lambda: [hot])
    reporter.record("chat", "default", "r0", 100, 64, 48, error=False)
    reporter.close_interval()
    try:
        await reporter.flush()
        async with asyncio.timeout(10):
            for server in servers:
                await server.wait_for_reports(1)
        got = [report for server in servers for report in server.reports]
        assert sum(len(report.rows) for report in got) == 1  # counted once
        assert [list(r.hot_prefixes) for r in got] == [[hot], [hot]]
    finally:
        await reporter.aclose()
        for server in servers:
            await server.stop()
