"""Level 0: the replica with the lowest load (ties at random)."""

from __future__ import annotations

import random
from math import inf
from typing import ClassVar

from kvcore.policies.base import Decision, ReplicaReason, ReplicaState, RouteContext, StateView
from kvcore.policies.board import ReplicaBoard
from kvcore.policies.preselect import Pool, candidates, decision, least_loaded
from kvcore.policies.screening import best, reason
from kvcore.workload import Workload


class LeastLoadPolicy:
    """Lowest ``load`` among usable replicas."""

    name: ClassVar[str] = "least_load"
    reads_keys = False

    def __init__(self, workload: Workload, rng: random.Random) -> None:
        del workload
        self._rng = rng

    def select(self, ctx: RouteContext, state: StateView) -> Decision:
        found = candidates(ctx, state, {})
        usable = found.usable(_lowest_load, -inf)
        if not usable:
            return decision(self.name, found, None, _rows)
        scores = {r.ordinal: -r.load for r in usable}
        return decision(self.name, found, best(usable, scores, self._rng), _rows)


def _lowest_load(
    board: ReplicaBoard, pool: Pool, runs: dict[int, int], floor: float
) -> list[ReplicaState]:
    return least_loaded(board, pool, runs, floor, lambda r: -r.load)


def _rows(usable: list[ReplicaState]) -> list[ReplicaReason]:
    return [reason(r, score=-r.load) for r in usable]
