"""Issue 42, item 4's quick variant, on real processes: ``kvroute up``'s HA fleet (three
``kvroute-sim`` engines with their sidecars, two control planes, two proxies behind a
TCP balancer, NATS, etcd, all on 127.0.0.1) under a steady streamed load of 8 requests/s
while three faults strike in turn: the control-plane leader killed -9, an engine killed
-9 mid-stream, an engine restarted without replay (its cache lost). No request fails
but the streams cut on the killed engine, which end with a clean error event; after each
fault the residency equals the engines' caches again, key for key, within 10 s; the
proxies' predicted cached tokens match the engines' after it. About a minute; the full
run is ``kvroute bench chaos``."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from bench.chaos.run import CONVERGED_TARGET_S, ChaosConfig, run_chaos

pytestmark = [pytest.mark.e2e, pytest.mark.integration]

QUICK = ChaosConfig(
    faults=("leader", "midstream", "engine-no-replay"),
    replicas=3,
    rate=8.0,
    hold_s=3.0,
    warmup_s=2.0,
    after_s=2.0,
    converge_deadline_s=20.0,
)


def test_three_faults_fail_no_request_and_the_residency_equals_the_caches_again(
    tmp_path: Path,
) -> None:
    result = asyncio.run(run_chaos(QUICK, tmp_path))
    baseline, *faults = result.faults
    assert baseline.converged_s is not None, baseline.summary()  # the checker agrees at rest
    assert [f.name for f in faults] == list(QUICK.faults)
    for fault in faults:
        summary = fault.summary() | {"trace": fault.trace[-2:]}
        assert fault.sent >= 20, summary  # the load ran through the fault
        assert fault.failed == 0, summary
        assert fault.converged_s is not None, summary
        assert fault.converged_s <= CONVERGED_TARGET_S, summary
        assert fault.met["prediction_after"], summary
    assert faults[0].note.startswith("killed controlplane-")  # the leader, found and killed
