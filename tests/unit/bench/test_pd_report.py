"""``kvroute bench pd`` / ``bench e2e --pd``: the peers' P/D command lines and the report."""

from __future__ import annotations

import argparse

from bench.pd import PD_PEERS, PdPeer, markdown
from kvroute.demo import Answer, DemoWorkload

PREFILLS = ["http://127.0.0.1:9001", "http://127.0.0.1:9002"]
DECODES = ["http://127.0.0.1:9003"]


def peer(protocol: str) -> PdPeer:
    return next(p for p in PD_PEERS if p.protocol == protocol)


def test_smg_is_given_each_prefill_with_its_bootstrap_port_and_the_decodes() -> None:
    argv = peer("sglang").argv(8000, PREFILLS, DECODES)
    assert argv[1] == "launch" and "--pd-disaggregation" in argv
    at = argv.index("--prefill")
    assert argv[at : at + 6] == [
        "--prefill", PREFILLS[0], "9001", "--prefill", PREFILLS[1], "9002",
    ]  # fmt: skip
    assert argv[argv.index("--decode") + 1] == DECODES[0]
    assert argv[argv.index("--host") + 1] == "127.0.0.1"  # never beyond loopback


def test_vllm_router_runs_vllms_pd_mode_without_bootstrap_ports() -> None:
    argv = peer("vllm").argv(8000, PREFILLS, DECODES)
    assert "--vllm-pd-disaggregation" in argv and "--pd-disaggregation" not in argv
    at = argv.index("--prefill")
    assert argv[at : at + 4] == ["--prefill", PREFILLS[0], "--prefill", PREFILLS[1]]


def test_inter_token_latency_is_the_mean_gap_after_the_first_token() -> None:
    answer = Answer(0, 0.0, 0.100, 10, 0, "?", completion_tokens=5, last_token_s=0.140)
    assert answer.itl_s is not None and abs(answer.itl_s - 0.010) < 1e-9
    assert Answer(0, 0.0, 0.1, 10, 0, "?", completion_tokens=1, last_token_s=0.1).itl_s is None


def test_a_peer_that_could_not_run_is_reported_with_its_reason() -> None:
    rows = [
        {"fleet": "P/D 2:2", "router": "kvroute", "strategy": "kv_cost", "requests": 4,
         "errors": 0, "hit_rate": 0.5, "ttft_mean_s": 0.1, "ttft_p90_s": 0.2,
         "itl_mean_s": 0.01, "itl_p90_s": 0.012, "requests_per_s": 2.0,
         "output_tokens_per_s": 64.0},
        {"fleet": "P/D 2:2", "router": "smg 1.13.0", "strategy": "cache_aware",
         "not_run": "it speaks SGLang's protocol only"},
    ]  # fmt: skip
    args = argparse.Namespace(event_format="vllm", time_scale=1.0, load="1.0")
    text = markdown(rows, DemoWorkload(groups=2, prompts_per_group=2), args)
    assert "| P/D 2:2 | kvroute | kv_cost | 4 | 0 | 50.0% | 100.0 ms | 200.0 ms | 10.0 ms |" in text
    assert "not run: it speaks SGLang's protocol only" in text
