"""``kvroute bench sim``'s P/D scenarios: prefill and decode pools routed in pairs."""

from __future__ import annotations

import json
import math
from pathlib import Path

from kvroute.cli import main


def test_pd_pairs_find_the_prefill_cache_round_robin_loses(tmp_path: Path, capsys) -> None:
    argv = ["bench", "sim", "--quick", "--no-plots", "--out", str(tmp_path)]
    assert main([*argv, "--scenario", "pd_shared_prefix"]) == 0, capsys.readouterr().err
    report = json.loads((tmp_path / "report.json").read_text())
    (scenario,) = report["scenarios"]
    runs = {r["policy"]: r for r in scenario["runs"]}
    assert set(runs) == {"pd:round_robin", "pd:kv_cost", "smg-pd:cache_aware", "kv_cost"}
    for run in runs.values():
        assert run["lost"] == 0 and run["completed"] == run["requests"] > 0
        assert run["hit_rate"] <= run["oracle_hit_rate"] + 1e-9
        assert run["itl_mean_s"] > 0 and math.isfinite(run["ttft_mean_s"])
    ours, rr = runs["pd:kv_cost"], runs["pd:round_robin"]
    assert ours["hit_rate"] > rr["hit_rate"]  # the prefill side's hit rate
    assert ours["ttft_mean_s"] < rr["ttft_mean_s"]
    assert "| `pd:kv_cost` |" in (tmp_path / "report.md").read_text()


def test_a_pd_spec_naming_no_kvroute_strategy_is_refused(tmp_path: Path, capsys) -> None:
    argv = ["bench", "sim", "--quick", "--no-plots", "--out", str(tmp_path)]
    argv += ["--scenario", "pd_shared_prefix", "--policy", "pd:nginx"]
    assert main(argv) == 2
    assert "'nginx' is not a kvroute strategy" in capsys.readouterr().err
