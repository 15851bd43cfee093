"""Level 3 in time, the default: the replica where this request is served soonest,
counting what its cache saves and what the request waits for.

    cost(r)    = (1 - alpha) * wait(r) + alpha * prefill(r)       lowest wins
    wait(r)    = queued(r) / rate(r)      seconds of prefill queued ahead of it on r
    prefill(r) = uncached(r) / rate(r)    seconds to prefill what r does not hold of it

- ``alpha`` is the workload's ``locality_weight``: 0.5 ranks by the plain predicted time
  to first token; above it a second of recomputation weighs ``alpha / (1 - alpha)``
  seconds of queue (0.8: 4), since a miss also delays every request queued behind it
  and takes cache room from the prefixes already there; 1 ranks by the cache alone, 0
  by the queue alone. It is the brief's ``alpha * hit + (1 - alpha) * (1 - load)`` with
  hit and load measured in seconds.
- ``queued(r)``: prompt tokens ahead of the request — this router's prefill books
  (:mod:`kvcore.policies.prefill`: the uncached tokens of its requests to r with no
  first token yet, less what r has prefilled since) when the caller keeps them, else
  (waiting + sent since r's last load report) times ``queued_request_tokens``.
- ``uncached(r)``: this prompt's tokens beyond r's leading run of cached blocks.
- ``rate(r)``: r's prefill tokens per second, learned from the first tokens this router
  timed (:class:`~kvcore.policies.prefill.PrefillRates`), else ``prefill_tokens_per_s``.

Around the cost, what every level-3 strategy keeps (:mod:`kvcore.policies.kv_scoring`):
a prompt no replica holds goes to the next replica in turn (new prefixes spread evenly,
as no stale load can); a hot prefix (one system prompt before every request) is counted
as held by every usable replica once its holder runs ``hot_prefix_gap`` requests ahead
of the least busy one, so it replicates where the wait is shortest; ``max_imbalance``
requests ahead, the least busy replica takes the request whatever the cost. Decisions
carry ``score = -cost`` in seconds, and the explain endpoint each replica's wait,
prefill and rate.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from math import inf
from typing import ClassVar

from kvcore.policies.base import ReplicaReason, ReplicaState, RouteContext
from kvcore.policies.board import ReplicaBoard
from kvcore.policies.kv_scoring import (
    HELD,
    KvScoringPolicy,
    Runs,
    queue_saturation,
    queue_usable,
)
from kvcore.policies.preselect import Pool, cheapest_queues, usable_pool
from kvcore.policies.screening import best
from kvcore.workload import KvCostWorkload


class KvCostPolicy(KvScoringPolicy):
    """Lowest weighted time: prefill saved by the cache against the wait."""

    name: ClassVar[str] = "kv_cost"

    def __init__(self, workload: KvCostWorkload, rng: random.Random) -> None:
        super().__init__(workload, rng)
        self.cost = workload

    def scores(
        self, ctx: RouteContext, replicas: list[ReplicaState], runs: dict[int, int]
    ) -> dict[int, float]:
        return {r.ordinal: -self.cost_s(ctx, r, runs.get(r.ordinal, 0)) for r in replicas}

    def cost_s(self, ctx: RouteContext, replica: ReplicaState, held_blocks: int) -> float:
        """``(1 - alpha) * wait + alpha * prefill`` on ``replica``, in seconds."""
        wait, prefill = self.times_s(ctx, replica, held_blocks)
        alpha = self.cost.locality_weight
        return (1 - alpha) * wait + alpha * prefill

    def times_s(
        self, ctx: RouteContext, replica: ReplicaState, held_blocks: int
    ) -> tuple[float, float]:
        """Seconds ``replica`` would keep this prompt waiting, and prefilling it."""
        workload = self.cost
        queued = replica.queued_prefill_tokens
        if queued is None:
            queued = (replica.waiting + replica.unreported) * workload.queued_request_tokens
        uncached = max(0, ctx.prompt_tokens - held_blocks * ctx.block_size)
        rate = replica.prefill_tokens_per_s or workload.prefill_tokens_per_s
        return queued / rate, uncached / rate

    def predicted_ttft_s(self, ctx: RouteContext, replica: ReplicaState, held_blocks: int) -> float:
        """Seconds until ``replica`` would start decoding this prompt (wait + prefill)."""
        return sum(self.times_s(ctx, replica, held_blocks))

    def nonholders(
        self, board: ReplicaBoard, pool: Pool, runs: dict[int, int], floor: float
    ) -> list[ReplicaState]:
        ctx = pool.ctx  # a non-holder's cost grows with its queue at its rate
        return cheapest_queues(board, pool, runs, floor, lambda r: self.nonholder_score(ctx, r))

    def hot_target(
        self, ctx: RouteContext, least: ReplicaState, fleet: Sequence[ReplicaState], runs: Runs
    ) -> ReplicaState:
        """The cheapest usable replica with the hot prefix (``runs[HELD]`` blocks)
        counted as held by each: it is, one prefill after it is sent there. On a board,
        only the replicas holding more and the least queued of the rest are scored."""
        held = runs[HELD]
        if type(fleet) is ReplicaBoard:  # not isinstance: see ReplicaBoard
            pool = usable_pool(ctx, fleet, queue_saturation)
            longer = {o: n for o, n in runs.items() if n > held and o != HELD}
            rest = [] if pool is None else self._cheapest_at(ctx, fleet, pool, longer, held)
            usable = [r for o in longer if (r := fleet.at(o)) and queue_usable(r, ctx)]
            usable += rest
        else:
            usable = [r for r in fleet if queue_usable(r, ctx)]
        hot = {r.ordinal: max(runs.get(r.ordinal, 0), held) for r in usable}
        return best(usable, self.scores(ctx, usable, hot), self._rng) if usable else least

    def _cheapest_at(
        self, ctx: RouteContext, board: ReplicaBoard, pool: Pool, longer: Runs, held: int
    ) -> list[ReplicaState]:
        """The cheapest usable replicas not in ``longer``, each counted as holding
        ``held`` blocks (their cost then depends on their queue alone)."""
        return cheapest_queues(board, pool, longer, -inf, lambda r: -self.cost_s(ctx, r, held))

    def _row(
        self, ctx: RouteContext, replica: ReplicaState, held: int, scores: dict[int, float]
    ) -> ReplicaReason:
        row = super()._row(ctx, replica, held, scores)
        row.wait_s, row.prefill_s = self.times_s(ctx, replica, held)
        row.prefill_tokens_per_s = replica.prefill_tokens_per_s or self.cost.prefill_tokens_per_s
        return row
