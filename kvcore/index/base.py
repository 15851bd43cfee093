"""The residency index contract: which replicas hold which router block keys.

Both the control plane (the global map) and each proxy (its local replica of it) keep
one. Replicas are small non-negative ordinals (stable within a control-plane epoch), so
a key's holders fit a bitmask. Entries are *confirmed* (an engine reported the block)
or *speculative* (a proxy just routed a prompt there; they expire). Time is passed in
(``now``, seconds on any monotonic clock), never read, so the benchmark simulator can
run the same code in virtual time.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import Protocol

import numpy as np
import numpy.typing as npt

U64 = npt.NDArray[np.uint64]

MAX_REPLICA_ORDINAL = 4095


class ResidencyIndex(Protocol):
    """Block key -> replicas holding it; every implementation passes one conformance suite."""

    def add(self, replica: int, keys: Iterable[int]) -> None:
        """Record that ``replica`` holds ``keys`` (confirmed)."""
        ...

    def remove(self, replica: int, keys: Iterable[int]) -> None:
        """Record that ``replica`` no longer holds ``keys``; unknown keys are ignored."""
        ...

    def clear_replica(self, replica: int) -> int:
        """Forget everything about ``replica`` (confirmed and speculative); returns the
        number of confirmed keys it held."""
        ...

    def clear_replica_steps(self, replica: int, *, chunk: int = 50_000) -> Iterator[int]:
        """``clear_replica`` in steps of about ``chunk`` keys (yielding progress), so that
        an event loop can run between steps. From the first step, lookups no longer see
        ``replica``; adding, removing or clearing it first completes the job."""
        ...

    def add_speculative(self, replica: int, keys: Iterable[int], *, expires_at: float) -> None:
        """Record that ``replica`` probably holds ``keys`` until ``expires_at``."""
        ...

    def expire(self, now: float) -> int:
        """Drop speculative entries that expired at or before ``now``; returns how many."""
        ...

    def replicas_of(self, key: int) -> frozenset[int]:
        """The replicas confirmed to hold ``key``."""
        ...

    def leading_runs(self, keys: Sequence[int], *, now: float | None = None) -> dict[int, int]:
        """For a prompt's keys (in order): each replica's number of leading keys held.

        Replicas holding not even the first key are absent. With ``now``, unexpired
        speculative entries count as held. One pass, stopping at the first key no
        replica still in the run holds.
        """
        ...

    def key_count(self, replica: int | None = None) -> int:
        """Confirmed keys held by ``replica``, or distinct confirmed keys overall."""
        ...

    def speculative_count(self, replica: int, *, now: float) -> int:
        """Keys speculatively held by ``replica`` at ``now`` (unexpired; whether or not
        also confirmed): how much this router sent it lately."""
        ...

    def holdings(self) -> Iterator[tuple[int, int]]:
        """Every confirmed key with the bitmask of its replicas (bit ``r`` = ordinal r),
        for snapshots; do not modify the index while iterating."""
        ...

    def keys_of(self, replica: int) -> list[int]:
        """The confirmed keys ``replica`` holds (any order)."""
        ...

    def residency(self) -> tuple[U64, U64]:
        """Every confirmed key with its bitset, as columns (:mod:`kvcore.index.columns`):
        a snapshot's contents without a Python object per key. A copy."""
        ...

    def residency_chunks(self, rows: int = 1 << 18) -> Iterator[tuple[U64, U64]]:
        """:meth:`residency` in pieces of about ``rows`` rows at most, so that an event
        loop can run between them. The index may change between pieces: each key comes
        at most once, as it was when its piece was read (or, after a rebuild of the
        index's storage, when the rebuild began)."""
        ...

    def reserve(self, keys: int) -> None:
        """Room for ``keys`` distinct keys in all, made at once (a snapshot about to be
        loaded); an index that has nothing to make ignores it."""
        ...

    def add_rows(self, keys: U64, masks: U64) -> None:
        """Columns added (each key's replicas join those it had): a snapshot loaded.
        Distinct keys, as a snapshot's are."""
        ...


def check_replica(replica: int) -> int:
    """``replica`` if it is a valid ordinal, else ``ValueError`` naming it."""
    if not 0 <= replica <= MAX_REPLICA_ORDINAL or isinstance(replica, bool):
        raise ValueError(f"replica ordinal must be in [0, {MAX_REPLICA_ORDINAL}], got {replica!r}")
    return replica
