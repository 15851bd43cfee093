"""Level 3, the brief's score: ``alpha * hit + (1 - alpha) * (1 - load)``, highest wins.

``hit`` is the share of the prompt's blocks in the replica's leading run (counted as 0
below the workload's ``min_hit``, so that a prefix every prompt shares does not pull
all traffic to its first holder); ``alpha`` is the workload's ``locality_weight``.
Replicas at or over the load threshold are skipped unless every replica is; ties go to
the lower load, then at random. A scored choice with more than ``max_imbalance`` requests
beyond the least busy usable replica goes to that one instead (SGLang's
``balance_abs_threshold``): when one prefix makes most of every prompt (a long system
prompt), ``min_hit`` cannot discount it, and the score kept a burst of 200 such requests
on its first holder while the other replica idled (``kvroute up``, two replicas: 53% longer
than round-robin's, each token 55% slower); sent one request, the other replica holds the
prefix too (speculatively at once) and the loads share the rest. Sixty-four requests
is still a long way to run ahead where engines have hundreds of seats: one system prompt
before every request stayed on three replicas of eight (``bench.sim``'s
``one_system_prompt``, 0.070 s mean TTFT against round-robin's 0.037 s). So a *hot*
prefix moves sooner: when the prefix the chosen holder has of the prompt draws enough of
this router's recent requests to fill ``HOT_REPLICAS`` replicas' fair share
(:class:`~kvcore.policies.kv_scoring.PrefixHeat`), more than ``hot_prefix_gap``
requests beyond the least busy usable replica are enough (0.049 s there; a prefix that
hot is cheap to replicate, as a replica pays its prefill once, where a prefix among
many, as in the other scenarios, never counts as hot and stays where its cache is).

When no candidate holds a counted hit (a new prompt, or one whose shared part is below
``min_hit``), the score is load alone, and load is only as fresh as the engines' last
report: ranking every such request by it sends a report period's new prompts to the
replica that last reported least (herding: 6.6x round-robin's mean TTFT on a no-reuse
workload in ``bench.sim``; the power of two choices still measured 2.4x). Such a request
instead goes to the next unsaturated candidate in turn (round-robin, which needs no fresh
load), skipping any this router sent more than one such prompt's worth of blocks beyond
the least-sent candidate lately (its unexpired speculative entries, kept for
``speculative_ttl_s``). The turn alone spreads new prefixes evenly only if nothing else
places them: blind to what the cold-start fallback had placed, it left one replica of
``bench.e2e`` with 5-6 of the 16 groups while another had 2-3, and the crowded one
evicted (83-86% hit rate, where 89.3% means only each group's first request missed).
Counting what was sent, whatever chose it, keeps the spread within about a prefix, as
SGLang's ``cache_aware`` does by placing a new prefix on its smallest tree; the slack of
one prompt keeps the turn's even spacing on a no-reuse workload (choosing the least-sent
outright cost 1.5% of TTFT there and 13% of multi-turn throughput in ``bench.sim``).
With the default ``least_load`` fallback this rule also places new prompts before the
first engine event (``places_cold_prompts``): least_load would rank them by the previous
phase's stale loads, and sent 4 of ``bench.e2e``'s first 6 groups to one replica.
Confirmed residency is not counted: engines keep their caches full, so it would measure
their capacity, not what is free, and send every new prefix to the smallest cache.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from math import inf
from operator import attrgetter
from typing import ClassVar

from kvcore.policies.base import (
    Decision,
    Reasons,
    ReplicaReason,
    ReplicaState,
    RouteContext,
    StateView,
)
from kvcore.policies.board import ReplicaBoard
from kvcore.policies.kv_scoring import (
    KvScoringPolicy,
    cold_note,
    least_busy,
    queue_saturation,
    queue_screened,
    queue_usable,
)
from kvcore.policies.preselect import Candidates, Pool, least_loaded, next_in_turn
from kvcore.policies.screening import ALL_SATURATED, NO_REPLICA, TIE, best_of, screen_rows
from kvcore.workload import KvAwareWorkload

_ordinal = attrgetter("ordinal")


class KvAwarePolicy(KvScoringPolicy):
    """Weighted sum of cache hit and spare capacity."""

    name: ClassVar[str] = "kv_aware"

    def __init__(self, workload: KvAwareWorkload, rng: random.Random) -> None:
        super().__init__(workload, rng)
        self.aware = workload
        self._turn = rng.randrange(1 << 16)  # proxies start at different replicas
        self._last: int | None = None  # the replica of the last such turn
        self.places_cold_prompts = workload.fallback == "least_load"
        self._cold_notes = {note: cold_note(self.name, note) for note in ("", ALL_SATURATED)}

    def select(self, ctx: RouteContext, state: StateView) -> Decision:
        """:meth:`select_scored`'s decision, by a shortcut in the two usual cases (no
        Candidates or Pool per request; tests/unit/kvcore/test_kv_shortcuts.py
        compares them): a prompt without keys, and a prompt some usable replica holds a
        counted hit of while some replica is unsaturated (:meth:`_by_hit`)."""
        keys = ctx.block_keys
        if not keys:
            return self._keyless(ctx, state)
        runs = state.leading_runs(keys, now=ctx.now)
        if runs:
            fleet = state.replicas()
            if type(fleet) is ReplicaBoard:  # not isinstance: see ReplicaBoard
                decided = self._by_hit(ctx, state, fleet, runs)
                if decided is not None:
                    return decided
        return self.decide(ctx, state, runs)

    def _by_hit(
        self, ctx: RouteContext, state: StateView, board: ReplicaBoard, runs: dict[int, int]
    ) -> Decision | None:
        """The scored decision among the usable holders and the best non-holders (as
        :mod:`~kvcore.policies.preselect` finds them), each replica screened once by
        :func:`queue_usable`; ``None`` (the general path decides) when no usable holder
        has a counted hit (a new prompt, or no replica usable). Holders are scored as
        :meth:`scores` scores them in the same pass, and non-holders are looked for only
        when the board has one (usually every replica holds a shared prefix)."""
        aware, get = self.aware, board.get
        blocks = len(ctx.block_keys)
        alpha, min_hit = aware.locality_weight, aware.min_hit
        floor = max(min_hit * blocks, 1)
        holders: list[ReplicaState] = []
        values: list[float] = []
        counted = False
        on_board = 0
        for ordinal in sorted(runs):
            replica = get(ordinal)
            if replica is None:
                continue
            on_board += 1
            if queue_usable(replica, ctx):
                held = runs[ordinal]
                counted = counted or held >= floor
                hit = held / blocks
                if hit < min_hit:
                    hit = 0.0
                holders.append(replica)
                values.append(alpha * hit + (1 - alpha) * (1 - replica.load))
        if not counted:
            return None  # a new prompt: the turn (or nobody usable: the general path)
        usable = holders
        if on_board < len(board):  # some replica holds none of the prompt
            rivals = self._best_nonholders(ctx, board, runs, max(values) - 2 * TIE)
            if rivals:
                usable = sorted([*holders, *rivals], key=_ordinal)
                scores = self.scores(ctx, usable, runs)
                values = [scores[r.ordinal] for r in usable]
        fleet = board.snapshot()
        chosen = best_of(usable, values, self._rng)
        chosen, note = self.rebalance(ctx, state, fleet, chosen, runs)
        reasons = self._reasons(ctx, fleet, chosen, runs)
        return Decision(chosen, self.name, reasons, note, self._speculate(ctx, chosen))

    def rebalance(
        self,
        ctx: RouteContext,
        state: StateView,
        fleet: Sequence[ReplicaState],
        chosen: ReplicaState,
        runs: dict[int, int],
    ) -> tuple[ReplicaState, str]:
        """The hot prefix's move (:meth:`KvScoringPolicy.rebalance`), else ``chosen``
        unless it has more than ``max_imbalance`` requests beyond the least busy usable
        replica (fewest requests, then load, then ordinal), which then takes the request;
        its prefix is speculated there too, so the next requests see two holders and
        their loads decide. Free below ``max_imbalance`` requests."""
        moved, note = super().rebalance(ctx, state, fleet, chosen, runs)
        limit = self.aware.max_imbalance
        if note or limit is None or chosen.requests <= limit:
            return moved, note
        least = least_busy(ctx, fleet)
        if least is None or chosen.requests - least.requests <= limit:
            return chosen, ""
        return least, (
            f"imbalance: {chosen.replica_id} had {chosen.requests} requests, "
            f"{least.replica_id} {least.requests} (max_imbalance {limit})"
        )

    def _best_nonholders(
        self, ctx: RouteContext, board: ReplicaBoard, runs: dict[int, int], floor: float
    ) -> list[ReplicaState]:
        """:meth:`nonholders` when every unsaturated replica is usable."""
        found: list[ReplicaState] = []
        limit = inf
        for replica in board.by_load():
            load = replica.load
            if load > limit:
                break
            if replica.ordinal in runs or not queue_usable(replica, ctx):
                continue
            if not found:
                if not self.nonholder_score(ctx, replica) >= floor:
                    break
                limit = load + 2 * TIE
            found.append(replica)
        return found

    def _keyless(self, ctx: RouteContext, state: StateView) -> Decision:
        """A prompt shorter than a block has no keys: nobody holds it and nothing is
        speculated, so it goes straight to the turn (:meth:`without_hit`), each replica
        screened once, with no holder lookup, no candidates and no scores."""
        cold = not state.has_residency()
        if cold and not self.places_cold_prompts:
            return self._fall_back(ctx, state)
        fleet = state.replicas()
        snapshot = fleet.snapshot() if type(fleet) is ReplicaBoard else tuple(fleet)
        usable, note = queue_screened(ctx, snapshot)
        chosen = None
        if usable:
            now, placed_blocks = ctx.now, state.placed_blocks
            placed = [placed_blocks(r.ordinal, now=now) for r in usable]
            chosen = self._take_turn(snapshot, usable, placed, 0)
        if cold:
            note = self._cold_notes[note]
        elif chosen is None:
            note = note or NO_REPLICA
        return Decision(chosen, self.name, self._reasons(ctx, snapshot, chosen, {}), note)

    def _reasons(
        self,
        ctx: RouteContext,
        fleet: Sequence[ReplicaState],
        chosen: ReplicaState | None,
        runs: dict[int, int],
    ) -> Reasons:
        """A shortcut's reasons, built when read, as :meth:`select_scored` gives them:
        the whole fleet screened as it was, each usable replica scored."""

        def explain() -> list[ReplicaReason]:
            whole = screen_rows(ctx, fleet, queue_saturation)
            return [*whole.excluded, *self._rows(ctx, whole.usable, runs)]

        def chosen_row() -> ReplicaReason | None:
            return None if chosen is None else self._rows(ctx, [chosen], runs)[0]

        return Reasons(explain, chosen_row)

    def _rows(
        self, ctx: RouteContext, replicas: list[ReplicaState], runs: dict[int, int]
    ) -> list[ReplicaReason]:
        table = self.scores(ctx, replicas, runs)
        return [self._row(ctx, r, runs.get(r.ordinal, 0), table) for r in replicas]

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

    def nonholder_score(self, ctx: RouteContext, replica: ReplicaState) -> float:
        """:meth:`scores` of a replica holding none of the prompt (a hit of 0), the same
        float without building a list and a table for it."""
        return (1 - self.aware.locality_weight) * (1 - replica.load)

    def nonholders(
        self, board: ReplicaBoard, pool: Pool, runs: dict[int, int], floor: float
    ) -> list[ReplicaState]:
        ctx = pool.ctx  # a non-holder's score falls as its load rises
        return least_loaded(board, pool, runs, floor, lambda r: self.nonholder_score(ctx, r))

    def without_hit(
        self,
        ctx: RouteContext,
        state: StateView,
        found: Candidates,
        runs: dict[int, int],
    ) -> ReplicaState | None:
        """For a prompt no candidate holds a counted hit of: the next usable replica in
        turn (ordinal order) not sent much more than the others lately; ``None`` when some
        candidate has a hit."""
        blocks = len(ctx.block_keys)
        floor = max(self.aware.min_hit * blocks, 1) if blocks else 1
        if found.holders and any(runs.get(r.ordinal, 0) >= floor for r in found.holders):
            return None
        # blocks this router sent each usable replica lately (every usable replica: a
        # prompt nobody holds costs a look at each), in one pass over the fleet
        now, placed_blocks, admits = ctx.now, state.placed_blocks, found.admits
        usable: list[ReplicaState] = []
        placed: list[int] = []
        for replica in found.fleet:
            if admits(replica):
                usable.append(replica)
                placed.append(placed_blocks(replica.ordinal, now=now))
        if not usable:
            return None
        return self._take_turn(found.fleet, usable, placed, blocks)

    def _take_turn(
        self,
        fleet: Sequence[ReplicaState],
        usable: list[ReplicaState],
        placed: list[int],
        blocks: int,
    ) -> ReplicaState | None:
        """The next of ``usable`` (of ``fleet``; ``placed``: the blocks sent each lately)
        in turn, skipping any sent more than ``blocks`` beyond the least-sent one."""
        turn = usable  # usually every one is within it: all sent as much (no min, no max)
        if placed.count(placed[0]) != len(placed):
            limit = min(placed) + blocks  # within one prompt of the least-sent one
            if max(placed) > limit:
                turn = [r for r, sent in zip(usable, placed, strict=True) if sent <= limit]
        chosen = next_in_turn(fleet, turn, self._last, self._turn + 1)
        if chosen is not None:
            self._last = chosen.ordinal
        return chosen
