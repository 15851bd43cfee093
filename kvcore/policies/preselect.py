"""Candidates for a scored decision without visiting every replica.

A strategy that scores replicas (``least_load``, ``kv_aware``, ``kv_cost``) chooses the
best score, ties to the lower load, then at random (:func:`~kvcore.policies.screening.best`).
Only two kinds of replica can win:

- a replica holding a leading run of the prompt (the residency index's ``leading_runs``
  lists them, at a cost that grows with the holders, not the fleet);
- the best replica holding none of it, whose score depends on its state alone: the
  least loaded (``kv_aware``, ``least_load``) or the least queued work at its prefill
  rate (``kv_cost``). :class:`~kvcore.policies.board.ReplicaBoard` keeps both orders.

:func:`candidates` returns those, plus every replica that could tie with them (the
non-holders within ``2 * TIE`` of the best one's score and load), in ordinal order, so
``best()`` over them makes exactly the decision it makes over the whole fleet, random
tie-breaks included. Each candidate is screened once (hard exclusions, saturation).
Which replicas are usable (the unsaturated ones, or every eligible one when all are
saturated) is decided from the front of the load order.

Views whose ``replicas()`` is a plain sequence get the whole-fleet screening, with the
same decisions; ``tests/unit/kvcore/test_preselect.py`` checks the two agree.
A strategy's non-holder order is part of its scoring: a strategy whose score of a
replica holding nothing stops being monotone in its order must change the order too.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from math import inf
from operator import attrgetter, itemgetter

from kvcore.policies.base import (
    Decision,
    Reasons,
    ReplicaReason,
    ReplicaState,
    RouteContext,
    SpeculativeRecord,
    StateView,
)
from kvcore.policies.board import ReplicaBoard
from kvcore.policies.screening import (
    ALL_SATURATED,
    NO_REPLICA,
    TIE,
    Saturation,
    Screened,
    hard_exclusion,
    saturation,
    screen_rows,
)

Rows = Callable[[list[ReplicaState]], Iterable[ReplicaReason]]  # usable -> their rows
_ordinal = attrgetter("ordinal")
_ordinal_of = itemgetter(2)  # of a queue entry


@dataclass(slots=True)
class Pool:
    """Which replicas may take the request: eligible, and unsaturated while any is."""

    ctx: RouteContext
    unsaturated_only: bool
    saturated_why: Saturation = saturation

    def admits(self, replica: ReplicaState) -> bool:
        ctx = self.ctx
        if hard_exclusion(replica, ctx) is not None:
            return False
        return not self.unsaturated_only or self.saturated_why(replica, ctx) is None


# A strategy's search among the usable replicas holding none of the prompt: (board, pool,
# runs, floor) -> the best of them and those that could tie with them, in any order;
# none if the best scores below ``floor``.
NonHolders = Callable[[ReplicaBoard, Pool, dict[int, int], float], list[ReplicaState]]


@dataclass(slots=True)
class Candidates:
    """What a scored decision chooses among, and what explains it afterwards.

    ``holders``: on a board, the usable replicas that hold a leading run of the prompt;
    otherwise every usable replica. :meth:`usable` adds the non-holders that can win.
    """

    holders: list[ReplicaState]  # ordinal order
    fleet: Sequence[ReplicaState]  # every known replica, ordinal order
    admits: Callable[[ReplicaState], bool]  # may a replica of ``fleet`` take it?
    note: str = ""
    screened: Screened | None = None  # the whole-fleet screening, when it was done
    ctx: RouteContext | None = None  # for screening ``fleet`` when reasons are read
    board: ReplicaBoard | None = None
    pool: Pool | None = None
    runs: dict[int, int] | None = None
    saturated_why: Saturation = saturation

    def usable(self, nonholders: NonHolders, floor: float) -> list[ReplicaState]:
        """The candidates, in ordinal order: the holders, and the non-holders that
        ``nonholders`` finds scoring ``floor`` or more."""
        board, pool, runs = self.board, self.pool, self.runs
        if board is None or pool is None or runs is None:
            return self.holders
        found = nonholders(board, pool, runs, floor)
        if not found:
            return self.holders
        return sorted([*self.holders, *found], key=_ordinal)


def candidates(
    ctx: RouteContext,
    state: StateView,
    runs: dict[int, int],
    saturated_why: Saturation = saturation,
) -> Candidates:
    """The usable holders of the prompt, or every usable replica on a plain fleet (see
    the module docstring); ``saturated_why`` as for :func:`~kvcore.policies.screening.screen`."""
    fleet = state.replicas()
    if type(fleet) is not ReplicaBoard:  # not isinstance: see ReplicaBoard
        screened = screen_rows(ctx, fleet, saturated_why)
        admitted = {r.ordinal for r in screened.usable}
        return Candidates(
            screened.usable, fleet, lambda r: r.ordinal in admitted, screened.note, screened
        )
    pool = usable_pool(ctx, fleet, saturated_why)
    if pool is None:
        return Candidates([], fleet.snapshot(), pool_admits_none, ctx=ctx)
    holders: list[ReplicaState] = []
    if runs:
        holders = [r for o in runs if (r := fleet.get(o)) is not None and pool.admits(r)]
        holders.sort(key=_ordinal)
    note = "" if pool.unsaturated_only else ALL_SATURATED
    snapshot = fleet.snapshot()
    return Candidates(
        holders, snapshot, pool.admits, note, None, ctx, fleet, pool, runs, saturated_why
    )


def pool_admits_none(replica: ReplicaState) -> bool:
    """The pool when no replica is eligible."""
    del replica
    return False


def usable_pool(
    ctx: RouteContext, board: ReplicaBoard, saturated_why: Saturation = saturation
) -> Pool | None:
    """Unsaturated replicas if any is eligible, else every eligible one; ``None``: none
    is eligible. Usually decided by the least loaded replica alone (every replica is read
    when all are saturated)."""
    for replica in board.by_load():
        if hard_exclusion(replica, ctx) is None and saturated_why(replica, ctx) is None:
            return Pool(ctx, True, saturated_why)
    if any(hard_exclusion(replica, ctx) is None for replica in board):
        return Pool(ctx, False, saturated_why)
    return None


def least_loaded(
    board: ReplicaBoard,
    pool: Pool,
    runs: dict[int, int],
    floor: float,
    score: Callable[[ReplicaState], float],
) -> list[ReplicaState]:
    """For a ``score`` of a replica holding nothing that falls as its load rises: the
    usable non-holder with the lowest load and those within ``2 * TIE`` of it (no other
    one scores higher, or ties at a lower load); none if it scores below ``floor``."""
    return _near_lowest_load(board.by_load(), pool, runs, lambda r: score(r) >= floor)


def _near_lowest_load(
    replicas: Iterable[ReplicaState],
    pool: Pool,
    runs: dict[int, int],
    wanted: Callable[[ReplicaState], bool] = bool,
) -> list[ReplicaState]:
    """Of ``replicas`` (lowest load first), the usable non-holders within ``2 * TIE`` of
    the first one's load; none unless that first one is ``wanted``."""
    found: list[ReplicaState] = []
    limit = inf
    for replica in replicas:
        load = replica.load
        if load > limit:
            break
        if replica.ordinal in runs or not pool.admits(replica):
            continue
        if not found:
            if not wanted(replica):
                break
            limit = load + 2 * TIE
        found.append(replica)
    return found


def cheapest_queues(
    board: ReplicaBoard,
    pool: Pool,
    runs: dict[int, int],
    floor: float,
    score: Callable[[ReplicaState], float],
) -> list[ReplicaState]:
    """For a ``score`` of a replica holding nothing that depends only on its
    :func:`~kvcore.policies.board.queue_kind` and queued work, and falls as that work
    grows: the best such usable replicas, those within ``2 * TIE`` of that score, and of
    each run of equal work only those within ``2 * TIE`` of the run's lowest load (the
    rest lose the tie to that one); none below ``floor``."""
    queues = [queue for _, queue in board.queues()]
    fronts = [next(_admitted_runs(board, pool, runs, queue), None) for queue in queues]
    floor = max([floor + 2 * TIE, *(score(front[0]) for front in fronts if front)]) - 2 * TIE
    found: list[ReplicaState] = []
    for queue in queues:
        for run in _admitted_runs(board, pool, runs, queue):
            if score(run[0]) < floor:
                break
            found += run
    return found


def _admitted_runs(
    board: ReplicaBoard, pool: Pool, runs: dict[int, int], queue: list[tuple[float, float, int]]
) -> Iterator[list[ReplicaState]]:
    """``queue``'s runs of equal work, lazily: of each, the usable non-holders within
    ``2 * TIE`` of the lowest load among them (runs with none are skipped)."""
    start = 0
    while start < len(queue):
        end = bisect_right(queue, (queue[start][0], inf, inf), lo=start)
        run = _near_lowest_load(map(board.at, map(_ordinal_of, queue[start:end])), pool, runs)
        if run:
            yield run
        start = end


def next_in_turn(
    fleet: Sequence[ReplicaState],
    turn: Sequence[ReplicaState],
    after: int | None,
    start: int,
) -> ReplicaState | None:
    """Round-robin over ``turn`` (some of ``fleet``'s replicas; both in ordinal order):
    the first after ordinal ``after``, wrapping, or from position ``start`` of the fleet
    when there is none."""
    if not turn or not fleet:
        return None
    if after is None:
        index = bisect_left(turn, fleet[start % len(fleet)].ordinal, key=_ordinal)
    else:
        index = bisect_right(turn, after, key=_ordinal)
    return turn[index % len(turn)]


def decision(
    strategy: str,
    found: Candidates,
    chosen: ReplicaState | None,
    rows: Rows,
    *,
    note: str = "",
    speculative: SpeculativeRecord | None = None,
) -> Decision:
    """A decision whose reasons (built only when read) list every replica once: the
    candidates were all that was needed to decide; an explanation screens the whole
    fleet as it was."""
    screened, ctx, fleet = found.screened, found.ctx, found.fleet

    def explain() -> list[ReplicaReason]:
        whole = screened
        if whole is None:
            assert ctx is not None
            whole = screen_rows(ctx, fleet, found.saturated_why)
        return [*whole.excluded, *rows(whole.usable)]

    def chosen_row() -> ReplicaReason | None:
        return None if chosen is None else next(iter(rows([chosen])), None)

    note = note or found.note
    if chosen is None:
        note = note or NO_REPLICA
    return Decision(chosen, strategy, Reasons(explain, chosen_row), note, speculative)
