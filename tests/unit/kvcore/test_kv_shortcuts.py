"""kv_aware's shortcuts decide as its general path does: for a prompt without block keys
(shorter than a block) and for one some usable replica holds a counted hit of, the same
replica, the same turn kept for the next decision, the same random draws, note,
speculative record and per-replica reasons, over random fleets (loads, saturation, hard
exclusions, none usable), held prefixes, placed blocks, cold starts and each fallback, on
a board and on a plain fleet list."""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from kvcore.index import BitmaskResidencyIndex
from kvcore.policies import Decision, ReplicaState, RouteContext, StaticStateView, create_policy
from kvcore.policies.kv_aware import KvAwarePolicy
from kvcore.policies.kv_scoring import queue_saturation, queue_screened, queue_usable
from kvcore.policies.screening import hard_exclusion, screen_rows
from kvcore.workload import KvAwareWorkload
from tests.unit.kvcore.test_preselect import REPLICA, WholeFleetView

MODEL = "m"
NOW = 10.0

WORKLOAD = st.fixed_dictionaries(
    {
        "load_threshold": st.sampled_from([0.25, 0.5, 0.9, 1.0]),
        "max_inflight_per_replica": st.sampled_from([1, 3, 1000, 1000]),
        "locality_weight": st.sampled_from([0.0, 0.5, 0.7, 1.0]),
        "min_hit": st.sampled_from([0.0, 0.3, 1.0]),
        "fallback": st.sampled_from(["least_load", "least_load", "round_robin", "prefix_hash"]),
        "speculative_ttl_s": st.sampled_from([0.0, 2.0]),
        "max_imbalance": st.sampled_from([None, 1, 3, 64]),
        "hot_prefix_gap": st.sampled_from([None, 0, 4]),
    }
)
PLACED = st.lists(  # (fleet position, blocks, expires after NOW?)
    st.tuples(st.integers(0, 11), st.integers(1, 4), st.booleans()), max_size=8
)
ANY_REPLICA = st.tuples(REPLICA, st.sampled_from([0, 1, 4, 8, 64])).map(
    lambda drawn: {**drawn[0], "capacity": drawn[1]}  # a capacity below 2 too
)
EASY_REPLICA = REPLICA.map(  # eligible and seldom saturated: holders win by score
    lambda drawn: (
        {**drawn, "healthy": True, "draining": False, "models": frozenset()} | {"capacity": 64}
    )
)
PROMPT = range(5000, 5008)  # a prompt's 8 block keys, some held by some replicas
HELD = st.dictionaries(
    st.integers(0, 11), st.integers(1, 8), min_size=1, max_size=5
)  # position: blocks
STEP = st.tuples(
    st.sampled_from(["short", "held", "held", "new"]),  # the request's prompt
    st.integers(1, 8),  # blocks of PROMPT a "held" prompt begins with
    st.integers(0, 11),  # a fleet position whose state changes after it
    st.integers(-1, 3),  # by this many more requests not yet reported
    st.frozensets(st.integers(0, 40), max_size=3),  # ordinals already tried
)


def _twins(fields: dict[str, Any], seed: int) -> tuple[KvAwarePolicy, KvAwarePolicy]:
    workload = KvAwareWorkload(**fields)
    pair = [create_policy(workload, rng=random.Random(seed)) for _ in range(2)]
    assert isinstance(pair[0], KvAwarePolicy) and isinstance(pair[1], KvAwarePolicy)
    return pair[0], pair[1]


def _same(fast: Decision, general: Decision) -> None:
    headers = fast.summary(), general.summary()  # the chosen replica's row alone
    assert fast.replica is general.replica
    assert fast.strategy == general.strategy
    assert fast.note == general.note
    assert fast.speculative == general.speculative
    assert fast.extra == general.extra
    assert list(fast.reasons) == list(general.reasons)
    assert fast.to_dict() == general.to_dict()
    assert headers == (fast.summary(), general.summary())  # the same, from every row


def _state_of(policy: KvAwarePolicy) -> tuple[Any, ...]:
    fallback = policy._fallback
    return policy._last, policy._turn, policy._rng.getstate(), getattr(fallback, "_turn", None)


@settings(max_examples=600, deadline=None)
@given(
    fields=WORKLOAD,
    replicas=st.lists(ANY_REPLICA, max_size=12) | st.lists(EASY_REPLICA, max_size=12),
    ordinals=st.lists(st.integers(0, 40), min_size=12, max_size=12, unique=True),
    placed=PLACED,
    held=HELD,
    residency=st.booleans(),
    whole_fleet=st.booleans(),
    steps=st.lists(STEP, min_size=1, max_size=8),
    seed=st.integers(0, 3),
)
def test_kv_awares_shortcuts_decide_as_its_general_path_does(
    fields: dict[str, Any],
    replicas: list[dict[str, Any]],
    ordinals: list[int],
    placed: list[tuple[int, int, bool]],
    held: dict[int, int],
    residency: bool,
    whole_fleet: bool,
    steps: list[tuple[str, int, int, int, frozenset[int]]],
    seed: int,
) -> None:
    states = [ReplicaState(ordinals[i], f"r{ordinals[i]}", **row) for i, row in enumerate(replicas)]
    index = BitmaskResidencyIndex()
    if residency:
        index.add(ordinals[-1], [1])
    for position, blocks in held.items():
        if states:
            index.add(ordinals[position % len(states)], PROMPT[:blocks])
    for position, blocks, live in placed:
        sent = range(position * 1000, position * 1000 + blocks)
        index.add_speculative(ordinals[position], sent, expires_at=NOW + 1 if live else NOW)
    view = StaticStateView(states, index)
    state = WholeFleetView(view) if whole_fleet else view
    fast, general = _twins(fields, seed)
    workload = fast.aware
    for number, (prompt, blocks, position, more, exclude) in enumerate(steps):
        keys: Sequence[int] = ()
        if prompt == "held":
            keys = PROMPT[:blocks]
        elif prompt == "new":
            keys = range(number * 100, number * 100 + blocks)
        tokens = range(number, number + (48 if keys else 5))
        ctx = RouteContext(workload, MODEL, keys, tokens, now=NOW, exclude=exclude)
        decided, generally = fast.select(ctx, state), general.select_scored(ctx, state)
        assert _state_of(fast) == _state_of(general)
        view.apply(decided)  # a keyed prompt's speculation is placed blocks for the turn
        if states and (replica := view.board.get(ordinals[position % len(states)])):
            view.put(replace(replica, unreported=max(replica.unreported + more, 0)))
        _same(decided, generally)  # explained after the fleet changed: as it was


@settings(max_examples=300, deadline=None)
@given(
    fields=WORKLOAD,
    loads=st.lists(
        st.tuples(st.integers(0, 3), st.sampled_from([0.0, 0.5])), min_size=1, max_size=6
    ),
    held=st.lists(st.integers(0, 8), min_size=6, max_size=6),  # blocks of PROMPT, by ordinal
    blocks=st.lists(st.integers(1, 8), min_size=1, max_size=6),  # each request's prompt
    seed=st.integers(0, 3),
)
def test_a_held_prompt_is_scored_as_the_general_path_scores_it(
    fields: dict[str, Any],
    loads: list[tuple[int, float]],
    held: list[int],
    blocks: list[int],
    seed: int,
) -> None:
    """Eligible replicas with few distinct loads and prefixes: holders tie with each
    other and with the least-loaded non-holders, and runs fall either side of min_hit."""
    states = [
        ReplicaState(o, f"r{o}", running=running, kv_usage=kv, capacity=64)
        for o, (running, kv) in enumerate(loads)
    ]
    view = StaticStateView(states)
    for ordinal, count in enumerate(held[: len(states)]):
        view.index.add(ordinal, PROMPT[:count])
    fast, general = _twins(fields, seed)
    for number, count in enumerate(blocks):
        ctx = RouteContext(fast.aware, MODEL, PROMPT[:count], now=NOW)
        decided, generally = fast.select(ctx, view), general.select_scored(ctx, view)
        assert _state_of(fast) == _state_of(general)
        view.apply(decided)
        if decided.replica is not None:
            busier = replace(decided.replica, unreported=decided.replica.unreported + number % 2)
            view.put(busier)
        _same(decided, generally)


@settings(max_examples=300, deadline=None)
@given(
    fields=WORKLOAD,
    replicas=st.lists(ANY_REPLICA, min_size=0, max_size=12),
    exclude=st.frozensets(st.integers(0, 12), max_size=3),
)
def test_the_one_test_screening_keeps_what_screening_keeps(
    fields: dict[str, Any], replicas: list[dict[str, Any]], exclude: frozenset[int]
) -> None:
    workload = KvAwareWorkload(**fields)
    fleet = [ReplicaState(i, f"r{i}", **row) for i, row in enumerate(replicas)]
    ctx = RouteContext(workload, MODEL, exclude=exclude)
    screened = screen_rows(ctx, fleet, queue_saturation)
    usable, note = queue_screened(ctx, fleet)
    assert usable == screened.usable
    assert note == screened.note
    for replica in fleet:
        plainly = hard_exclusion(replica, ctx) is None and queue_saturation(replica, ctx) is None
        assert queue_usable(replica, ctx) == plainly
