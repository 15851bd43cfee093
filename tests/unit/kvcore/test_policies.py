"""Routing strategies: shared behaviour across the fleet shapes every strategy must handle."""

from __future__ import annotations

import json
import random
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcore.policies import POLICIES, Decision, ReplicaState, StaticStateView, create_policy
from kvcore.policies.base import ReplicaReason
from kvcore.policies.kv_scoring import queue_saturation
from kvcore.policies.screening import hard_exclusion, saturation
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
    replicas = fleet(3, running=240)  # 240 of 256 slots: over every strategy's threshold
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


def test_the_debug_header_shows_the_chosen_replicas_explain_row(strategy: str) -> None:
    """The header is built from the chosen replica's row alone; it reads as the explain
    endpoint's row for that replica, with the others excluded or scored around it."""
    replicas = [ReplicaState(0, "busy", running=300), ReplicaState(1, "sick", healthy=False),
                ReplicaState(2, "a", running=3), ReplicaState(3, "b", running=5)]  # fmt: skip
    decision = _route(strategy, replicas)
    header = decision.summary()
    row = next(r for r in decision.reasons if r.ordinal == decision.ordinal)  # every row
    values = {"hit": row.hit, "load": row.load, "score": row.score}
    figures = [f"{name}={value:.3f}" for name, value in values.items() if value is not None]
    assert header.startswith(f"replica={decision.replica_id}; strategy={strategy}; ")
    assert figures and "; ".join(figures) in header
    assert decision.summary() == header  # the same once every row is built


@pytest.mark.parametrize("rows", [tuple, list])
def test_the_debug_header_reads_reasons_given_as_a_plain_sequence(rows: type) -> None:
    """A decision made outside the policies (the proxy's own, a fallback's) carries its
    reasons as a tuple or a list, not a lazy ``Reasons``."""
    chosen = ReplicaState(1, "b", running=64)
    reasons = rows([ReplicaReason(0, "a", 0.5), ReplicaReason(1, "b", 0.25, score=0.75)])
    header = Decision(chosen, "manual", reasons).summary()
    assert header == "replica=b; strategy=manual; load=0.250; score=0.750"


replica_states = st.tuples(
    st.sampled_from([True, True, True, False]),  # healthy
    st.sampled_from([False, False, False, True]),  # draining
    st.sampled_from(["m", "x", None]),  # served model (None: any)
    st.integers(0, 400),  # running requests
    st.floats(0, 1),  # KV usage
)


@settings(max_examples=150, deadline=None)
@given(
    strategy_name=st.sampled_from(STRATEGIES),
    specs=st.lists(replica_states, max_size=7),
    held=st.lists(st.integers(0, 4), max_size=7),
    exclude=st.frozensets(st.integers(0, 7), max_size=3),
    length=st.integers(0, 80),
    session=st.sampled_from([None, "s1", "s2"]),
    seed=st.integers(0, 3),
)
def test_every_strategy_keeps_the_routing_invariants(
    strategy_name: str,
    specs: list[tuple[bool, bool, str | None, int, float]],
    held: list[int],
    exclude: frozenset[int],
    length: int,
    session: str | None,
    seed: int,
) -> None:
    replicas = [
        ReplicaState(
            i,
            f"r{i}",
            healthy=h,
            draining=d,
            models=frozenset({m}) if m else frozenset(),
            running=run,
            kv_usage=kv,
        )
        for i, (h, d, m, run, kv) in enumerate(specs)
    ]
    workload = _workload(strategy_name)
    ctx = context(workload, list(range(length)), session_id=session, exclude=exclude)
    view = StaticStateView(replicas, residency_known=seed % 2 == 0)
    for ordinal, blocks in enumerate(held[: len(replicas)]):
        view.index.add(ordinal, ctx.block_keys[:blocks])
    decision = create_policy(workload, rng=random.Random(seed)).select(ctx, view)

    eligible = [r for r in replicas if hard_exclusion(r, ctx) is None]
    own_rule = "fallback" not in decision.note or "new-prompt rule" in decision.note
    scored = strategy_name in ("kv_aware", "kv_cost") and own_rule  # cold: still its own test
    saturated_why = queue_saturation if scored else saturation  # a fallback screens its way
    free = [r for r in eligible if saturated_why(r, ctx) is None]
    assert [r.ordinal for r in decision.reasons] == [r.ordinal for r in replicas]
    json.dumps(decision.to_dict())
    if not eligible:
        assert decision.replica is None
        return
    assert decision.replica in eligible
    if free:
        assert decision.replica in free
    excluded = {r.ordinal for r in decision.reasons if r.excluded}
    assert decision.ordinal not in excluded
    assert excluded == {r.ordinal for r in replicas if r not in (free or eligible)}
