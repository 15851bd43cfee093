"""Load as policies read it: requests sent since the last report always count."""

from __future__ import annotations

import random

from kvcore.policies import ReplicaState, RouteContext, StaticStateView, create_policy
from kvcore.workload import parse_workload


def test_unreported_requests_raise_load_even_when_kv_usage_dominates() -> None:
    reported = ReplicaState(0, "r0", running=10, kv_usage=0.6, capacity=64)
    assert reported.load == 0.6
    busier = ReplicaState(0, "r0", running=10, kv_usage=0.6, capacity=64, unreported=8)
    assert busier.load == 0.6 + 8 / 64
    assert ReplicaState(0, "r0", kv_usage=0.95, capacity=64, unreported=8).load == 1.0


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
