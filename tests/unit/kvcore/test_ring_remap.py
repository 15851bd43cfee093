"""Scale-out of hashing strategies (issue 41 item 2): going from 8 to 9 replicas moves
only the new replica's share of prefix_hash and session_affinity keys, and every moved
key moves to the new replica (consistent hashing with virtual nodes), so the other eight
keep the cache their keys built."""

from __future__ import annotations

import random

import pytest

from kvcore.policies import ReplicaState, RouteContext, StaticStateView, create_policy
from kvcore.workload import parse_workload

KEYS = 20_000


def owners(strategy: str, replicas: int, contexts: list[RouteContext]) -> list[int | None]:
    workload = parse_workload({"strategy": strategy})
    policy = create_policy(workload, rng=random.Random(1))
    view = StaticStateView([ReplicaState(i, f"replica-{i}") for i in range(replicas)])
    return [policy.select(ctx, view).ordinal for ctx in contexts]


def contexts(strategy: str) -> list[RouteContext]:
    rng = random.Random(41)
    workload = parse_workload({"strategy": strategy})
    if strategy == "session_affinity":
        return [
            RouteContext(workload, "m", session_id=f"session-{rng.getrandbits(64)}")
            for _ in range(KEYS)
        ]
    return [
        RouteContext(workload, "m", block_keys=[rng.getrandbits(64) for _ in range(16)])
        for _ in range(KEYS)
    ]


@pytest.mark.parametrize("strategy", ["prefix_hash", "session_affinity"])
def test_eight_to_nine_replicas_remaps_only_the_new_replicas_share(strategy: str) -> None:
    asked = contexts(strategy)
    before, after = owners(strategy, 8, asked), owners(strategy, 9, asked)
    moved = [(b, a) for b, a in zip(before, after, strict=True) if b != a]
    share = len(moved) / KEYS
    print(f"{strategy}: 8 -> 9 replicas remapped {share:.1%} of {KEYS} keys (ideal 11.1%)")
    assert all(a == 8 for _, a in moved), "a key moved between two of the old replicas"
    assert 0.08 <= share <= 0.14  # 1/9 = 11.1%, give or take the virtual nodes' spread
