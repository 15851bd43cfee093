"""The demo shows the router's prediction beside the engines' figures: the proxy's own
counters, read from its ``/metrics`` over the phase."""

from __future__ import annotations

import aiohttp
from aiohttp import web

from dataplane.metrics import ProxyMetrics
from kvroute.demo import PhaseResult, comparison_table, router_belief


async def test_the_prediction_is_the_proxys_counters_summed_over_the_phase() -> None:
    metrics = ProxyMetrics()

    async def scrape(_: web.Request) -> web.Response:
        return web.Response(body=metrics.render(), content_type="text/plain")

    app = web.Application()
    app.router.add_get("/metrics", scrape)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    try:
        async with aiohttp.ClientSession() as session:
            metrics.fidelity("chat", "r0", 1000, 900, 880)  # before the phase: not counted
            before = await router_belief(session, f"http://127.0.0.1:{port}")
            metrics.fidelity("chat", "r0", 1000, 800, 800)
            metrics.fidelity("batch", "r1", 3000, 0, None)  # the engine did not say
            after = await router_belief(session, f"http://127.0.0.1:{port}")
    finally:
        await runner.cleanup()
    result = PhaseResult("kv_aware")
    result.router_prompt_tokens = after[0] - before[0]
    result.router_predicted_tokens = after[1] - before[1]
    assert result.predicted_hit_rate == 800 / 4000
    assert result.summary()["router_predicted_share"] == 0.2
    silent = PhaseResult("round_robin")  # a router with no such counters
    assert silent.predicted_hit_rate is None and silent.summary()["router_predicted_share"] is None
    table = comparison_table([silent, result])
    labels = [str(cell) for cell in table.columns[0].cells]
    row = labels.index("cached tokens predicted (the router's counters)")
    assert [str(list(table.columns[i].cells)[row]) for i in (1, 2)] == ["-", "20.0%"]
