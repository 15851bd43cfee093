"""Residency as columns: every key beside its replica bitset, in two arrays.

Why: a snapshot of millions of keys built, sent and loaded one Python int at a time
costs seconds; as arrays it is a few buffer copies. ``ResidencyIndex.residency()``
gives the columns, ``ResidencyIndex.add_rows`` loads them, and a Watch snapshot chunk
carries them as a ``ResidencyColumns`` message (``to_columns`` / ``from_columns``).

Rules:
- keys are a ``uint64`` vector; bitsets a ``uint64`` matrix of one row per key and one
  word per 64 replicas (replica ``r``: bit ``r % 64`` of word ``r // 64``); on the wire
  both are little-endian;
- ``from_columns`` refuses (:class:`BadColumns`) a message whose buffers do not hold
  exactly what its header says, or more words than ordinals exist; what the rows mean
  (which replicas are known) is the reader's to check.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from itertools import repeat

import numpy as np
import numpy.typing as npt

from kvcore.index.base import MAX_REPLICA_ORDINAL, U64, ResidencyIndex
from kvcore.pb import routing_pb2

MAX_WORDS = (MAX_REPLICA_ORDINAL + 64) // 64
_M64 = (1 << 64) - 1
_WIRE = np.dtype("<u8")


class BadColumns(ValueError):
    """A ``ResidencyColumns`` message that does not hold what its header says."""


def words_of(mask: int, words: int) -> U64:
    """``mask`` as a row of ``words`` 64-bit words (bits beyond them dropped)."""
    return np.array([(mask >> (64 * i)) & _M64 for i in range(words)], dtype=np.uint64)


def rows_of(masks: list[int], words: int) -> U64:
    """Masks as rows of ``words`` 64-bit words."""
    if words == 1:
        return np.array(masks, dtype=np.uint64)[:, None]
    columns = [[(m >> (64 * i)) & _M64 for m in masks] for i in range(words)]
    return np.array(columns, dtype=np.uint64).T


def joined(words: list[int]) -> int:
    """A row of 64-bit words as one mask."""
    if len(words) == 1:
        return words[0]
    return sum(word << (64 * i) for i, word in enumerate(words))


def from_holdings(holdings: Iterable[tuple[int, int]]) -> tuple[U64, U64]:
    """Columns of ``(key, mask)`` pairs (``ResidencyIndex.holdings``)."""
    pairs = list(holdings)
    words = max(1, max((mask.bit_length() + 63) // 64 for _, mask in pairs)) if pairs else 1
    keys = np.array([key for key, _ in pairs], dtype=np.uint64)
    return keys, rows_of([mask for _, mask in pairs], words).reshape(len(pairs), words)


def holdings_chunks(
    keys: list[int], masks: dict[int, int], hidden: int, rows: int
) -> Iterator[tuple[U64, U64]]:
    """Columns of ``keys`` (a copy of a dict index's keys) in pieces of ``rows``, each
    key's mask read from ``masks`` when its piece is; keys no visible replica holds
    (any more) skipped."""
    visible = ~hidden
    for start in range(0, len(keys), rows):
        piece = keys[start : start + rows]
        held = zip(piece, map(masks.get, piece, repeat(0)), strict=True)
        yield from_holdings((key, mask & visible) for key, mask in held if mask & visible)


class MostShared:
    """The keys held by the most replicas (at least two) among rows given piece by
    piece: the ``top`` with the most holders, in the order given among equals. Each
    piece is ranked in array operations (a holder count per row, then a threshold), so
    millions of rows cost milliseconds, not a Python loop over every key."""

    def __init__(self, top: int) -> None:
        self.top = top
        self._best: list[tuple[int, int, int]] = []  # (holders, key, mask), best first

    def add(self, keys: U64, masks: U64) -> None:
        if not self.top or not keys.size:
            return
        counts = np.bitwise_count(masks).sum(axis=1, dtype=np.int64)
        floor = self._best[-1][0] if len(self._best) == self.top else 1
        rows = np.flatnonzero(counts > floor)  # what can still enter the ranking
        if rows.size > self.top:  # the top-th largest count, then the first at it
            cut = int(np.partition(counts[rows], rows.size - self.top)[rows.size - self.top])
            above = rows[counts[rows] > cut]
            at = rows[counts[rows] == cut][: self.top - above.size]
            rows = np.sort(np.concatenate([above, at]))
        found = [
            (int(count), int(key), joined(row))
            for count, key, row in zip(
                counts[rows].tolist(), keys[rows].tolist(), masks[rows].tolist(), strict=True
            )
        ]
        # (a stable sort: earlier pieces and rows first among equals)
        self._best = sorted(self._best + found, key=lambda held: -held[0])[: self.top]

    def result(self) -> list[tuple[int, int]]:
        """``(key, mask)`` pairs, most holders first."""
        return [(key, mask) for _, key, mask in self._best]


def restricted(keys: U64, masks: U64, ordinals: Iterable[int]) -> tuple[U64, U64]:
    """The rows held by any of ``ordinals``, their bitsets cut down to those."""
    wanted = 0
    for ordinal in ordinals:
        wanted |= 1 << ordinal
    cut = masks & words_of(wanted, masks.shape[1])
    held = cut.any(axis=1)
    return keys[held], cut[held]


def holders(masks: U64) -> Iterator[tuple[int, npt.NDArray[np.bool_]]]:
    """Each replica with a bit in any row, lowest first, and which rows have it."""
    for word in range(masks.shape[1]):
        column = masks[:, word]
        present = int(np.bitwise_or.reduce(column)) if column.size else 0
        while present:
            low = present & -present
            present ^= low
            yield 64 * word + low.bit_length() - 1, (column & np.uint64(low)) != 0


def keys_by_replica(keys: U64, masks: U64) -> Iterator[tuple[int, U64]]:
    """Each replica holding any of the rows, lowest first, with the keys it holds."""
    for replica, held in holders(masks):
        yield replica, keys[held]


def add_by_replica(index: ResidencyIndex, keys: U64, masks: U64) -> None:
    """``add_rows`` through ``add``, one call per replica (for dict and set indexes)."""
    for replica, held in keys_by_replica(keys, masks):
        index.add(replica, held.tolist())


def to_columns(
    target: routing_pb2.ResidencyColumns, keys: U64, masks: U64, *, total_rows: int = 0
) -> None:
    """Fill ``target`` with the rows (one copy of each buffer into the message);
    ``total_rows``, the whole snapshot's, on its first chunk."""
    target.total_rows = total_rows
    target.count = keys.size
    target.words = masks.shape[1]
    target.keys = keys.astype(_WIRE, copy=False).tobytes()
    target.masks = np.ascontiguousarray(masks, dtype=_WIRE).tobytes()


def from_columns(columns: routing_pb2.ResidencyColumns) -> tuple[U64, U64]:
    """The rows of ``columns`` as arrays over its buffers (no copy); :class:`BadColumns`
    when the buffers' lengths do not match ``count`` and ``words``."""
    count, words = columns.count, columns.words
    if not 1 <= words <= MAX_WORDS:
        raise BadColumns(f"residency columns of {words} words (1 to {MAX_WORDS})")
    if len(columns.keys) != 8 * count or len(columns.masks) != 8 * count * words:
        raise BadColumns(
            f"residency columns say {count} keys of {words} words, but carry "
            f"{len(columns.keys)} bytes of keys and {len(columns.masks)} bytes of bitsets"
        )
    keys = np.frombuffer(columns.keys, dtype=_WIRE).astype(np.uint64, copy=False)
    masks = np.frombuffer(columns.masks, dtype=_WIRE).astype(np.uint64, copy=False)
    return keys, masks.reshape(count, words)
