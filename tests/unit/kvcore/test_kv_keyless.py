"""kv_aware's shortcut for a prompt without block keys (shorter than a block) decides as
its general path does: the same replica, the same turn kept for the next decision, the
same random draws, note, speculative record and per-replica reasons, over random fleets
(loads, saturation, hard exclusions, none usable), placed blocks, cold starts and each
fallback, on a board and on a plain fleet list."""

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
from kvcore.policies.kv_scoring import queue_saturation, queue_screened
from kvcore.policies.screening import screen_rows
from kvcore.workload import KvAwareWorkload
from tests.unit.kvcore.test_preselect import REPLICA, WholeFleetView

MODEL = "m"
NOW = 10.0

WORKLOAD = st.fixed_dictionaries(
    {
        "load_threshold": st.sampled_from([0.25, 0.5, 0.9, 1.0]),
        "max_inflight_per_replica": st.sampled_from([1, 3, 1000]),
        "locality_weight": st.sampled_from([0.0, 0.5, 0.7, 1.0]),
        "min_hit": st.sampled_from([0.0, 0.3, 1.0]),
        "fallback": st.sampled_from(["least_load", "least_load", "round_robin", "prefix_hash"]),
        "speculative_ttl_s": st.sampled_from([0.0, 2.0]),
    }
)
PLACED = st.lists(  # (fleet position, blocks, expires after NOW?)
    st.tuples(st.integers(0, 11), st.integers(1, 4), st.booleans()), max_size=8
)
ANY_REPLICA = st.tuples(REPLICA, st.sampled_from([0, 1, 4, 8])).map(
    lambda drawn: {**drawn[0], "capacity": drawn[1]}  # a capacity below 2 too
)
STEP = st.tuples(
    st.sampled_from(["short", "short", "short", "keyed"]),  # the request's prompt
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


@settings(max_examples=400, deadline=None)
@given(
    fields=WORKLOAD,
    replicas=st.lists(ANY_REPLICA, min_size=0, max_size=12),
    ordinals=st.lists(st.integers(0, 40), min_size=12, max_size=12, unique=True),
    placed=PLACED,
    residency=st.booleans(),
    whole_fleet=st.booleans(),
    steps=st.lists(STEP, min_size=1, max_size=8),
    seed=st.integers(0, 3),
)
def test_a_prompt_without_keys_is_decided_as_the_general_path_decides_it(
    fields: dict[str, Any],
    replicas: list[dict[str, Any]],
    ordinals: list[int],
    placed: list[tuple[int, int, bool]],
    residency: bool,
    whole_fleet: bool,
    steps: list[tuple[str, int, int, frozenset[int]]],
    seed: int,
) -> None:
    states = [ReplicaState(ordinals[i], f"r{ordinals[i]}", **row) for i, row in enumerate(replicas)]
    index = BitmaskResidencyIndex()
    if residency:
        index.add(ordinals[-1], [1])
    for position, blocks, live in placed:
        sent = range(position * 1000, position * 1000 + blocks)
        index.add_speculative(ordinals[position], sent, expires_at=NOW + 1 if live else NOW)
    view = StaticStateView(states, index)
    state = WholeFleetView(view) if whole_fleet else view
    fast, general = _twins(fields, seed)
    workload = fast.aware
    for number, (prompt, position, more, exclude) in enumerate(steps):
        keys: Sequence[int] = range(number * 100, number * 100 + 3) if prompt == "keyed" else ()
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
    replicas=st.lists(ANY_REPLICA, min_size=0, max_size=12),
    exclude=st.frozensets(st.integers(0, 12), max_size=3),
)
def test_the_one_pass_screening_keeps_what_screening_keeps(
    fields: dict[str, Any], replicas: list[dict[str, Any]], exclude: frozenset[int]
) -> None:
    workload = KvAwareWorkload(**fields)
    fleet = [ReplicaState(i, f"r{i}", **row) for i, row in enumerate(replicas)]
    ctx = RouteContext(workload, MODEL, exclude=exclude)
    screened = screen_rows(ctx, fleet, queue_saturation)
    usable, note = queue_screened(ctx, fleet)
    assert usable == screened.usable
    assert note == screened.note
