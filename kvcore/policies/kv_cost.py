"""Level 3 in time, the default: the replica where this request is served soonest,
counting what its cache saves and what the request waits for.

    cost(r)    = (1 - alpha) * wait(r) + alpha * (1 + behind) * prefill(r)   lowest wins
    wait(r)    = queued(r) / rate(r)              seconds until the step it would join on r
    prefill(r) = uncached(r) / rate(r) + step(r)  seconds r spends prefilling what it lacks
    behind     = median(waiting)                  requests the engines report waiting
                                                  (on the replicas it may choose)

- ``alpha`` is the workload's ``locality_weight``: 0.5 ranks by the plain predicted time
  to first token; above it a second of recomputation weighs ``alpha / (1 - alpha)``
  seconds of queue (0.8: 4), since a miss also delays the requests that come after it
  and takes cache room from the prefixes already there; 1 ranks by the cache alone, 0
  by the queue alone. It is the brief's ``alpha * hit + (1 - alpha) * (1 - load)`` with
  hit and load measured in seconds.
- ``behind``: a second a replica spends prefilling is a second for each request that
  queues behind it too. On a fleet that keeps up nothing waits and the weights are
  alpha's; on one at its capacity every engine has a queue, the cache is what capacity
  there is to win, and a second of recomputation weighs ``1 + behind`` times more. The
  median of the replicas' waiting requests as their engines report them: the same for
  every proxy of a fleet, and one replica's backlog does not make recomputing on an
  idle one look dear (the mean did). Only the replicas the request may go to count: a
  P/D prefill's choice excludes the decode replicas, whose requests waiting for their KV
  are no queue a recomputed prefill lengthens. Without it the default lost RAG to llm-d's model
  by 3.6x in bench sim (3.5 s mean TTFT against 0.98 s) and the Mooncake trace at 5x
  compression to SGLang's by 1.7x: each miss on a busy fleet lengthened the queues,
  which made the next misses look cheaper still.
- ``queued(r)``: prefill work ahead of the request, in prompt tokens — this router's
  prefill books (:mod:`kvcore.policies.prefill`: the uncached tokens of its requests to
  r with no first token yet, and what remains of the time around the step that
  prefills them, less what r has done since) when the caller keeps them, else (waiting
  + sent since r's last load report) times ``queued_request_tokens``. A request sent
  there joins the step after theirs (an engine admits every waiting request at a step,
  and each first token of that step waits for the whole of its prefill): drained by
  the tokens alone, a replica read idle in the middle of that step and drew the next
  request, a fifth of bench sim's ``one_system_prompt`` (42 ms mean TTFT against 35).
- ``uncached(r)``: this prompt's tokens beyond r's leading run of cached blocks.
- ``step(r)``: how much longer than the fleet's typical replica each engine step that
  prefills takes on r (``ReplicaState.extra_step_s``, learned from first tokens:
  :meth:`~kvcore.policies.prefill.PrefillRates.step_s`); 0 but on a replica ranked
  slower. An engine prefills inside a step that also decodes every running request, so
  a replica ten times slower spends ten times the typical step on each prefill, however
  few tokens it lacks, and every request queued there waits for it: the step is
  prefill time, weighed as such. Without it a chat whose history the slow replica held
  stayed there (a 20-token turn cost 20 ms at its rate, where its steps took 150 ms
  more), and it kept 11-13% of bench sim's ShareGPT-length chats, its share being 3%.
- saturation is counted by requests only (:func:`~kvcore.policies.kv_scoring.request_saturation`):
  an engine whose KV cache is full of running requests, with some waiting for room, has
  a longer wait, not a reason to send the prefix it holds elsewhere.
- ``rate(r)``: r's prefill tokens per second, learned from the first tokens this router
  timed (:class:`~kvcore.policies.prefill.PrefillRates`), else ``prefill_tokens_per_s``.

Around the cost, what every level-3 strategy keeps (:mod:`kvcore.policies.kv_scoring`):
a prompt no replica holds goes to the next replica in turn (new prefixes spread evenly,
as no stale load can), and so does one every usable replica is equally cheap for (a
system prompt all of them hold, under a new conversation: :meth:`KvCostPolicy.best`;
ties among some replicas only go to the lower load, then at random); a hot prefix (one
system prompt before every request) is counted as held by every usable replica once its
holder runs ``hot_prefix_gap`` requests ahead of the least busy one, so it replicates
where the wait is shortest; ``max_imbalance`` requests ahead, the least busy replica
takes the request whatever the cost. Decisions carry ``score = -cost`` in seconds, and
the explain endpoint each replica's wait, prefill and rate.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from math import inf
from operator import attrgetter
from typing import ClassVar

from kvcore.policies.base import Decision, ReplicaReason, ReplicaState, RouteContext, StateView
from kvcore.policies.board import ReplicaBoard, median_waiting
from kvcore.policies.kv_scoring import (
    HELD,
    KvScoringPolicy,
    Runs,
    Scores,
    request_saturation,
    request_usable,
)
from kvcore.policies.preselect import Pool, cheapest_queues, usable_pool
from kvcore.policies.screening import TIE, best, best_tied
from kvcore.workload import KvCostWorkload


class KvCostPolicy(KvScoringPolicy):
    """Lowest weighted time: prefill saved by the cache against the wait."""

    name: ClassVar[str] = "kv_cost"

    def __init__(self, workload: KvCostWorkload, rng: random.Random) -> None:
        super().__init__(workload, rng)
        self.cost = workload
        self.saturated_why = request_saturation
        self.usable = request_usable
        self.behind = 0.0  # the fleet's median requests waiting, as of this decision

    def decide(self, ctx: RouteContext, state: StateView, runs: dict[int, int]) -> Decision:
        fleet, exclude = state.replicas(), ctx.exclude
        if exclude:  # e.g. a P/D prefill's: the decode replicas' waits are not its queues
            fleet = [r for r in fleet if r.ordinal not in exclude]
        self.behind = float(median_waiting(fleet))
        return super().decide(ctx, state, runs)

    def scores(
        self, ctx: RouteContext, replicas: list[ReplicaState], runs: dict[int, int]
    ) -> dict[int, float]:
        return {r.ordinal: -self.cost_s(ctx, r, runs.get(r.ordinal, 0)) for r in replicas}

    def cost_s(self, ctx: RouteContext, replica: ReplicaState, held_blocks: int) -> float:
        """``(1 - alpha) * wait + alpha * (1 + behind) * prefill`` on ``replica``, in
        seconds."""
        wait, prefill = self.times_s(ctx, replica, held_blocks)
        return (1 - self.cost.locality_weight) * wait + self.prefill_weight() * prefill

    def prefill_weight(self) -> float:
        """What a second of this prompt's prefill weighs: ``alpha * (1 + behind)``."""
        return self.cost.locality_weight * (1.0 + self.behind)

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
        return queued / rate, uncached / rate + replica.extra_step_s

    def predicted_ttft_s(self, ctx: RouteContext, replica: ReplicaState, held_blocks: int) -> float:
        """Seconds until ``replica`` would start decoding this prompt (wait + prefill)."""
        return sum(self.times_s(ctx, replica, held_blocks))

    def nonholders(
        self, board: ReplicaBoard, pool: Pool, runs: dict[int, int], floor: float
    ) -> list[ReplicaState]:
        ctx = pool.ctx  # a non-holder's cost grows with its queue at its rate
        return cheapest_queues(board, pool, runs, floor, lambda r: self.nonholder_score(ctx, r))

    def best(
        self,
        ctx: RouteContext,
        fleet: Sequence[ReplicaState],
        usable: Sequence[ReplicaState],
        scores: Scores,
    ) -> ReplicaState:
        """The best-scored of ``usable`` (of ``fleet``). When every usable replica of
        ``fleet`` scores the same, the next in this router's turn, as a prompt no replica
        holds goes (:meth:`without_hit`, from the router's place: :meth:`take_place`);
        when only some do, the lower load, then at random.

        Every replica scores the same where each holds the same leading run of the
        prompt and this router knows of no work queued on any (a chat's system prompt,
        held everywhere, under each conversation's first turn): to this router the
        request is then a new prompt. The lower load, each engine's last report (up to
        a report period old, and the same for every router until the next), told them
        apart instead, and eight proxies behind a round-robin balancer onto four
        replicas sent the busiest 1.17-1.58x the mean share of a 48-conversation chat
        in real processes (each router saw only its own sends between reports; kv_aware,
        whose ``min_hit`` makes those first turns new prompts, spread them 1.00x). Among
        some replicas only (those holding a prefix the others lack), the load stays: the
        turn there spread each prefix over all its holders, which cost bench sim's
        ``e2e_shared_prefix`` behind 8 routers 1.4 and 1.2 points of hit rate at seeds 2
        and 3 (mean TTFT 0.062 -> 0.085 s, 0.056 -> 0.069 s)."""
        tied = best_tied(usable, [scores[r.ordinal] for r in usable])
        if len(tied) == 1:
            return tied[0]
        everyone = sum(1 for r in fleet if self.usable(r, ctx))
        if len(tied) < everyone or not everyone:  # some, or all saturated: the load
            return best(tied, scores, self._rng)
        tied.sort(key=attrgetter("ordinal"))
        chosen = self._next_in_turn(fleet, tied)
        assert chosen is not None
        return chosen

    def hot_target(
        self,
        ctx: RouteContext,
        chosen: ReplicaState,
        least: ReplicaState,
        fleet: Sequence[ReplicaState],
        runs: Runs,
    ) -> ReplicaState:
        """The cheapest usable replica with the hot prefix (``runs[HELD]`` blocks)
        counted as held by each: it is, one prefill after it is sent there. Ties go to
        the lower load, then at random; but where every candidate holds the prefix
        already, ``chosen`` keeps it when it is as cheap as any (the scores are those it
        was chosen by, among equals by this router's turn: moved to the lower load, a
        report old, a new conversation under a chat's system prompt went where every
        router's went). On a board, only ``chosen``, the replicas holding more and the least
        queued of the rest are scored."""
        held = runs[HELD]
        if type(fleet) is ReplicaBoard:  # not isinstance: see ReplicaBoard
            pool = usable_pool(ctx, fleet, request_saturation)
            longer = {o: n for o, n in runs.items() if n > held and o != HELD}
            rest = [] if pool is None else self._cheapest_at(ctx, fleet, pool, longer, held)
            usable = [r for o in longer if (r := fleet.at(o)) and request_usable(r, ctx)]
            usable += rest
            if request_usable(chosen, ctx) and all(r.ordinal != chosen.ordinal for r in usable):
                usable.append(chosen)  # it holds the prefix: it keeps it if as cheap
        else:
            usable = [r for r in fleet if request_usable(r, ctx)]
        hot = {r.ordinal: max(runs.get(r.ordinal, 0), held) for r in usable}
        if not usable:
            return least
        scores = self.scores(ctx, usable, hot)
        top = best(usable, scores, self._rng)
        if any(runs.get(r.ordinal, 0) < held for r in usable):
            return top  # the prefix counted where it is not: new rivals, the load decides
        return chosen if scores.get(chosen.ordinal, -inf) >= scores[top.ordinal] - TIE else top

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
        row.extra_step_s = replica.extra_step_s or None
        row.prefill_weight = self.prefill_weight()
        return row
