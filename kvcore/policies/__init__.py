"""Routing strategies: one module each behind :class:`Policy`, created by name.

``create_policy(workload, rng=)`` builds the strategy a workload names; each takes a
read-only :class:`RouteContext` and a read-only :class:`StateView` and returns a
:class:`Decision` that explains itself per replica. :class:`InflightLedger` counts a
proxy's requests per replica that the engine's last load report does not include yet
(``ReplicaState.unreported``).
"""

from __future__ import annotations

from kvcore.policies.base import (
    Decision,
    Policy,
    ReplicaReason,
    ReplicaState,
    RouteContext,
    SpeculativeRecord,
    StateView,
)
from kvcore.policies.hash_ring import HashRing
from kvcore.policies.inflight import InflightLedger
from kvcore.policies.prefill import PrefillLedger
from kvcore.policies.registry import POLICIES, create_policy
from kvcore.policies.view import StaticStateView

__all__ = [
    "POLICIES",
    "Decision",
    "HashRing",
    "InflightLedger",
    "Policy",
    "PrefillLedger",
    "ReplicaReason",
    "ReplicaState",
    "RouteContext",
    "SpeculativeRecord",
    "StateView",
    "StaticStateView",
    "create_policy",
]
