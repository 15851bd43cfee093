"""What ``kv_aware`` and ``kv_cost`` share: residency lookup, fallback, speculation.

A level-3 strategy looks up each candidate's leading run of the prompt's block keys
(confirmed plus unexpired speculative residency), scores the candidates its own way,
and asks the caller to record the prompt's keys as speculatively resident on the chosen
replica for ``speculative_ttl_s``.

Before the first engine event (no confirmed residency anywhere), a prompt no replica
holds even speculatively goes to the workload's ``fallback``, which still speculates;
a prompt some replica holds, if only speculatively, is scored. So a cold burst of one
new prefix follows its first request's replica, while every other new prefix keeps the
fallback's placement (``prefix_hash`` places it the same way on every proxy, whatever
each proxy has speculated).
"""

from __future__ import annotations

import random
from dataclasses import replace

from kvcore.policies.base import (
    Decision,
    ReplicaReason,
    ReplicaState,
    RouteContext,
    SpeculativeRecord,
    StateView,
)
from kvcore.policies.fallback import fallback_policy
from kvcore.policies.screening import best, decide, screen
from kvcore.workload import KvAwareWorkload, KvCostWorkload


def queue_load(replica: ReplicaState) -> float:
    """0-1: the replica's requests (running, waiting, sent since its last report) over
    its capacity. KV usage is left out: a busy engine serving long prompts keeps its KV
    cache nearly full of the requests it runs, so near-full usage is its normal state,
    not a reason to send a request away from the prefix it holds (when it truly cannot
    admit, requests wait: :func:`queue_saturation`)."""
    return min(1.0, replica.requests / max(replica.capacity, 1))


def queue_saturation(replica: ReplicaState, ctx: RouteContext) -> str | None:
    """Why ``replica`` is saturated for a level-3 strategy: ``max_inflight_per_replica``
    requests, a :func:`queue_load` at or over ``load_threshold``, or KV usage at or over
    it while the engine reports requests waiting (it cannot admit them: its cache is full
    of running requests, not just of cached prefixes)."""
    workload = ctx.workload
    if replica.requests >= workload.max_inflight_per_replica:
        limit = workload.max_inflight_per_replica
        return f"{replica.requests} requests >= max_inflight_per_replica {limit}"
    load = queue_load(replica)
    if load >= workload.load_threshold:
        return f"queue load {load:.3f} >= load_threshold {workload.load_threshold}"
    if replica.waiting and replica.kv_usage >= workload.load_threshold:
        return (
            f"KV usage {replica.kv_usage:.3f} >= load_threshold {workload.load_threshold} "
            f"with {replica.waiting} requests waiting"
        )
    return None


class KvScoringPolicy:
    """Base of the level-3 strategies; subclasses define :meth:`score`."""

    name = "kv"

    def __init__(self, workload: KvAwareWorkload | KvCostWorkload, rng: random.Random) -> None:
        self.workload = workload
        self._rng = rng
        self._fallback = fallback_policy(workload, rng)

    def scores(
        self, ctx: RouteContext, replicas: list[ReplicaState], runs: dict[int, int]
    ) -> dict[int, float]:
        """Ordinal -> score (higher is better); ``runs`` holds leading runs in blocks."""
        raise NotImplementedError

    def without_hit(
        self,
        ctx: RouteContext,
        state: StateView,
        replicas: list[ReplicaState],
        runs: dict[int, int],
    ) -> ReplicaState | None:
        """A strategy's own choice for a prompt no candidate holds; ``None``: by score."""
        return None

    def select(self, ctx: RouteContext, state: StateView) -> Decision:
        runs = state.leading_runs(ctx.block_keys, now=ctx.now)
        if not runs and not state.has_residency():
            return self._fall_back(ctx, state)
        screened = screen(ctx, state, queue_saturation)
        if not screened.usable:
            return decide(self.name, screened, None)
        scores = self.scores(ctx, screened.usable, runs)
        chosen = self.without_hit(ctx, state, screened.usable, runs) or best(
            screened.usable, scores, self._rng
        )
        usable = screened.usable

        def rows() -> list[ReplicaReason]:
            return [self._row(ctx, r, runs.get(r.ordinal, 0), scores) for r in usable]

        return decide(self.name, screened, chosen, rows, speculative=self._speculate(ctx, chosen))

    def _row(
        self, ctx: RouteContext, replica: ReplicaState, held: int, scores: dict[int, float]
    ) -> ReplicaReason:
        hit = held / len(ctx.block_keys) if ctx.block_keys else 0.0
        return ReplicaReason(
            replica.ordinal,
            replica.replica_id,
            replica.load,
            None,
            held,
            hit,
            scores[replica.ordinal],
        )

    def _fall_back(self, ctx: RouteContext, state: StateView) -> Decision:
        decision = self._fallback.select(ctx, state)
        note = f"no residency data: fallback {decision.strategy}"
        if decision.note:
            note += f"; {decision.note}"
        speculative = self._speculate(ctx, decision.replica)
        return replace(decision, strategy=self.name, note=note, speculative=speculative)

    def _speculate(
        self, ctx: RouteContext, chosen: ReplicaState | None
    ) -> SpeculativeRecord | None:
        ttl = self.workload.speculative_ttl_s
        if chosen is None or ttl <= 0 or not ctx.block_keys:
            return None
        return SpeculativeRecord(chosen.ordinal, tuple(ctx.block_keys), ctx.now + ttl)
