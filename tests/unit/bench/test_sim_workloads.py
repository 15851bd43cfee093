"""Workload streams and the peers' models: the properties the reports rely on."""

from __future__ import annotations

import json
from pathlib import Path

from bench.sim.engine import EngineShape
from bench.sim.peers import SGLANG, CacheAwareRouter
from bench.sim.simulator import FleetReadout
from bench.sim.workloads import (
    MooncakeTrace,
    MultiTurn,
    Rag,
    Request,
    SharedPrefix,
    oracle_hit_rate,
)


def test_shared_prefix_groups_share_exactly_their_system_prompt() -> None:
    reqs = list(
        SharedPrefix(groups=3, prompts_per_group=4, system_tokens=64, question_tokens=32).arrivals()
    )
    assert len(reqs) == 12 and all(len(r.keys) == 6 for r in reqs)
    heads = {tuple(r.keys[:4]) for r in reqs}
    assert len(heads) == 3  # one system prompt per group
    assert len({r.keys[4] for r in reqs}) == 12  # questions never match
    assert [r.arrival for r in reqs] == sorted(r.arrival for r in reqs)


def test_mooncake_replay_equal_hash_ids_give_equal_keys(tmp_path: Path) -> None:
    trace = tmp_path / "trace.jsonl"
    rows = [
        {"timestamp": 0, "input_length": 1024, "output_length": 10, "hash_ids": [0, 1]},
        {"timestamp": 500, "input_length": 700, "output_length": 10, "hash_ids": [0, 2]},
    ]
    trace.write_text("".join(json.dumps(r) + "\n" for r in rows))
    first, second = MooncakeTrace(path=trace, speedup=2.0).arrivals()
    assert len(first.keys) == 64 and len(second.keys) == 700 // 16
    assert first.keys[:32] == second.keys[:32] and first.keys[32] != second.keys[32]
    assert second.arrival == 0.25
    # the oracle: the second prompt finds its first 512 tokens (id 0) cached
    assert oracle_hit_rate([first, second], 16) == 512 / (1024 + 700)


def test_multi_turn_history_is_the_next_turns_prefix() -> None:
    chat = MultiTurn(sessions=5, rate=1.0, think_s=0.0, data=None)
    first = next(iter(chat.arrivals()))
    follow = chat.follow_up(first, 10.0)  # seed 1's first conversation has two turns
    assert follow is not None
    assert follow.session == first.session and follow.turn == 1
    assert follow.arrival == 10.0
    full_history = (first.prompt_tokens + first.output_tokens) // 16
    assert list(follow.keys[:full_history]) == list(first.seq_keys[:full_history])
    assert follow.prompt_tokens > first.prompt_tokens + first.output_tokens
    assert chat.follow_up(follow, 20.0) is None  # the conversation is over


def test_rag_popular_documents_are_shared() -> None:
    reqs = list(Rag(requests=200, documents=50, docs_per_prompt=2, zipf_s=1.2).arrivals())
    assert oracle_hit_rate(reqs, 16) > 0.3


def test_sglang_cache_aware_sends_every_new_prefix_to_the_first_idle_worker() -> None:
    """The weakness the reference names: below the balance thresholds, unmatched prompts
    all go to the least-loaded worker, the first one on ties."""
    shape = EngineShape()
    fleet = FleetReadout([object()] * 4)  # type: ignore[list-item]
    router = CacheAwareRouter("sglang:cache_aware", SGLANG, fleet, shape)
    reqs = list(SharedPrefix(groups=8, prompts_per_group=1).arrivals())
    chosen = []
    for req in reqs:
        req.replica = router.route(req, 0.0)
        chosen.append(req.replica)
        router.on_finished(req, 0.0)  # answered before the next arrives: load stays 0
    assert chosen == [0] * 8
    again = Request(99, 1.0, reqs[3].keys, reqs[3].prompt_tokens, 1)
    assert router.route(again, 1.0) == 0
