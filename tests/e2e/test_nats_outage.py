"""Issue 46, item 1, on real processes: ``nats-server`` killed -9 for 5 s and restarted
on its port while ``kvroute up``'s fleet (three ``kvroute-sim`` engines, their sidecars,
a control plane, a proxy) serves a steady load. No request fails, and within 2 s of
NATS's return a new system prompt's repeats are routed by the engine's KV events again
(the longer outages are ``python -m bench.faults``)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from bench.faults.nats_outage import EVENTS_BACK_TARGET_S, OutageConfig, run_outage

pytestmark = [pytest.mark.e2e, pytest.mark.integration]


def test_a_nats_outage_fails_no_request_and_events_route_again_soon_after(
    tmp_path: Path,
) -> None:
    config = OutageConfig(outage_s=5.0, rate=10.0, before_s=2.0, after_s=3.0)
    result = asyncio.run(run_outage(config, tmp_path))
    assert result.sent >= 80  # the load ran before, through and after the outage
    assert result.failed == 0, result.summary()
    assert result.events_back_s is not None, result.summary()
    assert result.events_back_s <= EVENTS_BACK_TARGET_S, result.summary()
