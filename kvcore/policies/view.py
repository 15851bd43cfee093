"""A plain in-memory :class:`StateView`: a fleet list over a residency index.

What tests, the benchmarks and the simulator route against; the proxy's and the control
plane's views implement the same protocol over their own state.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from kvcore.index import BitmaskResidencyIndex, ResidencyIndex
from kvcore.policies.base import Decision, ReplicaState
from kvcore.policies.board import ReplicaBoard


class StaticStateView:
    """Replicas (a :class:`ReplicaBoard`, so scored strategies need not visit every
    replica) and an index; ``residency_known`` overrides the default "the index holds any
    confirmed key", ``inflight`` the default "every request the replicas hold is this
    router's" (the only router)."""

    def __init__(
        self,
        replicas: Iterable[ReplicaState] = (),
        index: ResidencyIndex | None = None,
        *,
        residency_known: bool | None = None,
        inflight: int | None = None,
    ) -> None:
        self.index: ResidencyIndex = index if index is not None else BitmaskResidencyIndex()
        self.board = ReplicaBoard(replicas)
        self._residency_known = residency_known
        self._inflight = inflight

    def replicas(self) -> Sequence[ReplicaState]:
        return self.board

    def leading_runs(self, keys: Sequence[int], *, now: float | None) -> dict[int, int]:
        return self.index.leading_runs(keys, now=now)

    def placed_blocks(self, ordinal: int, *, now: float) -> int:
        return self.index.speculative_count(ordinal, now=now)

    def has_residency(self) -> bool:
        if self._residency_known is not None:
            return self._residency_known
        return self.index.key_count() > 0

    def inflight(self) -> int:
        if self._inflight is not None:
            return self._inflight
        return sum(replica.requests for replica in self.board)

    def set_replicas(self, replicas: Iterable[ReplicaState]) -> None:
        """Replace the fleet (loads change between decisions; :meth:`put` changes one)."""
        self.board = ReplicaBoard(replicas)

    def put(self, replica: ReplicaState) -> None:
        """Add ``replica`` or replace its ordinal's state."""
        self.board.put(replica)

    def apply(self, decision: Decision) -> None:
        """Record the decision's speculative residency, as a caller should."""
        record = decision.speculative
        if record is not None:
            self.index.add_speculative(record.replica, record.keys, expires_at=record.expires_at)
