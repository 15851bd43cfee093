"""Open addressing over unsigned 64-bit keys in numpy arrays, a replica bitset per key.

Why: a Python dict costs ~100 bytes a key (slot, key object, mask object); here a key
costs its slot, 8 bytes of key and 8 bytes per 64 replicas of bitset, at a load of at
most ``MAX_LOAD`` (10M keys: 16.8M slots, 16 bytes each, 27 bytes a key), and a batch
of keys is probed in a handful of array operations instead of one bytecode loop a key.

Rules:
- slot ``s`` holds ``keys[s]`` and its bitset ``masks[s]`` (bit ``r`` of word ``r // 64``
  = replica ``r``); key 0 marks a slot never used, so key 0 itself cannot be stored
  (the caller keeps it aside);
- a removed key keeps its slot with an all-zero bitset (a tombstone: probes pass over
  it, the same key revives it); here new keys take the first never-used slot of their
  probe sequence, so tombstones are reclaimed when the table is rebuilt; the index's
  changes in C (kvcore/index/_probe.c, where built) put a new key in the first tombstone
  its probe passes instead, so a table whose keys come and go at a steady count (a
  proxy's, as engines evict what they stored) fills its never-used slots more slowly
  (1M keys: rebuilt after ~620,000 stored keys instead of ~470,000);
- a key's home is the top bits of key * ``multiplier`` (odd); tables of different
  processes should differ in it, else one table's keys in slot order (a snapshot) are
  sorted by their home in the next and pile up there while it is small;
- probes are triangular (home, +1, +3, +6, ...), which visit every slot of a power-of-two
  table and do not cluster as linear probes do; after the home slot, ``_WINDOW`` probes
  are read at once;
- ``keys`` and ``masks`` have one row more than the table: the row at ``capacity``
  is never matched and stays zero, the slot ``find`` gives an absent key, so gathering
  masks needs no test for absence.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import cache

import numpy as np
import numpy.typing as npt

from kvcore.index.base import U64

I64 = npt.NDArray[np.int64]
# kvcore/index/_probe.c's rebuild: (table_keys, table_masks, bits, multiplier, words,
# new_keys, new_masks, new_bits, start, stop, room) -> keys placed
Rebuild = Callable[[U64, U64, int, int, int, U64, U64, int, int, int, int], int]

MAX_LOAD = 0.7  # used slots (live and tombstones) / capacity before a rebuild
_MIN_BITS = 10
_WINDOW = 8  # probes read at once after the home slot
FIBONACCI = 0x9E3779B97F4A7C15  # 2^64 / phi: multiplicative hashing's classic multiplier
_M64 = (1 << 64) - 1


@cache
def _offsets(window: int) -> I64:
    """The triangular offsets of probes ``1 + window * _WINDOW`` onwards, ``_WINDOW`` of them."""
    steps = np.arange(1 + window * _WINDOW, 1 + (window + 1) * _WINDOW, dtype=np.int64)
    return steps * (steps + 1) // 2


class KeyTable:
    """The arrays and their probing; the residency rules live in the index above it."""

    def __init__(self, bits: int = _MIN_BITS, words: int = 1, multiplier: int = FIBONACCI) -> None:
        self.bits = bits
        self.multiplier = multiplier
        self.capacity = 1 << bits
        self.keys: U64 = np.zeros(self.capacity + 1, dtype=np.uint64)
        self.masks: U64 = np.zeros((self.capacity + 1, words), dtype=np.uint64)
        self.words = words  # 64-bit words in a bitset row (masks' second dimension)
        self.filled = 0  # slots ever used since the last rebuild
        self._shift = np.uint64(64 - bits)
        self._mul = np.uint64(multiplier)
        # the same memory, read and written one element at a time as Python ints
        # (twice as fast as ndarray.item and item assignment)
        self.key_view = self.keys.data
        self.mask_view = self.masks.reshape(-1).data  # slot * words + word

    def widen(self, words: int) -> None:
        """Room for replicas up to ``64 * words - 1``."""
        if words > self.words:
            extra = np.zeros((self.capacity + 1, words - self.words), dtype=np.uint64)
            self.masks = np.concatenate([self.masks, extra], axis=1)
            self.mask_view = self.masks.reshape(-1).data
            self.words = words

    def find(self, keys: U64) -> I64:
        """Each (non-zero) key's slot, or ``capacity`` where it is absent."""
        return self._probe(keys, None)

    def probe(self, keys: U64) -> tuple[I64, I64]:
        """``find``, and where each absent key's probe ended (the never-used slot
        :meth:`insert` would give it; ``capacity`` for the others)."""
        ends = np.full(keys.size, self.capacity, dtype=np.int64)
        return self._probe(keys, ends), ends

    def _probe(self, keys: U64, ends: I64 | None) -> I64:
        home = ((keys * self._mul) >> self._shift).view(np.int64)
        found = np.take(self.keys, home)
        hit = found == keys
        slots = np.where(hit, home, self.capacity)
        empty = found == 0
        if ends is not None:
            ends[empty] = home[empty]
        rest = np.flatnonzero(~(hit | empty))
        window, wrap = 0, self.capacity - 1
        while rest.size:
            at = (home[rest, None] + _offsets(window)) & wrap
            seen = np.take(self.keys, at)
            wanted = keys[rest]
            stop = (seen == wanted[:, None]) | (seen == 0)
            first = stop.argmax(axis=1) + np.arange(0, rest.size * _WINDOW, _WINDOW)
            ended = np.take(stop, first)  # (flat positions of each row's first stop)
            matched = ended & (np.take(seen, first) == wanted)
            ending = np.take(at, first)
            slots[rest[matched]] = ending[matched]
            if ends is not None:
                ends[rest[ended & ~matched]] = ending[ended & ~matched]
            rest = rest[~ended]
            window += 1
        return slots

    def slot_of(self, key: int) -> int:
        """``find`` of one (non-zero) key, in plain Python: cheaper for a few keys."""
        return self.locate(key)[0]

    def locate(self, key: int) -> tuple[int, int]:
        """``probe`` of one (non-zero) key, in plain Python: its slot, or ``capacity``
        and the never-used slot its probe ended at."""
        wrap, keys = self.capacity - 1, self.key_view
        slot = ((key * self.multiplier) & _M64) >> (64 - self.bits)
        step = 0
        while True:
            found = keys[slot]
            if found == key:
                return int(slot), self.capacity
            if found == 0:
                return self.capacity, int(slot)
            step += 1
            slot = (slot + step) & wrap

    def place(self, key: int, end: int) -> int:
        """Put an absent key at ``end``, where :meth:`locate` ended (the table unchanged
        since, room made); its slot."""
        self.key_view[end] = key
        self.filled += 1
        return end

    def mask_at(self, slot: int) -> int:
        """The bitset of ``slot`` as one integer."""
        words = self.words
        if words == 1:
            return int(self.mask_view[slot])
        row = self.mask_view[slot * words : (slot + 1) * words].tolist()
        return sum(word << (64 * i) for i, word in enumerate(row))

    def insert(self, keys: U64, ends: I64 | None = None) -> I64:
        """Place distinct non-zero keys known to be absent; their slots. The caller made
        room (:meth:`has_room`). Keys probing the same free slot in one round all write
        it; the one written takes it, the others probe on. ``ends``, where their
        :meth:`probe` ended (the table unchanged since), saves probing again."""
        home = ((keys * self._mul) >> self._shift).view(np.int64)
        slots = np.empty(keys.size, dtype=np.int64)
        step = np.zeros(keys.size, dtype=np.int64)
        pending = np.arange(keys.size)
        if ends is not None:
            self.keys[ends] = keys
            won = self.keys[ends] == keys
            slots[won] = ends[won]
            pending = pending[~won]  # from their home again
        wrap = self.capacity - 1
        while pending.size:
            at = (home[pending] + step[pending] * (step[pending] + 1) // 2) & wrap
            free = self.keys[at] == 0
            claims, claimed = pending[free], at[free]
            self.keys[claimed] = keys[claims]  # of keys claiming one slot, one is written
            won = self.keys[claimed] == keys[claims]
            slots[claims[won]] = claimed[won]
            step[pending[~free]] += 1  # (the others see it taken in the next round)
            pending = np.concatenate([pending[~free], claims[~won]])
        self.filled += keys.size
        return slots

    def has_room(self, more: int) -> bool:
        return self.filled + more <= MAX_LOAD * self.capacity

    def room(self) -> int:
        """Never-used slots that new keys may still take before a rebuild."""
        return max(0, int(MAX_LOAD * self.capacity) - self.filled)

    def spare(self) -> int:
        """Never-used slots a rebuild may fill, past ``room`` (probes must still meet one)."""
        return max(0, self.capacity * 7 // 8 - self.filled)

    def resized(self, live: int, fill: float = 0.5) -> KeyTable:
        """An empty table of this one's words and multiplier for ``live`` keys, at most
        ``fill`` full with them (see :meth:`rebuilt`)."""
        bits = max(_MIN_BITS, (math.ceil(live / fill) - 1).bit_length())
        return KeyTable(bits, self.words, self.multiplier)

    def rebuilt(self, live: int, fill: float = 0.5, native: Rebuild | None = None) -> KeyTable:
        """A table holding this one's live keys (tombstones dropped), at most ``fill``
        full with ``live`` keys: half, so that it fills a while before its next rebuild,
        or up to ``MAX_LOAD`` when ``live`` is all there will be. ``native``: the same
        in C (kvcore/index/_probe.c ``rebuild``: one pass, several times faster; a
        proxy's event loop waits for it)."""
        table = self.resized(live, fill)
        if native is not None:
            table.filled = native(
                self.keys, self.masks, self.bits, self.multiplier, self.words,
                table.keys, table.masks, table.bits, 0, self.capacity, table.spare(),
            )  # fmt: skip
            return table
        used = self.masks[: self.capacity].any(axis=1)
        slots = table.insert(self.keys[: self.capacity][used])
        table.masks[slots] = self.masks[: self.capacity][used]
        return table

    def live_rows(
        self, hidden: U64 | None = None, start: int = 0, stop: int | None = None
    ) -> tuple[U64, U64]:
        """The keys with a bit set (outside ``hidden``, words of replicas) and their
        bitsets, in slot order, of slots ``start`` to ``stop`` (all by default)."""
        stop = self.capacity if stop is None else min(stop, self.capacity)
        masks = self.masks[start:stop]
        if hidden is not None:
            masks = masks & ~hidden
        used = masks.any(axis=1)
        return self.keys[start:stop][used], masks[used]
