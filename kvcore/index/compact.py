"""The residency index built for size: confirmed residency in a numpy hash table.

Why: the dict-of-int-masks index costs ~116 bytes a key at 10M keys, in every proxy
worker and in each control plane; here a key costs ~27 (see :mod:`kvcore.index.hashtable`),
a batch of keys is added or removed in array operations, and a prompt's keys are looked
up together (``leading_runs``: one probe pass, then an AND-accumulate over the holder
bitsets, whose few changes are where runs end).

Rules:
- confirmed residency lives in a :class:`KeyTable`; key 0 (which the table uses to mark
  empty slots) is kept aside in ``_zero``;
- speculative entries are few (a proxy's last seconds of decisions) and churn on every
  decision, so they stay in a :class:`BitmaskResidencyIndex` that holds nothing else,
  and a lookup ORs its masks in;
- where :mod:`kvcore.index._probe` is built (``native``), a prompt is looked up and a
  batch of keys (a list, not an array) added or removed in one C pass each: a proxy
  applies an engine's few dozen stored and evicted blocks between two requests, and
  numpy's dozens of array operations for them cost ~100 us and left the next decision's
  code and data out of the caches;
- else a prompt, or a batch added or removed, of at most ``_SCALAR_KEYS`` keys (most
  requests, an engine's event batch) is handled key by key in plain Python, which beats
  a dozen array operations' fixed cost;
- a change of at most ``_HELD_BATCH`` keys (an engine's event batch) is held back in
  :class:`PendingChanges` and applied with the others in bulk when the index is read
  (any lookup, count or listing) or holds ``_HELD_KEYS`` keys: a control plane ingests
  such batches by the hundred thousand a second and reads rarely (a proxy, which reads
  on every request, holds nothing back: ``hold_changes=False``);
- replicas being cleared step by step are hidden from lookups (their bits are masked
  off) while the steps drop their bits a slot range at a time; a rebuild of the table
  (it grows) first finishes every such clear;
- where the C is built, a table whose never-used slots ran out during a change is
  rebuilt in steps: a new table takes new keys while each change moves the next
  ``migrate_slots`` slots of the old one over (more for a big change: a snapshot's
  steps; a change finding no room left before the move ends finishes it at once); a key
  not in the new table is read and changed in the old one from the first slot not moved
  yet (``_moved``). Anything else that reads or writes the table (snapshots, listings,
  clears, numpy's paths) finishes the move first. Tombstones, not keys, having filled a
  table, it is rebuilt at its own size: a proxy's table at a steady count keeps its
  memory, and its event loop is never held for a whole rebuild (10M keys: 260 ms of CPU
  at once, before).
"""

from __future__ import annotations

import random
from array import array
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from kvcore.index.base import U64, check_replica
from kvcore.index.bitmask import BitmaskResidencyIndex, _bits, _short_runs
from kvcore.index.columns import holders, joined, rows_of, words_of
from kvcore.index.hashtable import MAX_LOAD, KeyTable, Rebuild
from kvcore.index.pending import PendingChanges

try:  # the lookup in C, built with the proxy's compiled modules (dataplane/native.py)
    from kvcore.index import _probe

    NATIVE_RUNS: Callable[..., dict[int, int]] | None = _probe.leading_runs
    NATIVE_CHANGE: Callable[..., tuple[int, int, int, int, bool, int]] | None = _probe.change
    NATIVE_REBUILD: Rebuild | None = _probe.rebuild
except ImportError:  # a checkout without a C compiler: numpy
    NATIVE_RUNS = NATIVE_CHANGE = NATIVE_REBUILD = None

_SCALAR_KEYS = 32  # prompts and batches up to this many keys are handled key by key
_HELD_BATCH = 4_096  # batches up to this many keys are held back (PendingChanges)
_HELD_KEYS = 65_536  # held keys that make the index apply them without waiting for a read
_MIGRATE_SLOTS = 4_096  # old slots moved per change while a rebuild is under way, at least
_MOVED_PER_KEY = 8  # and per key changed, so that a growing table is moved before it fills
_SAME_SIZE_LOAD = 0.6  # keys (and those coming) up to this load: rebuilt at the same size


@dataclass(slots=True)
class _Clearing:
    """A step-by-step clear of one replica: the next slot to clear."""

    position: int = 0


class CompactResidencyIndex:
    """Residency in numpy arrays; see the module docstring. Not thread-safe."""

    def __init__(self, *, hold_changes: bool = True) -> None:
        """``hold_changes=False``: every change applied at once, for an owner that reads
        the index on every request (a proxy) and applies changes in steps of its own."""
        self._table = KeyTable(multiplier=random.getrandbits(64) | 1 << 63 | 1)
        self._zero = 0  # key 0's holders
        self._zero_row = (0, words_of(0, 1))  # _zero, and it as a row (lookups pass it)
        self._live = 0  # keys in the table with a bit set (hidden ones included)
        self._counts: dict[int, int] = {}
        self._spec = BitmaskResidencyIndex()  # speculative entries only
        self._hidden = 0  # replicas being cleared step by step
        self._clearing: dict[int, _Clearing] = {}
        self.scalar_keys = _SCALAR_KEYS  # (tests set 0 to check the array paths)
        self.native = NATIVE_RUNS  # (tests set None to check the Python and numpy paths)
        self._pending = PendingChanges()  # small batches, applied in bulk when read
        self.held_keys = _HELD_KEYS if hold_changes else 0
        self._old: KeyTable | None = None  # the table a rebuild in steps is leaving
        self._moved = 0  # its slots before this one are in the new table (or were empty)
        self._unmoved = 0  # keys with a bit set in its slots from there on
        self.migrate_slots = _MIGRATE_SLOTS  # (tests set a few to step through small tables)
        self.moved_per_key = _MOVED_PER_KEY

    def add(self, replica: int, keys: Iterable[int]) -> None:
        check_replica(replica)
        self._finish_clearing(replica)
        self._change(replica, keys, added=True)

    def remove(self, replica: int, keys: Iterable[int]) -> None:
        check_replica(replica)
        self._finish_clearing(replica)
        self._change(replica, keys, added=False)

    def _change(self, replica: int, keys: Iterable[int], *, added: bool) -> None:
        """Held back if a small batch (applied with the others when the index is read or
        holds ``held_keys``), else applied now, after those held."""
        if isinstance(keys, Sequence) and len(keys) <= _HELD_BATCH and self.held_keys:
            self._pending.record(replica, keys, added=added)
            if self._pending.count >= self.held_keys:
                self._apply_pending()
            return
        self._apply_pending()
        if added:
            self._add_now(replica, keys)
        else:
            self._remove_now(replica, keys)

    def _apply_pending(self) -> None:
        if self._pending:
            for replica, added, removed in self._pending.take():
                if added:
                    self._add_now(replica, added)
                if removed:
                    self._remove_now(replica, removed)

    def _add_now(self, replica: int, keys: Iterable[int]) -> None:
        if self._in_c(keys):
            self._change_in_c(replica, keys, added=True)
            return
        if isinstance(keys, Sequence) and len(keys) <= self.scalar_keys:
            self._add_few(replica, keys)
            return
        batch = _distinct(keys)
        word, mask = self._column(replica)
        added = 0
        if batch.size and batch[0] == 0:
            added += self._change_zero(replica, added=True)
            batch = batch[1:]
        slots, ends = self._table.probe(batch)
        known = slots < self._table.capacity
        held = slots[known]
        masks = self._table.masks
        lacking = held[(masks[held, word] & mask) == 0]
        self._live += int(np.count_nonzero(~masks[lacking].any(axis=1)))
        masks[lacking, word] |= mask
        new = batch[~known]
        if new.size:
            hint = ends[~known] if self._make_room(new.size) else None
            self._table.masks[self._table.insert(new, hint), word] = mask
        self._live += new.size
        self._counts[replica] = self._counts.get(replica, 0) + added + lacking.size + new.size

    def _remove_now(self, replica: int, keys: Iterable[int]) -> None:
        if self._in_c(keys) and replica < 64 * self._table.words:
            self._change_in_c(replica, keys, added=False)
            return
        if isinstance(keys, Sequence) and len(keys) <= self.scalar_keys:
            self._remove_few(replica, keys)
            return
        batch = _distinct(keys)
        removed = 0
        if batch.size and batch[0] == 0:
            removed += self._change_zero(replica, added=False)
            batch = batch[1:]
        if replica < 64 * self._table.words:  # else the table holds none of its keys
            removed += self._remove_bits(replica, batch)
        if removed:
            self._counts[replica] -= removed

    def _in_c(self, keys: Iterable[int]) -> bool:
        """Whether a change of ``keys`` goes to C: an array is numpy's already (which
        reads one table: a rebuild in steps is finished first)."""
        if self.native is not None and not isinstance(keys, np.ndarray):
            return True
        self._finish_moving()
        return False

    def _change_in_c(self, replica: int, keys: Iterable[int], *, added: bool) -> None:
        """``add`` or ``remove`` in one C pass (:func:`_probe.change`); a table too full
        for the keys still to add is rebuilt between passes. Key 0 stays here."""
        assert NATIVE_CHANGE is not None
        batch = keys if isinstance(keys, list | tuple) else list(keys)
        if added:
            self._column(replica)
        start, changed, zero = 0, 0, False
        while True:
            table = self._table
            done, count, live, placed, saw_zero, old_live = NATIVE_CHANGE(
                batch,
                table.keys,
                table.masks,
                table.bits,
                table.multiplier,
                table.words,
                replica,
                added,
                self._room(),
                start,
                *self._old_table(),
            )
            table.filled += placed
            self._live += live
            self._unmoved += old_live
            changed, zero = changed + count, zero or saw_zero
            if done == len(batch):
                break
            self._make_room(len(batch) - done, in_steps=True)
            start = done
        self._move(max(self.migrate_slots, self.moved_per_key * len(batch)))
        if zero:
            changed += self._change_zero(replica, added=added)
        if changed:
            self._counts[replica] = self._counts.get(replica, 0) + (changed if added else -changed)

    def _change_zero(self, replica: int, *, added: bool) -> int:
        """Key 0 (kept aside) added to or removed from ``replica``: 1 if that changed it."""
        held = self._zero >> replica & 1
        if added:
            self._zero |= 1 << replica
            return 1 - held
        self._zero &= ~(1 << replica)
        return held

    def _add_few(self, replica: int, keys: Sequence[int]) -> None:
        """``add`` of a few keys (an engine's event batch), key by key in plain Python."""
        self._column(replica)
        bit, added = 1 << (replica & 63), 0
        for key in keys:
            if key == 0:
                added += self._change_zero(replica, added=True)
                continue
            slot, end = self._table.locate(key)
            if slot == self._table.capacity:
                if not self._make_room(1):
                    slot, end = self._table.locate(key)
                slot = self._table.place(key, end)
            table = self._table
            at = slot * table.words + (replica >> 6)
            held = table.mask_view[at]
            if not held & bit:
                self._live += not held and not self._row_held(slot)
                table.mask_view[at] = held | bit
                added += 1
        self._counts[replica] = self._counts.get(replica, 0) + added

    def _remove_few(self, replica: int, keys: Sequence[int]) -> None:
        """``remove`` of a few keys, key by key in plain Python."""
        table, bit, removed = self._table, 1 << (replica & 63), 0
        for key in keys:
            if key == 0:
                removed += self._change_zero(replica, added=False)
                continue
            slot = table.slot_of(key)
            if slot == table.capacity or replica >> 6 >= table.words:
                continue
            at = slot * table.words + (replica >> 6)
            held = table.mask_view[at]
            if held & bit:
                table.mask_view[at] = held & ~bit
                self._live -= held == bit and not self._row_held(slot)
                removed += 1
        if removed:
            self._counts[replica] -= removed

    def _row_held(self, slot: int) -> bool:
        """Whether any replica holds the key of ``slot`` (a word just read was 0)."""
        return self._table.words > 1 and bool(self._table.masks[slot].any())

    def _remove_bits(self, replica: int, batch: U64) -> int:
        """Drop ``replica`` from the rows of ``batch`` (non-zero keys); how many held it."""
        word, mask = self._column(replica)
        slots = self._table.find(batch)
        masks = self._table.masks
        holding = slots[(masks[slots, word] & mask) != 0]  # (the absent row holds nothing)
        masks[holding, word] &= ~mask
        self._live -= int(np.count_nonzero(~masks[holding].any(axis=1)))
        return int(holding.size)

    def clear_replica(self, replica: int) -> int:
        self._apply_pending()
        held = self._counts.get(check_replica(replica), 0)
        for _ in self.clear_replica_steps(replica, chunk=self._table.capacity + 1):
            pass
        return held

    def clear_replica_steps(self, replica: int, *, chunk: int = 50_000) -> Iterator[int]:
        """Steps of ``chunk`` table slots (a slot range's bits dropped at once)."""
        check_replica(replica)
        self._finish_clearing(replica)
        self._apply_pending()
        self._finish_moving()  # (a clear steps through one table)
        self._spec.clear_replica(replica)
        self._zero &= ~(1 << replica)
        if not self._counts.pop(replica, 0):
            return
        job = self._clearing[replica] = _Clearing()
        self._hidden |= 1 << replica
        while self._clearing.get(replica) is job and self._step(replica, job, chunk):
            yield job.position
        if self._clearing.get(replica) is job:  # else finished early by add/remove/clear
            self._end_clearing(replica)
        yield job.position

    def add_speculative(self, replica: int, keys: Iterable[int], *, expires_at: float) -> None:
        # (every decision records its prompt here: no more than it takes)
        check_replica(replica)
        if self._clearing:
            self._finish_clearing(replica)
        if replica >> 6 >= self._table.words:  # a lookup's rows hold the speculative bits too
            self._column(replica)  # (both tables' rows, a rebuild in steps under way)
        self._spec.add_speculative(replica, keys, expires_at=expires_at)

    def expire(self, now: float) -> int:
        return self._spec.expire(now)

    def replicas_of(self, key: int) -> frozenset[int]:
        self._apply_pending()
        self._finish_moving()
        return frozenset(_bits(self._mask_of(key) & ~self._hidden))

    def leading_runs(self, keys: Sequence[int], *, now: float | None = None) -> dict[int, int]:
        """In one C pass where :mod:`kvcore.index._probe` is built; else probed key by key
        for a short prompt, and all keys at once for a long one (``_runs_of``)."""
        if self._pending.count:
            self._apply_pending()
        native = self.native
        if native is not None:
            table = self._table
            words = table.words
            zero, row = self._zero_row
            if zero != self._zero or row.size != words:  # (a new array a request costs 1 us)
                row = words_of(self._zero, words)
                self._zero_row = (self._zero, row)
            return native(
                keys,
                table.keys,
                table.masks,
                table.bits,
                table.multiplier,
                words,
                row,
                None if now is None else self._spec.speculative_by_key(now),
                words_of(self._hidden, words) if self._hidden else None,
                *self._old_table(),
            )
        speculative = None if now is None else self._spec.speculative_masks(keys, now=now)
        if len(keys) <= self.scalar_keys:
            return self._short_runs(keys, speculative)
        return _runs_of(self._held(keys, speculative))

    def key_count(self, replica: int | None = None) -> int:
        self._apply_pending()
        if replica is None:
            return self._live + bool(self._zero)
        return self._counts.get(replica, 0)

    def speculative_count(self, replica: int, *, now: float) -> int:
        return self._spec.speculative_count(replica, now=now)

    def holdings(self) -> Iterator[tuple[int, int]]:
        keys, masks = self.residency()
        step = 65_536
        for start in range(0, keys.size, step):
            rows = masks[start : start + step].tolist()
            for key, words in zip(keys[start : start + step].tolist(), rows, strict=True):
                yield key, joined(words)

    def residency(self) -> tuple[U64, U64]:
        """Every confirmed key (``uint64``) and its bitset (``uint64`` rows, replica ``r``
        at bit ``r % 64`` of word ``r // 64``), as arrays: a snapshot's contents without
        a Python object per key. Copies; the index may change afterwards."""
        self._apply_pending()
        self._finish_moving()
        hidden = words_of(self._hidden, self._table.words) if self._hidden else None
        keys, masks = self._table.live_rows(hidden)
        zero = self._zero & ~self._hidden
        if zero:
            keys = np.concatenate([np.zeros(1, dtype=np.uint64), keys])
            masks = np.concatenate([words_of(zero, masks.shape[1])[None, :], masks])
        return keys, masks

    def residency_chunks(self, rows: int = 1 << 18) -> Iterator[tuple[U64, U64]]:
        """Slot ranges of ``rows`` slots: key 0 (if held) first, then each range's live
        rows. A rebuild between pieces (the table grew) leaves the rest read from the
        table as it was, whose keys are each in one slot."""
        self._apply_pending()
        self._finish_moving()
        table = self._table
        zero = self._zero & ~self._hidden
        if zero:
            yield np.zeros(1, dtype=np.uint64), words_of(zero, table.words)[None, :]
        for start in range(0, table.capacity, rows):
            if table is self._table:
                self._apply_pending()
            hidden = words_of(self._hidden, table.words) if self._hidden else None
            yield table.live_rows(hidden, start, start + rows)

    def reserve(self, keys: int) -> None:
        """A rebuild now, to hold ``keys`` in all, instead of one per doubling."""
        self._apply_pending()
        self._finish_moving()
        if not self._table.has_room(keys - self._live):
            self._make_room(keys - self._live, fill=MAX_LOAD)

    def add_rows(self, keys: U64, masks: U64) -> None:
        """Each key's replicas (a row of ``masks``) join those it had; distinct keys,
        as a snapshot's are (a key repeated in one call is counted twice)."""
        self._apply_pending()
        self._finish_moving()
        for replica in list(self._clearing):
            self._finish_clearing(replica)
        table = self._table
        table.widen(masks.shape[1])
        rows = np.zeros((keys.size, table.words), dtype=np.uint64)
        rows[:, : masks.shape[1]] = masks
        held = rows.any(axis=1)
        keys, rows = keys[held], rows[held]
        zero = keys == 0
        if zero.any():
            self._add_zero_rows(rows[zero])
            keys, rows = keys[~zero], rows[~zero]
        slots, ends = table.probe(keys)
        known = slots < table.capacity
        had = table.masks[slots[known]]
        gained = rows[known] & ~had
        self._live += int(np.count_nonzero(~had.any(axis=1)))
        table.masks[slots[known]] = had | rows[known]
        fresh = rows[~known]
        if fresh.size:
            hint = ends[~known] if self._make_room(len(fresh)) else None
            self._table.masks[self._table.insert(keys[~known], hint)] = fresh
            self._live += len(fresh)
        for replica, count in _bit_counts(np.concatenate([gained, fresh])).items():
            self._counts[replica] = self._counts.get(replica, 0) + count

    def _add_zero_rows(self, rows: U64) -> None:
        mask = 0
        for row in rows.tolist():
            mask |= joined(row)
        for replica in _bits(mask & ~self._zero):
            self._counts[replica] = self._counts.get(replica, 0) + 1
        self._zero |= mask

    def keys_of(self, replica: int) -> list[int]:
        self._apply_pending()
        self._finish_moving()
        check_replica(replica)
        if self._hidden >> replica & 1 or replica >= 64 * self._table.words:
            return []
        word, mask = self._column(replica)
        table = self._table
        held = (table.masks[: table.capacity, word] & mask) != 0
        keys: list[int] = table.keys[: table.capacity][held].tolist()
        return [0, *keys] if self._zero >> replica & 1 else keys

    def _column(self, replica: int) -> tuple[int, np.uint64]:
        """The word and bit of ``replica`` in a bitset row (widening the rows if needed)."""
        word = replica >> 6
        if word >= self._table.words:  # (both tables would need the new word)
            self._finish_moving()
        self._table.widen(word + 1)
        return word, np.uint64(1 << (replica & 63))

    def _mask_of(self, key: int) -> int:
        if key == 0:
            return self._zero
        return self._table.mask_at(self._table.slot_of(key))

    def _short_runs(self, keys: Sequence[int], speculative: list[int] | None) -> dict[int, int]:
        """Each key's mask, up to the first held by nobody, read by the bitmask index's
        key-by-key walk."""
        held: dict[int, int] = {}
        for position, key in enumerate(keys):
            mask = self._mask_of(key)
            if speculative is not None:
                mask |= speculative[position]
            mask &= ~self._hidden
            if not mask:
                break
            held[key] = mask
        return _short_runs(keys, held, {}, 0)

    def _held(self, keys: Sequence[int], speculative: list[int] | None) -> U64:
        """Each key's holders as rows of words: confirmed, with speculation, unhidden."""
        batch = np.frombuffer(array("Q", keys), dtype=np.uint64)
        table = self._table
        slots = table.find(batch)
        if table.words == 1:  # (a flat gather is cheaper)
            held = np.take(table.masks.reshape(-1), slots)[:, None]
        else:
            held = np.take(table.masks, slots, axis=0)
        if self._zero:
            held[batch == 0] = words_of(self._zero, table.words)
        if speculative is not None and any(speculative):
            held |= rows_of(speculative, table.words)
        if self._hidden:
            held &= ~words_of(self._hidden, table.words)
        return held

    def _make_room(self, more: int, fill: float = 0.5, *, in_steps: bool = False) -> bool:
        """Room for ``more`` keys; whether the table is the one it was. ``in_steps``
        (a change in C): a new table, and the old one's slots moved change by change."""
        if more <= self._room():
            return True
        self._finish_moving()
        if self._table.has_room(more):
            return True
        for replica in list(self._clearing):
            self._finish_clearing(replica)
        if self._live + more <= _SAME_SIZE_LOAD * self._table.capacity:
            fill = max(fill, _SAME_SIZE_LOAD)  # tombstones filled it, not keys: its size
        if in_steps and NATIVE_REBUILD is not None:
            self._old, self._moved, self._unmoved = self._table, 0, self._live
            self._table = self._table.resized(self._live + more, fill)
            self._move(self.migrate_slots)
            return False
        native = NATIVE_REBUILD if self.native is not None else None
        self._table = self._table.rebuilt(self._live + more, fill, native)
        return False

    def _room(self) -> int:
        """Never-used slots new keys may take, the keys still to move aside."""
        return max(0, self._table.room() - self._unmoved)

    def _old_table(self) -> tuple[U64 | None, U64 | None, int, int]:
        """The table a rebuild in steps is leaving, as the C takes it (old_keys ..
        moved; old_keys None: none)."""
        old = self._old
        if old is None:
            return None, None, 0, 0
        return old.keys, old.masks, old.bits, self._moved

    def _move(self, slots: int) -> None:
        """The next ``slots`` slots of the table being left moved to the new one."""
        old, table = self._old, self._table
        if old is None:
            return
        assert NATIVE_REBUILD is not None
        stop = min(self._moved + slots, old.capacity)
        placed = NATIVE_REBUILD(
            old.keys, old.masks, old.bits, old.multiplier, old.words,
            table.keys, table.masks, table.bits, self._moved, stop, table.spare(),
        )  # fmt: skip
        table.filled += placed
        self._moved, self._unmoved = stop, self._unmoved - placed
        if stop == old.capacity:
            self._old = None

    def _finish_moving(self) -> None:
        if self._old is not None:
            self._move(self._old.capacity)

    def _step(self, replica: int, job: _Clearing, budget: int) -> bool:
        """Drop ``replica``'s bit from the next ``budget`` slots; whether slots remain."""
        table = self._table
        end = min(job.position + budget, table.capacity)
        word, mask = replica >> 6, np.uint64(1 << (replica & 63))
        rows = table.masks[job.position : end]
        held = (rows[:, word] & mask) != 0
        rows[:, word] &= ~mask
        self._live -= int(np.count_nonzero(held & ~rows.any(axis=1)))
        job.position = end
        return end < table.capacity

    def _finish_clearing(self, replica: int) -> None:
        job = self._clearing.get(replica)
        if job is not None:
            self._step(replica, job, self._table.capacity)
            self._end_clearing(replica)

    def _end_clearing(self, replica: int) -> None:
        del self._clearing[replica]
        self._hidden &= ~(1 << replica)


def _distinct(keys: Iterable[int]) -> U64:
    """``keys`` as sorted distinct ``uint64`` (key 0, if there, first)."""
    if isinstance(keys, np.ndarray):
        batch = np.sort(keys.astype(np.uint64, copy=False))
    else:
        batch = np.sort(np.frombuffer(array("Q", keys), dtype=np.uint64))
    if batch.size < 2:
        return batch
    repeated = batch[1:] == batch[:-1]  # (np.unique sorts too, ten times slower)
    return batch[np.concatenate(([True], ~repeated))] if repeated.any() else batch


def _runs_of(held: U64) -> dict[int, int]:
    """Leading runs from each key's holder rows: the AND of the rows so far only loses
    bits, so the runs end where it changes, read at the few places it does."""
    live = np.bitwise_and.accumulate(held, axis=0)
    single = live.shape[1] == 1
    flat = live[:, 0] if single else live
    alive: npt.NDArray[np.bool_] = np.asarray(flat != 0 if single else live.any(axis=1))
    end = live.shape[0] if alive[-1] else int(np.argmin(alive))
    if not end:
        return {}
    changed = flat[1:end] != flat[: end - 1]
    ends = np.flatnonzero(changed if single else changed.any(axis=1))
    rows = np.append(ends, end - 1)  # where each value of the AND last holds
    if single:
        values: list[int] = flat[rows].tolist()
    else:
        values = [joined(row) for row in live[rows].tolist()]
    runs: dict[int, int] = {}
    for row, value, following in zip(rows.tolist(), values, [*values[1:], 0], strict=True):
        for replica in _bits(value & ~following):
            runs[replica] = row + 1
    return runs


def _bit_counts(rows: U64) -> dict[int, int]:
    """How many rows have each replica's bit, for the replicas with any."""
    return {replica: int(np.count_nonzero(held)) for replica, held in holders(rows)}
