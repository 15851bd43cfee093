"""Strategies by name: the one way a policy is created from a workload."""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

from kvcore.policies.base import Policy
from kvcore.policies.kv_aware import KvAwarePolicy
from kvcore.policies.kv_cost import KvCostPolicy
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


def create_policy(workload: Workload, *, rng: random.Random | None = None) -> Policy:
    """The policy ``workload.strategy`` names, configured by ``workload``.

    ``rng`` breaks ties (pass a seeded one for reproducible runs).
    """
    factory = POLICIES.get(workload.strategy)
    if factory is None:
        raise ValueError(f"unknown strategy {workload.strategy!r}; known: {sorted(POLICIES)}")
    return factory(workload, rng or random.Random())
