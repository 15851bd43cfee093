"""``kvroute bench e2e --proxies``: the chat workload, smg's mesh flags and the curve's report."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

from bench.e2e import curve
from bench.e2e.__main__ import build_parser
from bench.e2e.chat import ChatWorkload
from bench.e2e.harness import CHAT, SHARED, Contender, ContenderResult, E2EConfig
from bench.e2e.peers import SMG, mesh_argv
from kvroute.demo import PhaseResult


def test_each_turn_of_a_conversation_extends_the_last_and_conversations_differ() -> None:
    workload = ChatWorkload(conversations=3, turns=4)
    conversations = workload.conversation_turns("m")
    assert [len(turns) for turns in conversations] == [4, 4, 4]
    for turns in conversations:
        for before, after in itertools.pairwise(turns):
            assert after["messages"][: len(before["messages"])] == before["messages"]
            assert len(after["messages"]) == len(before["messages"]) + 2
    openings = {turns[0]["messages"][1]["content"] for turns in conversations}
    assert len(openings) == 3
    assert {turns[0]["messages"][0]["content"] for turns in conversations} == {
        conversations[0][0]["messages"][0]["content"]
    }  # one system prompt shared by all
    assert workload.request_groups() == [0] * 4 + [1] * 4 + [2] * 4


def test_smg_runs_offline_on_loopback_and_each_instance_joins_every_other() -> None:
    argv = SMG.argv(9000, ["http://127.0.0.1:1"], "cache_aware", 9001)
    assert argv[1] == "launch"
    assert argv[argv.index("--host") + 1] == "127.0.0.1"
    assert argv[argv.index("--prometheus-host") + 1] == "127.0.0.1"
    tokenizer = argv[argv.index("--tokenizer-path") + 1]
    assert (Path(tokenizer) / "tokenizer.json").is_file()
    mesh = mesh_argv("smg-1", 7002, [7001, 7003])
    assert mesh[mesh.index("--mesh-host") + 1] == "127.0.0.1"
    assert mesh[mesh.index("--mesh-port") + 1] == "7002"
    assert mesh[mesh.index("--mesh-peer-urls") + 1 :] == ["127.0.0.1:7001", "127.0.0.1:7003"]


def test_the_full_run_has_smg_alone_and_four_with_the_mesh() -> None:
    names = [c.name for c in E2EConfig().contenders()]
    assert {"smg round_robin", "smg cache_aware", "smg cache_aware x4 mesh"} <= set(names)
    assert "sglang-router cache_aware x4" in names and "vllm-router cache_aware" in names


def test_the_curve_runs_every_count_on_both_workloads_and_smg_with_and_without_mesh() -> None:
    config = E2EConfig(proxies=(1, 2, 8), curve_policies=("kv_cost",))
    contenders = config.contenders()
    assert config.kvroute_proxies() == 8
    for workload in (CHAT, SHARED):
        ours = [c.instances for c in contenders if c.workload == workload and c.router == "kvroute"]
        assert ours == [1, 2, 8]
        smg = {
            (c.instances, c.mesh)
            for c in contenders
            if c.workload == workload and c.router == "smg"
        }
        assert smg == {(1, False), (2, True), (2, False), (8, True), (8, False)}
    assert config.expected_requests(Contender("smg", "cache_aware", workload=CHAT)) == 240


def test_proxies_flag_takes_sorted_counts_and_refuses_zero() -> None:
    assert build_parser().parse_args(["--proxies", "4,1,2"]).proxies == (1, 2, 4)
    for bad in ("0,2", "two"):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["--proxies", bad])


def _result(instances: int, hits: int, served: list[int], mesh: bool = False) -> ContenderResult:
    phase = PhaseResult("x", ttft_s=[0.05] * 10, engine_queries=1000, engine_hits=hits)
    return ContenderResult(
        Contender("kvroute", "kv_cost", instances, mesh, CHAT), phase, served=served
    )


def test_the_curve_compares_each_count_with_one_router_and_flags_an_idle_replica() -> None:
    results = [_result(1, 800, [60, 60, 60, 60]), _result(8, 600, [0, 80, 80, 80])]
    points = curve.series(results, CHAT)["kvroute kv_cost"]
    assert curve.hit_ratio(points, points[1]) == pytest.approx(0.75)
    assert points[1].spread == pytest.approx(80 / 60)
    assert curve.goals(points) == (False, False)
    report = curve.markdown(E2EConfig(proxies=(1, 8)), results, "load average 0.5")
    assert "| kvroute kv_cost | 8 | 60.0% | 75.0% |" in report and "0/80/80/80" in report
    assert "hit rate **MISSED**, requests spread **MISSED**" in report


def test_smg_alone_opens_both_its_series() -> None:
    alone = ContenderResult(
        Contender("smg", "cache_aware", 1, workload=SHARED),
        PhaseResult("x", ttft_s=[0.1]),
        served=[1],
    )
    found = curve.series([alone], SHARED)
    assert set(found) == {"smg cache_aware (mesh)", "smg cache_aware (no mesh)"}
