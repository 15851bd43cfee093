"""Level 0: the replica with the lowest load (ties at random)."""

from __future__ import annotations

import random

from kvcore.policies.base import Decision, RouteContext, StateView
from kvcore.policies.screening import best, decide, reason, screen
from kvcore.workload import Workload


class LeastLoadPolicy:
    """Lowest ``load`` among usable replicas."""

    name = "least_load"

    def __init__(self, workload: Workload, rng: random.Random) -> None:
        del workload
        self._rng = rng

    def select(self, ctx: RouteContext, state: StateView) -> Decision:
        screened = screen(ctx, state)
        if not screened.usable:
            return decide(self.name, screened, None)
        scores = {r.ordinal: -r.load for r in screened.usable}
        chosen = best(screened.usable, scores, self._rng)
        usable = screened.usable
        return decide(
            self.name,
            screened,
            chosen,
            lambda: [reason(r, score=scores[r.ordinal]) for r in usable],
        )
