"""Warm-up of replicas that join empty: hot prefixes, the warm-up plan, the routing gate.

Pure: proxies count hot prefixes (:class:`HotPrefixes`), the control plane's leader
plans and paces a warm-up (:func:`plan`, :func:`stagger`, :class:`Pacer`,
:class:`Warming`), and routing keeps requests off a replica while it warms
(:func:`warming_excluded`); the benchmark simulator runs the same code in virtual time.
"""

from __future__ import annotations

from kvcore.warmup.gate import warming_excluded
from kvcore.warmup.hot_prefixes import HotPrefix, HotPrefixes, depths
from kvcore.warmup.plan import Pacer, Step, Warming, plan, stagger
from kvcore.workload.warmup import WarmupSettings


def settings_of(**fields: object) -> WarmupSettings:
    """Warm-up settings from keyword fields, validated (tests, the simulator)."""
    return WarmupSettings.model_validate(fields)


__all__ = [
    "HotPrefix",
    "HotPrefixes",
    "Pacer",
    "Step",
    "Warming",
    "depths",
    "plan",
    "settings_of",
    "stagger",
    "warming_excluded",
]
