"""Load as policies read it: requests sent since the last report always count."""

from __future__ import annotations

import random

from kvcore.index import BitmaskResidencyIndex
from kvcore.policies import ReplicaState, RouteContext, StaticStateView, create_policy
from kvcore.workload import parse_workload


def test_unreported_requests_raise_load_even_when_kv_usage_dominates() -> None:
    reported = ReplicaState(0, "r0", running=10, kv_usage=0.6, capacity=64)
    assert reported.load == 0.6
    busier = ReplicaState(0, "r0", running=10, kv_usage=0.6, capacity=64, unreported=8)
    assert busier.load == 0.6 + 8 / 64
    assert ReplicaState(0, "r0", kv_usage=0.95, capacity=64, unreported=8).load == 0.95 + 8 / 64


def test_an_overloaded_fleet_is_still_ranked_by_queue_depth() -> None:
    """Every replica over its seats (an overloaded fleet): the one with the shorter queue
    takes the request, under least_load, and under kv_aware between two replicas that
    hold the prompt alike (with load capped at 1 they tied, and chance decided)."""
    index = BitmaskResidencyIndex()
    keys = (11, 12, 13, 14)
    for ordinal in (0, 1):
        index.add(ordinal, list(keys))
    for strategy in ("least_load", "kv_aware"):
        workload = parse_workload({"strategy": strategy})
        chosen = set()
        for seed in range(20):
            policy = create_policy(workload, rng=random.Random(seed))
            view = StaticStateView(
                (
                    ReplicaState(0, "r0", running=64, waiting=40, capacity=64),
                    ReplicaState(1, "r1", running=64, waiting=8, capacity=64),
                ),
                index,
            )
            ctx = RouteContext(workload, "m", block_keys=keys)
            chosen.add(policy.select(ctx, view).ordinal)
        assert chosen == {1}, strategy


def test_least_load_spreads_a_burst_sent_between_two_load_reports() -> None:
    """Both replicas reported KV usage well above their request occupancy; a proxy that
    keeps sending to the lower one must move on once its own requests close the gap."""
    workload = parse_workload({"strategy": "least_load"})
    policy = create_policy(workload, rng=random.Random(1))
    sent = [0, 0]
    for _ in range(8):
        view = StaticStateView(
            ReplicaState(i, f"r{i}", running=4, kv_usage=usage, capacity=64, unreported=sent[i])
            for i, usage in enumerate((0.50, 0.55))
        )
        ordinal = policy.select(RouteContext(workload, "m"), view).ordinal
        assert ordinal is not None
        sent[ordinal] += 1
    assert sent == [6, 2]  # with the burst inside max(), all 8 went to r0


def test_kv_aware_spreads_new_prompts_on_stale_load() -> None:
    """Between two load reports, new prompts (no replica holds any of them) must not all
    go to the replica that last reported least: that herding made kv_aware 6.6x slower
    than round-robin on a no-reuse workload. The power of two choices spreads them."""
    workload = parse_workload({"strategy": "kv_aware", "speculative_ttl_s": 0})
    policy = create_policy(workload, rng=random.Random(7))
    index = BitmaskResidencyIndex()
    index.add(3, [999])  # some residency exists: no cold-start fallback
    sent = [0, 0, 0, 0]
    for request in range(64):
        view = StaticStateView(
            (
                ReplicaState(i, f"r{i}", running=running, capacity=256, unreported=sent[i])
                for i, running in enumerate((0, 64, 64, 64))
            ),
            index,
        )
        ctx = RouteContext(workload, "m", block_keys=(request * 7 + 1, request * 7 + 2))
        ordinal = policy.select(ctx, view).ordinal
        assert ordinal is not None
        sent[ordinal] += 1
    assert max(sent) <= 48, sent  # ranked by load alone, all 64 went to r0
    assert min(sent) >= 4, sent


def test_kv_aware_still_follows_a_counted_hit() -> None:
    """A holder of a counted hit takes the prompt though it runs 40 requests and the
    others none: the new-prompt turn does not override a hit. With the defaults, the same
    prompt sent again and again becomes hot at its 9th request (every request of 9, less
    one standard error, fills two of three replicas' fair shares), and the hot-prefix
    rule then moves it to an idle replica (tests/unit/kvcore/test_policy_kv.py)."""
    for gap in (None, 4):
        workload = parse_workload({"strategy": "kv_aware", "hot_prefix_gap": gap})
        policy = create_policy(workload, rng=random.Random(7))
        index = BitmaskResidencyIndex()
        index.add(2, [11, 12, 13])
        view = StaticStateView(
            (ReplicaState(i, f"r{i}", running=r, capacity=256) for i, r in enumerate((0, 0, 40))),
            index,
        )
        chosen = []
        for _ in range(20):
            ctx = RouteContext(workload, "m", block_keys=(11, 12, 13, 14))
            decision = policy.select(ctx, view)
            chosen.append((decision.ordinal, decision.note.split(" (")[0]))
        if gap is None:
            assert chosen == [(2, "")] * 20
        else:  # hot at the 9th request
            assert chosen == [(2, "")] * 8 + [(0, "hot prefix")] * 12
