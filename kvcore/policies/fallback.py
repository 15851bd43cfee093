"""The level-0/2 policy a higher strategy falls back to when it has nothing to key on."""

from __future__ import annotations

import random

from kvcore.policies.base import Policy
from kvcore.policies.least_load import LeastLoadPolicy
from kvcore.policies.prefix_hash import PrefixHashPolicy
from kvcore.policies.round_robin import RoundRobinPolicy
from kvcore.workload import (
    KvAwareWorkload,
    KvCostWorkload,
    LeastLoadWorkload,
    PrefixHashWorkload,
    RoundRobinWorkload,
    SessionAffinityWorkload,
)

WithFallback = SessionAffinityWorkload | KvAwareWorkload | KvCostWorkload
_SHARED = {"name", "load_threshold", "max_inflight_per_replica", "tenant_isolation"}


def fallback_policy(workload: WithFallback, rng: random.Random) -> Policy:
    """``workload.fallback`` built with ``workload``'s shared limits."""
    shared = workload.model_dump(include=_SHARED)
    if workload.fallback == "round_robin":
        return RoundRobinPolicy(RoundRobinWorkload.model_validate(shared), rng)
    if workload.fallback == "prefix_hash":
        shared["prefix_tokens"] = getattr(workload, "prefix_tokens", 256)
        return PrefixHashPolicy(PrefixHashWorkload.model_validate(shared), rng)
    return LeastLoadPolicy(LeastLoadWorkload.model_validate(shared), rng)
