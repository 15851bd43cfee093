"""``kvroute bench sim``'s adapters scenario: LoRA adapters in slots per replica, routed by
kvroute's adapter rule, by loading on every miss, and round-robin."""

from __future__ import annotations

import json
from pathlib import Path

from bench.sim.lora import AdapterSlots
from kvroute.cli import main


def test_kvroute_loads_fewer_adapters_and_answers_sooner(tmp_path: Path, capsys) -> None:
    argv = ["bench", "sim", "--quick", "--no-plots", "--out", str(tmp_path)]
    assert main([*argv, "--scenario", "adapters"]) == 0, capsys.readouterr().err
    (scenario,) = json.loads((tmp_path / "report.json").read_text())["scenarios"]
    runs = {r["policy"]: r for r in scenario["runs"]}
    assert set(runs) == {"lora:kv_cost", "lora-miss:kv_cost", "lora-miss:round_robin"}
    for run in runs.values():
        assert run["lost"] == 0 and run["completed"] == run["requests"] > 0
    ours = runs["lora:kv_cost"]
    for other in (runs["lora-miss:kv_cost"], runs["lora-miss:round_robin"]):
        assert ours["adapter_loads_per_min"] < other["adapter_loads_per_min"]
        assert ours["ttft_mean_s"] < other["ttft_mean_s"]
    # 80/s on the 4 replicas of --quick saturates the fleet: spreading a hot adapter
    # early costs its prefix once per new holder, half a point of hit rate at most
    assert ours["hit_rate"] >= runs["lora-miss:kv_cost"]["hit_rate"] - 0.01
    assert ours["hit_rate"] > runs["lora-miss:round_robin"]["hit_rate"]


def test_a_replica_keeps_its_bound_and_a_load_delays_its_request() -> None:
    slots = AdapterSlots(replicas=2, adapters=4, per_replica=2, load_s=0.5)
    assert slots.holders(0) == {0} and slots.holders(3) == {1}
    assert slots.use(0, 0, now=1.0) == 1.0  # loaded since the start
    assert slots.use(0, 1, now=1.0) == 1.5 and slots.loads == 1  # 2 was least recently used
    assert slots.holders(2) == set() and slots.use(0, 1, now=1.2) == 1.5  # its load is under way
