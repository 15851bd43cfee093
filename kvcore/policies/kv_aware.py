"""Level 3, the brief's score: ``alpha * hit + (1 - alpha) * (1 - load)``, highest wins.

``hit`` is the share of the prompt's blocks in the replica's leading run (counted as 0
below the workload's ``min_hit``, so that a prefix every prompt shares does not pull
all traffic to its first holder); ``alpha`` is the workload's ``locality_weight``.
Replicas at or over the load threshold are skipped unless every replica is; ties go to
the lower load, then at random.
"""

from __future__ import annotations

import random

from kvcore.policies.base import ReplicaState, RouteContext
from kvcore.policies.kv_scoring import KvScoringPolicy
from kvcore.workload import KvAwareWorkload


class KvAwarePolicy(KvScoringPolicy):
    """Weighted sum of cache hit and spare capacity."""

    name = "kv_aware"

    def __init__(self, workload: KvAwareWorkload, rng: random.Random) -> None:
        super().__init__(workload, rng)
        self.aware = workload

    def scores(
        self, ctx: RouteContext, replicas: list[ReplicaState], runs: dict[int, int]
    ) -> dict[int, float]:
        alpha, min_hit = self.aware.locality_weight, self.aware.min_hit
        blocks = len(ctx.block_keys)
        scores = {}
        for replica in replicas:
            hit = runs.get(replica.ordinal, 0) / blocks if blocks else 0.0
            if hit < min_hit:
                hit = 0.0
            scores[replica.ordinal] = alpha * hit + (1 - alpha) * (1 - replica.load)
        return scores
