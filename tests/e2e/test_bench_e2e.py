"""``kvroute bench e2e --quick``: the whole stack beside round-robin, measured from outside.

Real processes (simulated engines, their sidecars, NATS, etcd, the control plane and the
proxy) serve the same shared-prefix requests twice, switched between ``round_robin`` and
``kv_aware`` through the admin API. What must hold whatever the machine's load: no request
is lost, and ``kv_aware`` beats round-robin on the engines' own hit rate and on the
client-measured time to first token.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e

KVROUTE = str(Path(sys.executable).parent / "kvroute")


def test_quick_e2e_bench_shows_kv_aware_ahead_and_loses_nothing(tmp_path: Path) -> None:
    out = tmp_path / "e2e"
    result = subprocess.run(
        [KVROUTE, "bench", "e2e", "--quick", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=420,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = json.loads((out / "e2e.json").read_text())
    rows = {row["contender"]: row for row in report["results"]}
    rr, kv = rows["kvroute round_robin"], rows["kvroute kv_aware"]
    expected = (
        report["config"]["workload"]["groups"] * report["config"]["workload"]["prompts_per_group"]
    )
    for row in (rr, kv):
        assert row["requests"] == expected and row["errors"] == 0, row
    assert kv["engine_hit_rate"] > rr["engine_hit_rate"] + 0.15, (kv, rr)
    assert kv["ttft_p50_s"] < rr["ttft_p50_s"], (kv, rr)
    assert (out / "e2e.md").exists() and (out / "e2e_ttft_cdf.png").stat().st_size > 0
