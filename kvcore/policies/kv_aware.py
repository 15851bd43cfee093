"""Level 3, the brief's score: ``alpha * hit + (1 - alpha) * (1 - load)``, highest wins.

- ``hit``: the share of the prompt's blocks in the replica's leading run, counted as 0
  below ``min_hit`` (a prefix every prompt shares would pull all traffic to its first
  holder); ``alpha``: the workload's ``locality_weight``; ``load``: the replica's
  requests per seat (:class:`~kvcore.policies.base.ReplicaState`).
- Replicas at or over ``load_threshold`` are skipped unless every replica is; ties go to
  the lower load, then at random.
- A prompt no usable replica holds a counted hit of goes to the next replica in turn,
  skipping any this router sent more than one such prompt beyond the least-sent lately
  (:meth:`~kvcore.policies.kv_scoring.KvScoringPolicy.without_hit`): loads are only as
  fresh as the engines' last report, and ranking new prompts by them herds a report
  period's worth onto one replica.
- A hot prefix moves to the least busy replica past ``hot_prefix_gap`` requests, and any
  choice past ``max_imbalance`` requests beyond the least busy replica goes to it
  (:meth:`~kvcore.policies.kv_scoring.KvScoringPolicy.rebalance`): one prefix that is
  most of every prompt would otherwise keep a few replicas busy while the rest idle.

The default workload's strategy is ``kv_cost``, the same rules with the score in time.
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
    queue_saturation,
    queue_screened,
    queue_usable,
)
from kvcore.policies.preselect import Pool, least_loaded
from kvcore.policies.screening import ALL_SATURATED, NO_REPLICA, TIE, best_of, screen_rows
from kvcore.workload import KvAwareWorkload

_ordinal = attrgetter("ordinal")


class KvAwarePolicy(KvScoringPolicy):
    """Weighted sum of cache hit and spare capacity."""

    name: ClassVar[str] = "kv_aware"

    def __init__(self, workload: KvAwareWorkload, rng: random.Random) -> None:
        super().__init__(workload, rng)
        self.aware = workload
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
        chosen, note = self.rebalance(ctx, state, best_of(usable, values, self._rng), runs)
        reasons = self._reasons(ctx, fleet, chosen, runs)
        return Decision(chosen, self.name, reasons, note, self._speculate(ctx, chosen))

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
