"""A fleet kept in the orders routing searches, updated one replica at a time.

A routing decision that screened and scored every replica cost time linear in the fleet
(kv_aware: 25 us at 8 replicas, 437 us at 512). The best replica that holds none of a
prompt is the least loaded one (kv_aware, least_load) or the one with the least queued
work at its prefill rate (kv_cost); only the replicas that hold a prefix, found by the
residency index, need a score of their own. :class:`ReplicaBoard` keeps those orders
sorted as states change (one :meth:`~ReplicaBoard.put` per changed replica, O(log n)
searches and a small memmove), so a decision reads a few entries from their front
instead of visiting every replica (:mod:`kvcore.policies.preselect`).

It keeps one figure of the whole fleet too, the median of the requests the engines
report waiting (:meth:`ReplicaBoard.median_waiting`), which ``kv_cost`` weighs a
recomputation by.

A board is also the fleet itself: a ``Sequence[ReplicaState]`` in ordinal order, what
``StateView.replicas()`` returns. Views that return one get the preselecting path;
any other sequence gets the plain screening of every replica, with the same decisions.
"""

from __future__ import annotations

from bisect import bisect_left, insort
from collections.abc import Iterable, Iterator, Sequence
from typing import overload

from kvcore.policies.base import ReplicaState

# (announced prefill rate, queued tokens reported, extra step seconds)
QueueKind = tuple[float | None, bool, float]
QueueEntry = tuple[float, float, int]  # (queued work, load, ordinal)


def queue_kind(replica: ReplicaState) -> QueueKind:
    """Replicas whose queued work compares in one unit: same prefill rate and step time,
    and queued tokens either reported by the engine or counted in requests."""
    rate, queued = replica.prefill_tokens_per_s, replica.queued_prefill_tokens
    return rate, queued is not None, replica.extra_step_s


def queued_work(replica: ReplicaState) -> float:
    """Reported queued prompt tokens, else requests waiting or not yet reported."""
    queued = replica.queued_prefill_tokens
    return queued if queued is not None else float(replica.waiting + replica.unreported)


class ReplicaBoard(Sequence[ReplicaState]):
    """Replicas by ordinal, by load, and by queued work per :func:`queue_kind`.

    Each sorted order is built when first read and kept from then on: a proxy puts a
    replica or two per request under load (its in-flight count changed), and a strategy
    that never reads an order (``round_robin`` reads none, ``kv_aware`` no queue) does
    not pay for keeping it.

    Tell a board from another sequence by ``type(x) is ReplicaBoard``, not
    ``isinstance``: compiled by mypyc (``dataplane/native.py``), this class shares
    ``Sequence``'s ABC registry, so ``isinstance((), ReplicaBoard)`` is true (and a list
    was taken for a board in tests/unit/kvcore/test_preselect.py).
    """

    __slots__ = ("_by_load", "_ordinals", "_queues", "_rows", "_snapshot", "_states", "_waiting")

    def __init__(self, replicas: Iterable[ReplicaState] = ()) -> None:
        states = {r.ordinal: r for r in replicas}
        self._states = states
        self._ordinals = sorted(states)
        self._rows = [states[o] for o in self._ordinals]
        self._by_load: list[tuple[float, int]] | None = None  # built when first read
        self._queues: dict[QueueKind, list[QueueEntry]] | None = None  # likewise
        self._snapshot: tuple[ReplicaState, ...] | None = None
        # requests waiting on each serving replica, in order (kv_cost's median_waiting)
        self._waiting = sorted(r.waiting for r in self._rows if _serving(r))

    def put(self, replica: ReplicaState) -> None:
        """Add ``replica`` or replace the state of its ordinal."""
        ordinal = replica.ordinal
        old = self._states.get(ordinal)
        if old is None:
            position = bisect_left(self._ordinals, ordinal)
            self._ordinals.insert(position, ordinal)
            self._rows.insert(position, replica)
        else:
            self._rows[bisect_left(self._ordinals, ordinal)] = replica
        self._states[ordinal] = replica
        self._snapshot = None
        if old is not None and _serving(old):
            del self._waiting[bisect_left(self._waiting, old.waiting)]
        if _serving(replica):
            insort(self._waiting, replica.waiting)
        by_load = self._by_load
        if by_load is not None and (old is None or old.load != replica.load):
            if old is not None:
                del by_load[bisect_left(by_load, (old.load, ordinal))]
            insort(by_load, (replica.load, ordinal))
        if self._queues is not None:
            if old is not None:
                self._unqueue(old)
            insort(self._queues.setdefault(queue_kind(replica), []), _queue_entry(replica))

    def discard(self, ordinal: int) -> None:
        """Forget ``ordinal``; unknown ordinals are ignored."""
        old = self._states.get(ordinal)
        if old is None:
            return
        position = bisect_left(self._ordinals, ordinal)
        del self._ordinals[position], self._rows[position], self._states[ordinal]
        self._snapshot = None
        if _serving(old):
            del self._waiting[bisect_left(self._waiting, old.waiting)]
        if self._by_load is not None:
            del self._by_load[bisect_left(self._by_load, (old.load, ordinal))]
        if self._queues is not None:
            self._unqueue(old)

    def get(self, ordinal: int) -> ReplicaState | None:
        return self._states.get(ordinal)

    def at(self, ordinal: int) -> ReplicaState:
        """The state of ``ordinal``, which must be on the board."""
        return self._states[ordinal]

    def snapshot(self) -> tuple[ReplicaState, ...]:
        """The fleet as it is now, for explanations built after it has changed."""
        if self._snapshot is None:
            self._snapshot = tuple(self._rows)
        return self._snapshot

    def median_waiting(self) -> int:
        """The (lower) median of the requests the engines of the healthy, undrained
        replicas report waiting; 0 without any."""
        waiting = self._waiting
        return waiting[(len(waiting) - 1) // 2] if waiting else 0

    def by_load(self) -> Iterator[ReplicaState]:
        """Lowest load first (then lowest ordinal)."""
        by_load = self._by_load
        if by_load is None:
            by_load = self._by_load = sorted((r.load, r.ordinal) for r in self._rows)
        states = self._states
        return (states[ordinal] for _, ordinal in by_load)

    def queues(self) -> Iterator[tuple[QueueKind, list[QueueEntry]]]:
        """Each :func:`queue_kind`'s entries, least queued work first, then lowest load;
        read-only."""
        queues = self._queues
        if queues is None:
            queues = self._queues = {}
            for replica in self._rows:
                queues.setdefault(queue_kind(replica), []).append(_queue_entry(replica))
            for queue in queues.values():
                queue.sort()
        return iter(queues.items())

    @overload
    def __getitem__(self, index: int) -> ReplicaState: ...
    @overload
    def __getitem__(self, index: slice) -> list[ReplicaState]: ...
    def __getitem__(self, index: int | slice) -> ReplicaState | list[ReplicaState]:
        return self._rows[index]

    def __len__(self) -> int:
        return len(self._rows)

    def __iter__(self) -> Iterator[ReplicaState]:
        return iter(self._rows)

    def _unqueue(self, old: ReplicaState) -> None:
        """Take ``old``'s entry (as it was put) out of its queue."""
        assert self._queues is not None
        kind = queue_kind(old)
        queue = self._queues[kind]
        del queue[bisect_left(queue, _queue_entry(old))]
        if not queue:
            del self._queues[kind]


def _serving(replica: ReplicaState) -> bool:
    return replica.healthy and not replica.draining


def median_waiting(fleet: Sequence[ReplicaState]) -> int:
    """:meth:`ReplicaBoard.median_waiting` of any fleet (a board keeps it as it changes)."""
    if type(fleet) is ReplicaBoard:  # not isinstance: see ReplicaBoard
        return fleet.median_waiting()
    waiting = sorted(r.waiting for r in fleet if _serving(r))
    return waiting[(len(waiting) - 1) // 2] if waiting else 0


def _queue_entry(replica: ReplicaState) -> QueueEntry:
    return queued_work(replica), replica.load, replica.ordinal
