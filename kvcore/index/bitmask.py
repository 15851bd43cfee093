"""The production residency index: one dict from key to an integer bitmask of replicas.

Why this shape: a Python dict lookup is the fastest membership test Python has, and an
``int`` bitmask holds any number of replicas in one object, so a prompt lookup is one
dict probe and one comparison per block (the masks are read as runs of equal masks). A
64-bit key costs about 100 bytes in all (dict slot, key object, mask object; masks of
replicas 0-7 alone are shared small ints).

Speculative entries live apart: ``_spec_mask`` (key -> mask, only unexpired entries
after :meth:`expire`) and, per replica, each key's expiry, with one expiry record per
replica and expiry time, so that recording a 512-key prompt is cheap. For the keys
that have speculative entries, ``_with_spec`` holds confirmed | speculative, so that a
lookup that counts speculation (every proxy lookup) is still one probe per dict.

Expiry records are plain tuples (compared in C) in a FIFO queue while they arrive in
order of expiry, as a proxy's do (its clock plus one workload's TTL): recording and
expiring one is O(1). Records that would break the order (a shorter TTL after a longer
one) go to a heap. Which records expire first does not change what an expiry drops
(see :meth:`_expire_record`), so the two are simply drained in turn.

A long prompt (at least ``_PREFIX_MIN`` keys) is looked up from the end of a beginning
looked up before, when it starts with one (:class:`_Prefix`): where two lookups in a row
with the same first key shared their first keys, the state of the walk at the end of
what they shared is remembered until a key of it changes holders, so a new question
after a 490-key system prompt reads 57 keys, not 547. Every change of a key's holders
tests one set (``_watched``, the remembered keys) and, on a hit, forgets every beginning.

A record holds a set of keys, and a call with the same replica and expiry as the last
in-order record of that replica adds its keys to it. Callers round expiries up to a
tick (``kvcore.policies.kv_scoring.SPECULATION_TICK_S``), so a busy proxy keeps one
record per replica per tick, and a prefix recorded again within a tick costs no memory:
a record per request kept the request's keys alive for the whole TTL (tens of thousands
of records at a few thousand requests a second, 2 s TTL), and that churn alone cost
~4 us of a 60 us request in ``bench.proxy_path``.
"""

from __future__ import annotations

import heapq
from bisect import bisect_left
from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from itertools import accumulate, count, groupby, repeat, takewhile
from operator import and_

from kvcore.index.base import U64, check_replica
from kvcore.index.columns import add_by_replica, from_holdings, holdings_chunks

_NOTHING: dict[int, int] = {}


# (expires_at, seq, replica, keys): ordered by expiry, then by recording (seq is unique,
# so keys are never compared); a tuple, since a dataclass's ordering runs in Python
_Expiry = tuple[float, int, int, set[int]]


class BitmaskResidencyIndex:
    """Residency as ``dict[key, int]``; see the module docstring. Not thread-safe."""

    def __init__(self) -> None:
        self._masks: dict[int, int] = {}
        self._counts: dict[int, int] = {}
        self._spec_mask: dict[int, int] = {}
        self._with_spec: dict[int, int] = {}  # confirmed | speculative, speculated keys only
        self._spec_until: dict[int, dict[int, float]] = {}
        self._in_order: deque[_Expiry] = deque()  # expiry records, by expiry
        self._out_of_order: list[_Expiry] = []  # a heap: those that came out of order
        self._seq = count()
        self._open: dict[int, _Expiry] = {}  # replica -> its last in-order record
        self._hidden = 0  # replicas being cleared step by step: invisible to lookups
        self._clearing: dict[int, _Clearing] = {}
        # prompt beginnings looked up before (see _Prefix), by their first key: for
        # lookups not counting speculation, and for those counting it
        self._prefixes: dict[int, _Prefix] = {}
        self._spec_prefixes: dict[int, _Prefix] = {}
        self._watched: set[int] = set()  # the keys of every valid _Prefix

    def add(self, replica: int, keys: Iterable[int]) -> None:
        bit = 1 << check_replica(replica)
        self._finish_clearing(replica)
        masks, with_spec, watched, added = self._masks, self._with_spec, self._watched, 0
        for key in keys:
            mask = masks.get(key, 0)
            if not mask & bit:
                masks[key] = mask | bit
                added += 1
                if with_spec and key in with_spec:
                    with_spec[key] |= bit
                if watched and key in watched:
                    self._forget_prefixes()  # (empties ``watched``)
        self._counts[replica] = self._counts.get(replica, 0) + added

    def remove(self, replica: int, keys: Iterable[int]) -> None:
        bit = 1 << check_replica(replica)
        self._finish_clearing(replica)
        masks, with_spec, watched, removed = self._masks, self._with_spec, self._watched, 0
        for key in keys:
            mask = masks.get(key, 0)
            if mask & bit:
                removed += 1
                if watched and key in watched:
                    self._forget_prefixes()
                if mask == bit:
                    del masks[key]
                else:
                    masks[key] = mask & ~bit
                if with_spec and key in with_spec:
                    self._refresh_with_spec(key)
        if removed:
            self._counts[replica] -= removed

    def clear_replica(self, replica: int) -> int:
        """O(resident keys), about 0.1 s per million: see :meth:`clear_replica_steps`."""
        held = self._counts.get(check_replica(replica), 0)
        for _ in self.clear_replica_steps(replica, chunk=len(self._masks) + 1):
            pass
        return held

    def clear_replica_steps(self, replica: int, *, chunk: int = 50_000) -> Iterator[int]:
        """``clear_replica`` in steps of ``chunk`` keys, so an event loop can yield between
        them; yields the keys examined so far. From the first step ``replica`` holds
        nothing for every lookup; ``add``/``remove``/``clear`` of it finish the job first.
        """
        bit = 1 << check_replica(replica)
        self._finish_clearing(replica)
        held = self._counts.pop(replica, 0)
        for key in self._spec_until.pop(replica, {}):
            self._drop_spec_bit(key, bit)
        if not held:
            return
        job = self._clearing[replica] = _Clearing(
            bit, list(self._masks), list(self._masks.values())
        )
        self._hidden |= bit
        self._forget_prefixes()
        while self._clearing.get(replica) is job and self._step(job, chunk):
            yield job.position
        if self._clearing.get(replica) is job:  # else finished early by add/remove/clear
            self._end_clearing(replica)
        yield job.position

    def add_speculative(self, replica: int, keys: Iterable[int], *, expires_at: float) -> None:
        """A key the replica already speculatively holds only has its expiry moved (a
        proxy records a whole prompt on every decision, mostly a prefix it recorded
        before): ``_with_spec`` already holds its bit. The keys join the replica's last
        in-order record if it has the same expiry, else a new one."""
        bit = 1 << check_replica(replica)
        if self._clearing:
            self._finish_clearing(replica)
        if not isinstance(keys, (tuple, list)):
            keys = tuple(keys)  # read twice
        until = self._spec_until.get(replica)
        if until is None:
            until = self._spec_until[replica] = {}
        masks, spec, with_spec = self._masks, self._spec_mask, self._with_spec
        watched = self._watched
        for key in keys:
            until[key] = expires_at
            speculative = spec.get(key, 0)
            if not speculative & bit:
                speculative = spec[key] = speculative | bit
                with_spec[key] = masks.get(key, 0) | speculative
                if watched and key in watched:
                    self._forget_prefixes()
        record = self._open.get(replica)
        if record is not None and record[0] == expires_at:
            record[3].update(keys)
            return
        record = (expires_at, next(self._seq), replica, set(keys))
        in_order = self._in_order
        if not in_order or in_order[-1][0] <= expires_at:
            in_order.append(record)
            self._open[replica] = record
        else:
            heapq.heappush(self._out_of_order, record)

    def expire(self, now: float) -> int:
        expired = 0
        in_order, out_of_order = self._in_order, self._out_of_order
        while in_order and in_order[0][0] <= now:
            expired += self._expire_record(in_order.popleft())
        while out_of_order and out_of_order[0][0] <= now:
            expired += self._expire_record(heapq.heappop(out_of_order))
        return expired

    def replicas_of(self, key: int) -> frozenset[int]:
        return frozenset(_bits(self._masks.get(key, 0) & ~self._hidden))

    def leading_runs(self, keys: Sequence[int], *, now: float | None = None) -> dict[int, int]:
        """Each replica's leading run. A prompt's blocks come in long runs held by the
        same replicas (a shared system prompt, then one conversation's blocks), so the
        holder masks are read as runs of equal masks, each counted at C speed; from the
        ``_GROUPS``-th change on, the rest is read by :func:`_runs_by_and`. A prompt of
        at most ``_GROUPS`` blocks (most requests) is read key by key
        (:func:`_short_runs`)."""
        with_spec = _NOTHING
        if now is not None:
            in_order = self._in_order
            if (in_order and in_order[0][0] <= now) or self._out_of_order:
                self.expire(now)  # (read here first: a proxy's lookup usually finds 0-1 due)
            with_spec = self._with_spec
        if len(keys) <= _GROUPS:
            return _short_runs(keys, self._masks, with_spec, self._hidden)
        if len(keys) < _PREFIX_MIN:
            return _grouped_runs(keys, self._masks, with_spec, self._hidden)
        return self._runs_after_prefix(keys, with_spec, now is not None)

    def speculative_masks(self, keys: Sequence[int], *, now: float) -> list[int] | None:
        """Each key's replicas holding it speculatively at ``now`` (a mask, 0 for none),
        or ``None`` when nothing is speculative: what an index keeping its confirmed
        residency elsewhere ORs into a lookup's masks."""
        in_order = self._in_order
        if (in_order and in_order[0][0] <= now) or self._out_of_order:
            self.expire(now)
        if not self._spec_mask:
            return None
        return list(map(self._spec_mask.get, keys, repeat(0)))

    def speculative_by_key(self, now: float) -> dict[int, int] | None:
        """Each key's replicas holding it speculatively at ``now`` (the index's own dict:
        read it, do not change it), or ``None`` when nothing is speculative."""
        in_order = self._in_order
        if (in_order and in_order[0][0] <= now) or self._out_of_order:
            self.expire(now)
        return self._spec_mask or None

    def key_count(self, replica: int | None = None) -> int:
        """Overall, keys only a replica being cleared step by step held still count."""
        return len(self._masks) if replica is None else self._counts.get(replica, 0)

    def speculative_count(self, replica: int, *, now: float) -> int:
        self.expire(now)
        return len(self._spec_until.get(replica, _NOTHING))

    def holdings(self) -> Iterator[tuple[int, int]]:
        if not self._hidden:
            return iter(self._masks.items())
        visible = ~self._hidden
        return ((k, m & visible) for k, m in self._masks.items() if m & visible)

    def residency(self) -> tuple[U64, U64]:
        return from_holdings(self.holdings())

    def residency_chunks(self, rows: int = 1 << 18) -> Iterator[tuple[U64, U64]]:
        """Pieces of the keys as they were when it began (a copy of the dict's keys, at
        C speed), each key's mask read when its piece is."""
        return holdings_chunks(list(self._masks), self._masks, self._hidden, rows)

    def reserve(self, keys: int) -> None:
        return None

    def add_rows(self, keys: U64, masks: U64) -> None:
        add_by_replica(self, keys, masks)

    def keys_of(self, replica: int) -> list[int]:
        bit = 1 << check_replica(replica) & ~self._hidden
        return [key for key, mask in self._masks.items() if mask & bit] if bit else []

    def _runs_after_prefix(
        self, keys: Sequence[int], with_spec: dict[int, int], speculation: bool
    ) -> dict[int, int]:
        """:meth:`leading_runs` of a long prompt: only its keys after a remembered
        beginning are looked up when it starts with one (see :class:`_Prefix`). A
        beginning is remembered when two lookups in a row with the same first key share
        at least ``_PREFIX_MIN`` keys."""
        masks, hidden = self._masks, self._hidden
        if not isinstance(keys, list):
            keys = list(keys)
        prefixes = self._spec_prefixes if speculation else self._prefixes
        first = keys[0]
        prefix = prefixes.get(first)
        if prefix is not None and prefix.valid:
            size = len(prefix.keys)
            if len(keys) >= size and keys[:size] == prefix.keys:  # (identical keys: fast)
                return prefix.runs_of(keys, masks, with_spec, hidden)
            return _grouped_runs(keys, masks, with_spec, hidden)  # another beginning
        runs = _grouped_runs(keys, masks, with_spec, hidden)
        shared = _shared_length(prefix.keys, keys) if prefix is not None else 0
        if shared >= _PREFIX_MIN:
            self._watched.update(keys[:shared])
            prefix = _Prefix.of(keys[:shared], runs)
        else:  # a candidate: what the next lookup with this first key may share
            prefix = _Prefix(list(keys), 0, {}, False)
        prefixes.pop(first, None)
        prefixes[first] = prefix  # the newest last
        if len(prefixes) > _PREFIXES:
            oldest = next(iter(prefixes))
            if prefixes.pop(oldest).valid:
                self._watch_valid_prefixes()
        return runs

    def _forget_prefixes(self) -> None:
        """A watched key's holders changed, or which replicas are hidden: no remembered
        beginning is valid any more (each stays a candidate for the next lookup)."""
        for prefixes in (self._prefixes, self._spec_prefixes):
            for prefix in prefixes.values():
                prefix.valid = False
        self._watched.clear()  # in place: loops hold it

    def _watch_valid_prefixes(self) -> None:
        watched = self._watched
        watched.clear()
        for prefixes in (self._prefixes, self._spec_prefixes):
            for prefix in prefixes.values():
                if prefix.valid:
                    watched.update(prefix.keys)

    def _finish_clearing(self, replica: int) -> None:
        job = self._clearing.get(replica)
        if job is not None:
            self._step(job, len(job.keys))
            self._end_clearing(replica)

    def _end_clearing(self, replica: int) -> None:
        job = self._clearing.pop(replica)
        self._hidden &= ~job.bit
        self._forget_prefixes()

    def _expire_record(self, record: _Expiry) -> int:
        """Drops the record's keys not recorded again since. Most of a busy proxy's
        records are superseded by later ones: one C-level pass (``in`` over the keys'
        expiries) finds that none is left, and only a record with some left is walked.
        What it drops depends on the keys' last recorded expiries alone, not on which
        expired records ran before it."""
        at, seq, replica, keys = record
        open_record = self._open.get(replica)
        # (its sequence number, not `is`: compiled, a record tuple is not always one object)
        if open_record is not None and open_record[1] == seq:
            del self._open[replica]  # later calls with its expiry (in the past) start anew
        until = self._spec_until.get(replica)
        if until is None or at not in map(until.get, keys):
            return 0
        bit, expired = 1 << replica, 0
        for key in keys:
            if until.get(key) == at:
                del until[key]
                self._drop_spec_bit(key, bit)
                expired += 1
        return expired

    def _step(self, job: _Clearing, budget: int) -> bool:
        changed, more = job.step(self._masks, budget)
        if self._watched and not self._watched.isdisjoint(changed):
            self._forget_prefixes()  # (the replica is hidden: its lookups see no change)
        if self._with_spec:
            for key in changed:
                if key in self._with_spec:
                    self._refresh_with_spec(key)
        return more

    def _drop_spec_bit(self, key: int, bit: int) -> None:
        if self._watched and key in self._watched:
            self._forget_prefixes()
        mask = self._spec_mask.get(key, 0) & ~bit
        if mask:
            self._spec_mask[key] = mask
        else:
            self._spec_mask.pop(key, None)
        self._refresh_with_spec(key)

    def _refresh_with_spec(self, key: int) -> None:
        speculative = self._spec_mask.get(key, 0)
        if speculative:
            self._with_spec[key] = self._masks.get(key, 0) | speculative
        else:
            self._with_spec.pop(key, None)


_GROUPS = 8  # runs of equal masks walked one by one before the general pass takes over
_PREFIX_MIN = 32  # keys a beginning must have to be remembered
_PREFIXES = 32  # beginnings (and candidates) remembered per kind of lookup


@dataclass(slots=True)
class _Prefix:
    """A prompt beginning and where the lookup of its keys ended: ``live``, the replicas
    holding all of them, and ``runs``, the others' leading runs (in the order the walk
    found them). Long prompts mostly start with one another's beginnings (a system
    prompt, a conversation so far), and a proxy records each prompt it routes as
    speculation, rewriting nothing of a beginning it recorded before; so a beginning's
    holders rarely change between lookups, and a prompt starting with one is looked up
    from its end (a 547-key prompt with a 490-key beginning: 57 keys, not 547).

    ``valid`` while no key of it changed holders (the index forgets every beginning
    when a key of one does, and when a replica is hidden or shown: ``_watched``). An
    invalid one is a candidate: its keys are compared with the next lookup's."""

    keys: list[int]
    live: int
    runs: dict[int, int]
    valid: bool

    @classmethod
    def of(cls, keys: list[int], runs: dict[int, int]) -> _Prefix:
        """The beginning ``keys`` of a prompt whose leading runs were ``runs``."""
        size, live, ended = len(keys), 0, {}
        for replica, end in runs.items():
            if end >= size:
                live |= 1 << replica
            else:
                ended[replica] = end
        return cls(keys, live, ended, True)

    def runs_of(
        self, keys: list[int], masks: dict[int, int], with_spec: dict[int, int], hidden: int
    ) -> dict[int, int]:
        """The leading runs of ``keys``, which start with this beginning: those of the
        replicas holding all of it read on from its end, in the walk's order (those
        not holding the next key end there, lowest first, then the others)."""
        runs = dict(self.runs)
        live, size = self.live, len(self.keys)
        if not live:
            return runs
        rest = keys[size:]  # read for the replicas still in the run only
        unseen = hidden | ~live  # (as if hidden)
        if len(rest) <= _GROUPS:
            more = _short_runs(rest, masks, with_spec, unseen)
        else:
            more = _grouped_runs(rest, masks, with_spec, unseen)
        for replica in _bits(live):
            if replica not in more:
                runs[replica] = size
        for replica, end in more.items():
            runs[replica] = size + end
        return runs


def _shared_length(a: list[int], b: list[int]) -> int:
    """How many leading keys ``a`` and ``b`` share: halving, each half compared in C
    (a comparison stops at the first difference)."""
    low, high = 0, min(len(a), len(b))  # a[:low] == b[:low]; a[:high] differs, if not all
    if a[:high] == b[:high]:
        return high
    while high - low > 1:
        middle = (low + high) // 2
        if a[:middle] == b[:middle]:
            low = middle
        else:
            high = middle
    return low


def _grouped_runs(
    keys: Sequence[int], masks: dict[int, int], with_spec: dict[int, int], hidden: int
) -> dict[int, int]:
    """:meth:`BitmaskResidencyIndex.leading_runs` by runs of equal masks."""
    held = _held(keys, masks, with_spec, hidden)
    runs: dict[int, int] = {}
    live, end = 0, 0
    for group, (mask, same) in enumerate(groupby(held)):
        kept = live & mask if group else mask
        for replica in _bits(live & ~kept):
            runs[replica] = end
        if not kept:
            return runs
        if group == _GROUPS:  # ``held`` is just past this run's first mask
            return _runs_by_and(accumulate(held, and_, initial=kept), end, runs)
        live = kept
        end += len(list(same))
    for replica in _bits(live):
        runs[replica] = end
    return runs


def _short_runs(
    keys: Sequence[int], masks: dict[int, int], with_spec: dict[int, int], hidden: int
) -> dict[int, int]:
    """:meth:`BitmaskResidencyIndex.leading_runs` of a few keys, one at a time: the
    same runs in the same order (a key whose mask equals the one before it drops no
    replica, as in a run of equal masks), without the iterator chain that pays off on
    long prompts."""
    runs: dict[int, int] = {}
    get, visible = masks.get, ~hidden
    live = 0
    for end, key in enumerate(keys):
        mask = get(key, 0)
        if with_spec:
            mask = with_spec.get(key, mask)
        if hidden:
            mask &= visible
        kept = live & mask if end else mask
        if live & ~kept:
            for replica in _bits(live & ~kept):
                runs[replica] = end
        if not kept:
            return runs
        live = kept
    for replica in _bits(live):
        runs[replica] = len(keys)
    return runs


def _held(
    keys: Sequence[int], masks: dict[int, int], with_spec: dict[int, int], hidden: int
) -> Iterator[int]:
    """Each key's holder mask, lazily, counting speculation when ``with_spec`` is given."""
    held = map(masks.get, keys, repeat(0))
    if with_spec:  # its mask where it has one, else the confirmed mask
        held = map(with_spec.get, keys, held)
    if hidden:
        held = map(and_, held, repeat(~hidden))
    return held


def _runs_by_and(lives: Iterator[int], offset: int, runs: dict[int, int]) -> dict[int, int]:
    """``runs`` completed from ``lives``, the ANDs of the holder masks from key ``offset``
    on, in one lazy pass that runs at C speed.

    ``live[i]`` is consumed only while non-zero, so the pass stops at the first key no
    replica still in the run holds. Holder sets only shrink along ``live``, so its
    values never increase: where each value ends is a binary search in the reversed
    list (at most one per replica).
    """
    live = list(takewhile(bool, lives))
    rising, total = live[::-1], len(live)
    end = 0
    while end < total:
        mask = live[end]
        end = total - bisect_left(rising, mask)
        following = live[end] if end < total else 0
        for replica in _bits(mask & ~following):
            runs[replica] = offset + end
    return runs


@dataclass(slots=True)
class _Clearing:
    """A step-by-step clear: the holdings when it began, and how far it got. A mask in
    the snapshot may be stale, but never lacks ``bit`` where the index has it: nothing
    adds the replica while it is being cleared."""

    bit: int
    keys: list[int]
    masks: list[int]  # as they were, aligned with keys
    position: int = 0

    def step(self, masks: dict[int, int], budget: int) -> tuple[list[int], bool]:
        """Drop ``bit`` from the next ``budget`` keys: the keys it was dropped from, and
        whether keys remain."""
        end = min(self.position + budget, len(self.keys))
        bit = self.bit
        start = self.position
        chunk = zip(self.keys[start:end], self.masks[start:end], strict=True)
        held = [k for k, m in chunk if m & bit]
        for key in held:
            mask = masks.get(key, 0)
            if mask & bit:
                if mask == bit:
                    del masks[key]
                else:
                    masks[key] = mask & ~bit
        self.position = end
        return held, end < len(self.keys)


def _bits(mask: int) -> list[int]:
    """Ordinals of the set bits of a non-negative ``mask``, lowest first."""
    out = []
    while mask:
        low = mask & -mask
        out.append(low.bit_length() - 1)
        mask ^= low
    return out
