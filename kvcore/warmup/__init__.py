"""Warm-up of replicas that join empty: hot prefixes, the warm-up plan, the routing gate.

Pure: proxies count hot prefixes (:class:`HotPrefixes`), the control plane's leader
plans and paces a warm-up (:func:`plan`, :func:`stagger`, :func:`share`, :class:`Pacer`,
:class:`Warming`), and routing keeps requests off a replica while it warms
(:func:`warming_excluded`); the benchmark simulator runs the same code in virtual time.
"""

from __future__ import annotations

from kvcore.warmup.gate import warming_excluded
from kvcore.warmup.hot_prefixes import HotPrefix, HotPrefixes, depths
from kvcore.warmup.plan import Pacer, Pressure, Step, Warming, moves_it, plan, share, stagger
from kvcore.workload.warmup import WarmupSettings

# A warm-up by transfer (``source: transfer``) keeps this many prefixes moving at once: a
# move costs the warming replica no prefill, and each waits for a slot on a replica that
# holds it (one step there), so one at a time would spend the warm-up in their queues
TRANSFERS_IN_FLIGHT = 8


def settings_of(**fields: object) -> WarmupSettings:
    """Warm-up settings from keyword fields, validated (tests, the simulator)."""
    return WarmupSettings.model_validate(fields)


__all__ = [
    "TRANSFERS_IN_FLIGHT",
    "HotPrefix",
    "HotPrefixes",
    "Pacer",
    "Pressure",
    "Step",
    "Warming",
    "depths",
    "moves_it",
    "plan",
    "settings_of",
    "share",
    "stagger",
    "warming_excluded",
]
