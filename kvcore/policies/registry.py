"""Strategies by name: the one way a policy is created from a workload."""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

from kvcore.policies.base import Policy
from kvcore.policies.kv_aware import KvAwarePolicy
from kvcore.policies.kv_cost import KvCostPolicy
from kvcore.policies.kv_scoring import KvScoringPolicy
from kvcore.policies.least_load import LeastLoadPolicy
from kvcore.policies.prefix_hash import PrefixHashPolicy
from kvcore.policies.round_robin import RoundRobinPolicy
from kvcore.policies.session_affinity import SessionAffinityPolicy
from kvcore.workload import Workload

PolicyFactory = Callable[[Any, random.Random], Policy]

POLICIES: dict[str, PolicyFactory] = {
    "round_robin": RoundRobinPolicy,
    "least_load": LeastLoadPolicy,
    "session_affinity": SessionAffinityPolicy,
    "prefix_hash": PrefixHashPolicy,
    "kv_aware": KvAwarePolicy,
    "kv_cost": KvCostPolicy,
}


def create_policy(
    workload: Workload, *, rng: random.Random | None = None, place: int | None = None
) -> Policy:
    """The policy ``workload.strategy`` names, configured by ``workload``.

    ``rng`` breaks ties (pass a seeded one for reproducible runs); ``place``: this
    router's index among several behind one balancer, where its turn for new prompts
    starts (:meth:`~kvcore.policies.kv_scoring.KvScoringPolicy.take_place`; ``None``: a
    random replica).
    """
    factory = POLICIES.get(workload.strategy)
    if factory is None:
        raise ValueError(f"unknown strategy {workload.strategy!r}; known: {sorted(POLICIES)}")
    policy = factory(workload, rng or random.Random())
    if place is not None and isinstance(policy, KvScoringPolicy):
        policy.take_place(place)
    return policy
