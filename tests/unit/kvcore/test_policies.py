"""Routing strategies: shared behaviour across the fleet shapes every strategy must handle."""

from __future__ import annotations

import random
from typing import Any

import pytest

from kvcore.policies import POLICIES, Decision, ReplicaState, StaticStateView, create_policy
from kvcore.workload import STRATEGIES, Workload, parse_workload
from tests.unit.kvcore.policy_helpers import context, fleet

PROMPT = list(range(100, 164))  # four blocks


def _workload(strategy: str, **fields: object) -> Workload:
    return parse_workload({"strategy": strategy, **fields})


@pytest.fixture(params=STRATEGIES)
def strategy(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def _route(strategy: str, replicas: list[ReplicaState], **ctx: Any) -> Decision:
    view = StaticStateView(replicas, residency_known=True)
    view.index.add(0, [1])  # some residency exists
    policy = create_policy(_workload(strategy), rng=random.Random(0))
    return policy.select(context(_workload(strategy), PROMPT, session_id="s", **ctx), view)


def test_registry_has_every_strategy_by_name(strategy: str) -> None:
    assert set(POLICIES) == set(STRATEGIES)
    assert create_policy(_workload(strategy)).name == strategy


def test_an_empty_fleet_gets_no_replica_and_says_so(strategy: str) -> None:
    decision = _route(strategy, [])
    assert decision.replica is None
    assert "no replica" in decision.note


def test_a_one_replica_fleet_always_gets_it(strategy: str) -> None:
    policy = create_policy(_workload(strategy), rng=random.Random(1))
    view = StaticStateView(fleet(1), residency_known=True)
    for i in range(5):
        ctx = context(_workload(strategy), [i] * 40, session_id=f"s{i}")
        assert policy.select(ctx, view).replica_id == "r0"


def test_when_every_replica_is_over_the_threshold_one_still_serves(strategy: str) -> None:
    replicas = fleet(3, kv_usage=0.95)
    decision = _route(strategy, replicas)
    assert decision.replica is not None
    assert "saturated" in decision.note


def test_replicas_that_cannot_serve_are_never_chosen_and_say_why(strategy: str) -> None:
    replicas = [
        ReplicaState(0, "sick", healthy=False),
        ReplicaState(1, "leaving", draining=True),
        ReplicaState(2, "other-model", models=frozenset({"x"})),
        ReplicaState(3, "tried"),
        ReplicaState(4, "good", models=frozenset({"m"})),
    ]
    decision = _route(strategy, replicas, exclude=frozenset({3}))
    assert decision.replica_id == "good"
    why = {r["replica_id"]: r.get("excluded") for r in decision.to_dict()["replicas"]}
    assert why == {
        "sick": "unhealthy",
        "leaving": "draining",
        "other-model": "does not serve model 'm'",
        "tried": "already tried for this request",
        "good": None,
    }


def test_a_saturated_replica_is_skipped_while_others_are_free(strategy: str) -> None:
    replicas = [ReplicaState(0, "busy", running=300), ReplicaState(1, "free")]
    for i in range(6):
        decision = _route(strategy, replicas, request_id=str(i))
        assert decision.replica_id == "free"
    row = decision.to_dict()["replicas"][0]
    assert row["excluded"] == "300 requests >= max_inflight_per_replica 256"


def test_a_prompt_shorter_than_one_block_is_routed(strategy: str) -> None:
    policy = create_policy(_workload(strategy), rng=random.Random(2))
    view = StaticStateView(fleet(4), residency_known=True)
    short = context(_workload(strategy), [5, 6, 7], session_id="s")
    assert short.block_keys == []
    chosen = {policy.select(short, view).replica_id for _ in range(3)}
    assert chosen <= {"r0", "r1", "r2", "r3"} and None not in chosen


def test_decisions_explain_every_replica_as_json(strategy: str) -> None:
    decision = _route(strategy, fleet(3))
    explained = decision.to_dict()
    assert explained["strategy"] == strategy
    assert [r["ordinal"] for r in explained["replicas"]] == [0, 1, 2]
    assert all("load" in r for r in explained["replicas"])
