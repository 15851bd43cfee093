"""A workload whose measured hit rate drops opens an alert; the webhook receives it once
(the leader evaluates, the standby does not); recovery closes it."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest
from aiohttp import web

from tests.integration.controlplane.records.conftest import (
    InTestFleet,
    RecordsFactory,
    admin_client,
)
from tests.integration.controlplane.records.test_database_and_reports import report

pytestmark = pytest.mark.integration


class Webhook:
    """A tiny HTTP server on 127.0.0.1 that keeps what is POSTed to it."""

    def __init__(self) -> None:
        self.received: list[dict[str, Any]] = []
        self.arrived = asyncio.Event()
        self.url = ""

    async def handle(self, request: web.Request) -> web.Response:
        self.received.append(await request.json())
        self.arrived.set()
        return web.Response(status=204)

    async def next(self) -> dict[str, Any]:
        await asyncio.wait_for(self.arrived.wait(), timeout=15)
        self.arrived.clear()
        return self.received[-1]


@pytest.fixture
async def webhook() -> AsyncIterator[Webhook]:
    hook = Webhook()
    app = web.Application()
    app.router.add_post("/alerts", hook.handle)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    hook.url = f"http://127.0.0.1:{port}/alerts"
    yield hook
    await runner.cleanup()


async def test_a_hit_rate_drop_opens_an_alert_the_webhook_receives_and_recovery_closes_it(
    make_records: RecordsFactory, webhook: Webhook
) -> None:
    settings = {
        "alert_webhook_url": webhook.url,
        "alert_min_requests": 50,
        "rollup_interval_s": 0.1,
        "alert_interval_s": 0.1,
    }
    leader = await make_records(InTestFleet(leader=True), **settings)
    standby = await make_records(InTestFleet(leader=False), **settings)
    now = time.time()
    # yesterday's traffic: 80% of prompt tokens cached (reported to the standby)
    await standby.reports.record(report("p1", now - 3 * 3600, ("chat", "r0", 100, 10_000, 8_000)))
    await standby.reports.record(report("p1", now - 2 * 3600, ("chat", "r1", 100, 10_000, 8_000)))
    # now: someone put a timestamp in front of the system prompt
    await leader.reports.record(report("p2", now - 60, ("chat", "r0", 60, 6_000, 600)))

    opened = await webhook.next()
    assert opened["event"] == "alert_open"
    alert = opened["alert"]
    assert (alert["workload"], alert["state"]) == ("chat", "open")
    assert alert["measured_hit_rate"] == pytest.approx(0.1)
    assert alert["baseline_hit_rate"] == pytest.approx(0.8)

    # the prompt is fixed: the window's hit rate is back above 70% of the baseline
    await standby.reports.record(report("p2", now - 30, ("chat", "r1", 600, 60_000, 54_000)))
    closed = await webhook.next()
    assert closed["event"] == "alert_closed" and closed["alert"]["id"] == alert["id"]
    assert len(webhook.received) == 2  # once per change, from the leader only

    async with admin_client(standby) as admin:
        status, body, _ = await admin.call("GET", "/v1/alerts")
        assert status == 200
        assert [(a["workload"], a["state"]) for a in body["alerts"]] == [("chat", "closed")]
        status, body, _ = await admin.call("GET", "/v1/audit")
        actions = [e["action"] for e in body["entries"] if e["actor"] == "alerts"]
        assert actions == ["alert_closed", "alert_open"]
        status, stats, _ = await admin.call("GET", "/v1/workloads/chat/stats?minutes=5")
        assert stats["total"]["requests"] == 660
        assert stats["total"]["measured_hit_rate"] == pytest.approx(54_600 / 66_000)
    changes = leader.metrics.alert_changes
    assert changes.labels("hit_rate", "open")._value.get() == 1
    assert changes.labels("hit_rate", "closed")._value.get() == 1
    assert leader.metrics.alerts_open.labels("chat", "hit_rate")._value.get() == 0
