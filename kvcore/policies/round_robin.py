"""Level 0: replicas in turn (skipping saturated ones while others are free)."""

from __future__ import annotations

import random
from typing import ClassVar

from kvcore.policies.base import Decision, RouteContext, StateView
from kvcore.policies.screening import decide, plain_rows, screen
from kvcore.workload import Workload


class RoundRobinPolicy:
    """Cycles through the usable replicas in ordinal order."""

    name: ClassVar[str] = "round_robin"
    reads_keys = False

    def __init__(self, workload: Workload, rng: random.Random) -> None:
        del workload, rng
        self._turn = 0

    def select(self, ctx: RouteContext, state: StateView) -> Decision:
        screened = screen(ctx, state)
        if not screened.usable:
            return decide(self.name, screened, None)
        chosen = screened.usable[self._turn % len(screened.usable)]
        self._turn += 1
        return decide(self.name, screened, chosen, plain_rows)
