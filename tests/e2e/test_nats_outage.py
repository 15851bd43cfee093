"""Issue 46, item 1, on real processes: ``nats-server`` killed -9 for 5 s and restarted
on its port while ``kvroute up``'s fleet (three ``kvroute-sim`` engines, their sidecars,
a control plane, a proxy) serves a steady load. No request fails, and within 2 s of
NATS's return a new system prompt's repeats are routed by the engine's KV events again
(the longer outages are ``python -m bench.faults``). The same when only the control
plane loses NATS, its link cut while the sidecars keep theirs, and it downs no replica."""

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


def test_a_control_plane_cut_from_nats_downs_no_replica_and_fails_no_request(
    tmp_path: Path,
) -> None:
    """The control plane's own link to NATS falls silent for 4 s (a partition: no reset,
    no bytes) while the sidecars keep theirs. Its replicas fall silent past its heartbeat
    timeout (2 s) and must be kept, stale, not downed: with the panic threshold off, only
    its knowing that its own link is dead keeps them (a control plane that could not tell
    downed all three, and the proxy answered 503)."""
    config = OutageConfig(
        outage_s=4.0,
        rate=10.0,
        before_s=2.0,
        after_s=3.0,
        cut="controlplane",
        controlplane_flags=("--heartbeat-timeout-s", "2", "--panic-threshold", "1"),
    )
    result = asyncio.run(run_outage(config, tmp_path))
    assert result.sent >= 70, result.summary()  # the load ran before, through and after
    assert result.stale_seen == 3, result.summary()  # silent past the timeout: kept stale
    assert result.down_seen == 0, result.summary()
    assert result.failed == 0, result.summary()
    assert result.events_back_s is not None, result.summary()
    assert result.events_back_s <= EVENTS_BACK_TARGET_S, result.summary()
