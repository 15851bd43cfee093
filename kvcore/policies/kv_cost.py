"""Level 3 in time: the replica with the lowest predicted time to first token.

    ttft(r) = (queued(r) + locality_weight * uncached(r)) / rate(r)

- ``queued(r)``: prompt tokens ahead of this request — ``queued_prefill_tokens`` when the
  caller knows it (a proxy's own prefill books, :mod:`kvcore.policies.prefill`: the
  uncached tokens of the requests it sent r that have no first token yet, less what r
  has prefilled since its queue last moved), else (waiting + this proxy's requests sent
  since the replica's last load report, ``unreported``) times the workload's
  ``queued_request_tokens``;
- ``uncached(r)``: this prompt's tokens beyond r's leading run of blocks;
- ``rate(r)``: r's prefill tokens per second, else the workload's
  ``prefill_tokens_per_s``.

A cost in time puts cache and queue in one unit, so near saturation a long queue
outweighs a cache hit exactly when waiting costs more than recomputing (Mooncake's and
Dynamo's schedulers rank this way); ``locality_weight`` 1 (the default) is that plain
prediction. Decisions carry ``score = -ttft`` in seconds.

The prefill in progress is most of the wait for long prompts and no load report shows
it: with queued work estimated from reported waiting requests, kv_cost measured 5.5 s
mean TTFT on the Mooncake trace in ``bench.sim``; with a router's own books, 1.2 s
(``bench.sim``'s routers keep them, and so does the proxy: ``dataplane.prefill_books``).
"""

from __future__ import annotations

import random
from typing import ClassVar

from kvcore.policies.base import ReplicaState, RouteContext
from kvcore.policies.board import ReplicaBoard
from kvcore.policies.kv_scoring import KvScoringPolicy
from kvcore.policies.preselect import Pool, cheapest_queues
from kvcore.workload import KvCostWorkload


class KvCostPolicy(KvScoringPolicy):
    """Lowest predicted time to first token."""

    name: ClassVar[str] = "kv_cost"

    def __init__(self, workload: KvCostWorkload, rng: random.Random) -> None:
        super().__init__(workload, rng)
        self.cost = workload

    def scores(
        self, ctx: RouteContext, replicas: list[ReplicaState], runs: dict[int, int]
    ) -> dict[int, float]:
        return {r.ordinal: -self.predicted_ttft_s(ctx, r, runs.get(r.ordinal, 0)) for r in replicas}

    def nonholders(
        self, board: ReplicaBoard, pool: Pool, runs: dict[int, int], floor: float
    ) -> list[ReplicaState]:
        ctx = pool.ctx  # a non-holder's predicted time grows with its queue at its rate
        return cheapest_queues(board, pool, runs, floor, lambda r: self.nonholder_score(ctx, r))

    def predicted_ttft_s(self, ctx: RouteContext, replica: ReplicaState, held_blocks: int) -> float:
        """Seconds until ``replica`` would start decoding this prompt."""
        workload = self.cost
        queued = replica.queued_prefill_tokens
        if queued is None:
            queued = (replica.waiting + replica.unreported) * workload.queued_request_tokens
        uncached = max(0, ctx.prompt_tokens - held_blocks * ctx.block_size)
        rate = replica.prefill_tokens_per_s or workload.prefill_tokens_per_s
        return (queued + workload.locality_weight * uncached) / rate
