"""Preselection: a view that keeps its fleet on a ReplicaBoard gets exactly the decisions
(chosen replica, random tie-breaks, notes, per-replica reasons) that screening and
scoring every replica gives, for every scored strategy."""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from kvcore.index import BitmaskResidencyIndex
from kvcore.policies import Decision, ReplicaState, RouteContext, StaticStateView, create_policy
from kvcore.policies.board import ReplicaBoard
from kvcore.workload import parse_workload

MODEL = "m"
PROMPT = tuple(range(1000, 1016))  # 16 block keys


class WholeFleetView:
    """The same state with a plain list: every replica is screened and scored."""

    def __init__(self, view: StaticStateView) -> None:
        self._view = view

    def replicas(self) -> Sequence[ReplicaState]:
        return list(self._view.board)

    def leading_runs(self, keys: Sequence[int], *, now: float | None) -> dict[int, int]:
        return self._view.leading_runs(keys, now=now)

    def placed_blocks(self, ordinal: int, *, now: float) -> int:
        return self._view.placed_blocks(ordinal, now=now)

    def has_residency(self) -> bool:
        return self._view.has_residency()

    def inflight(self) -> int:
        return self._view.inflight()


REPLICA = st.fixed_dictionaries(
    {
        "running": st.integers(0, 4),
        "waiting": st.integers(0, 2),
        "unreported": st.integers(0, 2),
        "kv_usage": st.sampled_from([0.0, 0.5, 0.9, 0.95]),
        "capacity": st.sampled_from([4, 8]),
        "healthy": st.sampled_from([True, True, True, False]),
        "draining": st.sampled_from([False, False, False, True]),
        "models": st.sampled_from([frozenset(), frozenset(), frozenset({"other"})]),
        "queued_prefill_tokens": st.sampled_from([None, None, 0.0, 2048.0]),
        "prefill_tokens_per_s": st.sampled_from([None, None, 4000.0]),
        "extra_step_s": st.sampled_from([0.0, 0.0, 0.0, 0.15]),
    }
)
WORKLOAD = st.fixed_dictionaries(
    {
        "strategy": st.sampled_from(["kv_aware", "kv_cost", "least_load"]),
        "load_threshold": st.sampled_from([0.5, 0.9, 1.0]),
        "max_inflight_per_replica": st.sampled_from([3, 1000]),
    },
    optional={
        "locality_weight": st.sampled_from([0.0, 0.5, 1.0]),
        "min_hit": st.sampled_from([0.0, 0.3]),
    },
)


def _workload(fields: dict[str, Any]) -> Any:
    if fields["strategy"] == "least_load":
        fields = {k: v for k, v in fields.items() if k not in ("locality_weight", "min_hit")}
    elif fields["strategy"] == "kv_cost":
        fields = {k: v for k, v in fields.items() if k != "min_hit"}
    return parse_workload(fields)


def _same(board: Decision, whole: Decision) -> None:
    headers = board.summary(), whole.summary()  # the chosen replica's row alone
    assert board.ordinal == whole.ordinal
    assert board.note == whole.note
    assert board.speculative == whole.speculative
    assert board.to_dict() == whole.to_dict()
    assert headers == (board.summary(), whole.summary())  # the same, from every row


@settings(max_examples=150, deadline=None)
@given(
    fields=WORKLOAD,
    replicas=st.lists(REPLICA, min_size=1, max_size=12),
    ordinals=st.lists(st.integers(0, 40), min_size=12, max_size=12, unique=True),
    held=st.dictionaries(st.integers(0, 11), st.integers(1, 16), max_size=5),
    exclude=st.frozensets(st.integers(0, 40), max_size=3),
    seed=st.integers(0, 3),
)
def test_a_board_decides_as_screening_every_replica_does(
    fields: dict[str, Any],
    replicas: list[dict[str, Any]],
    ordinals: list[int],
    held: dict[int, int],
    exclude: frozenset[int],
    seed: int,
) -> None:
    workload = _workload(fields)
    states = [ReplicaState(ordinals[i], f"r{ordinals[i]}", **row) for i, row in enumerate(replicas)]
    index = BitmaskResidencyIndex()
    index.add(ordinals[-1], [1])  # some residency exists
    for position, blocks in held.items():
        index.add(ordinals[position], PROMPT[:blocks])
    view = StaticStateView(states, index)
    whole = WholeFleetView(view)
    on_board = create_policy(workload, rng=random.Random(seed))
    on_list = create_policy(workload, rng=random.Random(seed))
    rng = random.Random(seed)
    for step in range(4):  # successive decisions: round-robin turns and loads move
        ctx = RouteContext(workload, MODEL, PROMPT, now=1.0, exclude=exclude)
        decided = on_board.select(ctx, view)
        _same(decided, on_list.select(ctx, whole))
        if decided.replica is not None:
            view.put(_busier(decided.replica, rng))
        if step == 1:
            prompt = tuple(range(9000 + 16 * step, 9016 + 16 * step))  # nobody holds it
            fresh = RouteContext(workload, MODEL, prompt, now=1.0, exclude=exclude)
            _same(on_board.select(fresh, view), on_list.select(fresh, whole))


def _busier(replica: ReplicaState, rng: random.Random) -> ReplicaState:
    return ReplicaState(
        replica.ordinal,
        replica.replica_id,
        models=replica.models,
        running=replica.running,
        waiting=replica.waiting,
        kv_usage=replica.kv_usage,
        unreported=replica.unreported + rng.randrange(2),
        capacity=replica.capacity,
        prefill_tokens_per_s=replica.prefill_tokens_per_s,
        queued_prefill_tokens=replica.queued_prefill_tokens,
        extra_step_s=replica.extra_step_s,
    )


@settings(max_examples=60, deadline=None)
@given(
    puts=st.lists(st.tuples(st.integers(0, 20), st.integers(0, 8), st.integers(0, 3)), max_size=40),
    drops=st.lists(st.integers(0, 20), max_size=6),
)
def test_a_board_keeps_its_orders_through_changes(
    puts: list[tuple[int, int, int]], drops: list[int]
) -> None:
    board = ReplicaBoard()
    truth: dict[int, ReplicaState] = {}
    for ordinal, running, waiting in puts:
        state = ReplicaState(ordinal, f"r{ordinal}", running=running, waiting=waiting, capacity=8)
        board.put(state)
        truth[ordinal] = state
    for ordinal in drops:
        board.discard(ordinal)
        truth.pop(ordinal, None)
    assert list(board) == [truth[o] for o in sorted(truth)]
    assert len(board) == len(truth)
    by_load = sorted(truth.values(), key=lambda r: (r.load, r.ordinal))
    assert list(board.by_load()) == by_load
    queued = [entry[2] for _, queue in board.queues() for entry in queue]
    assert sorted(queued) == sorted(truth)
    for _, queue in board.queues():
        assert queue == sorted(queue)
        assert all(truth[o].waiting + truth[o].unreported == work for work, _, o in queue)


_PUT = st.tuples(
    st.just("put"),
    st.integers(0, 12),  # ordinal
    st.integers(0, 8),  # running
    st.integers(0, 3),  # waiting
    st.sampled_from([None, 0.0, 500.0]),  # queued prefill tokens
    st.sampled_from([None, 2000.0]),  # prefill rate
    st.sampled_from(["serving", "draining", "down"]),
)


@settings(max_examples=80, deadline=None)
@given(
    steps=st.lists(
        st.one_of(_PUT, st.tuples(st.just("discard"), st.integers(0, 12)), st.just(("read",))),
        max_size=60,
    )
)
def test_a_board_keeps_the_orders_once_read_through_later_changes(
    steps: list[tuple[Any, ...]],
) -> None:
    """The orders are built when first read, then kept by every put and discard: read
    between any changes, they are the orders of the fleet as it is then (and the median
    of the serving replicas' waiting requests is theirs)."""
    board = ReplicaBoard()
    truth: dict[int, ReplicaState] = {}
    for step in steps:
        if step[0] == "put":
            _, ordinal, running, waiting, queued, rate, status = step
            state = ReplicaState(
                ordinal, f"r{ordinal}", running=running, waiting=waiting, capacity=8,
                prefill_tokens_per_s=rate, queued_prefill_tokens=queued,
                healthy=status != "down", draining=status == "draining",
            )  # fmt: skip
            board.put(state)
            truth[ordinal] = state
        elif step[0] == "discard":
            board.discard(step[1])
            truth.pop(step[1], None)
        else:
            _assert_orders(board, truth)
    _assert_orders(board, truth)


def _assert_orders(board: ReplicaBoard, truth: dict[int, ReplicaState]) -> None:
    assert list(board) == [truth[o] for o in sorted(truth)]
    assert list(board.by_load()) == sorted(truth.values(), key=lambda r: (r.load, r.ordinal))
    queues: dict[tuple[float | None, bool, float], list[tuple[float, float, int]]] = {}
    for state in truth.values():
        kind = (
            state.prefill_tokens_per_s,
            state.queued_prefill_tokens is not None,
            state.extra_step_s,
        )
        work = state.queued_prefill_tokens
        work = float(state.waiting + state.unreported) if work is None else work
        queues.setdefault(kind, []).append((work, state.load, state.ordinal))
    assert dict(board.queues()) == {kind: sorted(queue) for kind, queue in queues.items()}
    waiting = sorted(s.waiting for s in truth.values() if s.healthy and not s.draining)
    assert board.median_waiting() == (waiting[(len(waiting) - 1) // 2] if waiting else 0)


def _both(workload: Any, states: list[ReplicaState], held: dict[int, int]) -> Decision:
    index = BitmaskResidencyIndex()
    for ordinal, blocks in held.items():
        index.add(ordinal, PROMPT[:blocks])
    view = StaticStateView(states, index)
    ctx = RouteContext(workload, MODEL, PROMPT, now=1.0)
    decided = create_policy(workload, rng=random.Random(3)).select(ctx, view)
    _same(decided, create_policy(workload, rng=random.Random(3)).select(ctx, WholeFleetView(view)))
    return decided


def test_a_replica_holding_nothing_still_wins_or_ties_with_the_best_holder() -> None:
    """kv_aware, alpha 0.5: the holder of half the prompt at load 0.5 scores 0.5, as does
    an idle replica holding nothing; a hair more load on the holder loses it the tie."""
    workload = parse_workload(  # the score alone: no imbalance guard
        {"strategy": "kv_aware", "locality_weight": 0.5, "max_imbalance": None}
    )
    tied = [ReplicaState(0, "holder", running=128), ReplicaState(1, "idle", running=0)]
    assert _both(workload, tied, {0: 8}).replica_id == "idle"  # equal score: lower load
    busier = [ReplicaState(0, "holder", running=129), ReplicaState(1, "idle", running=1)]
    assert _both(workload, busier, {0: 8}).replica_id == "idle"
    lighter = [ReplicaState(0, "holder", running=126), ReplicaState(1, "idle", running=1)]
    assert _both(workload, lighter, {0: 8}).replica_id == "holder"


def test_kv_cost_compares_queues_at_each_replicas_own_rate() -> None:
    """Two rates, two ways of counting the queue: the shortest predicted wait wins."""
    workload = parse_workload({"strategy": "kv_cost"})
    states = [
        ReplicaState(0, "slow-short", waiting=1, prefill_tokens_per_s=2000.0),
        ReplicaState(1, "fast-long", waiting=4, prefill_tokens_per_s=64000.0),
        ReplicaState(2, "reported", queued_prefill_tokens=9000.0),
        ReplicaState(3, "holder", waiting=6),
    ]
    assert _both(workload, states, {3: 16}).replica_id == "fast-long"
