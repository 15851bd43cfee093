"""One replica's event stream: which batches to apply, when to resync, when a snapshot ends.

The sidecar's stream semantics (docs/architecture.md, "Sidecar stream semantics") are
decided here and nowhere else, with no I/O, so that every case can be tested alone:

- ``seq`` is contiguous per ``(replica, epoch)``; a duplicate (``seq`` not above the last
  seen) is ignored; a gap asks for a resync, and the batches after it are still applied
  (best effort) until the snapshot replaces the replica's residency;
- a batch with a higher epoch replaces everything known: the residency is cleared; its
  ``seq`` 0 starts an exact stream, any other ``seq`` means its start was missed, so a
  resync is asked for; a lower epoch is stale and ignored;
- a snapshot is a run of ``snapshot=true`` parts with consecutive seqs and one
  ``snapshot_id`` (0 when the sidecar sends one on its own); it is collected only when
  its first part is known to be first (it follows the last seq seen, or it is seq 0 of a
  new epoch, or the ``ResyncReply`` to our request named its seq) and replaces the
  residency when the ``snapshot_done`` part arrives. A part that is missing, or an
  ordinary batch inside a snapshot, abandons it and asks for a resync;
- a part of a snapshot this instance asked for (the ``snapshot_id`` of any of its recent
  requests: under load a snapshot may arrive after the request was repeated) that cannot
  be placed otherwise is first only if the ``ResyncReply`` says so; the reply and the
  snapshot travel on different subscriptions, so when the part comes before the reply the
  verdict is HOLD: the caller keeps this replica's batches until the reply (or a
  timeout) and feeds them again (a part is never taken for the first on its id alone:
  the first part may have been lost);
- an unknown stream (first sight of the replica, after it was marked down) asks for a
  resync unless it starts at seq 0 of its epoch.

The caller (``controlplane.fleet.fleet``) gets back a :class:`Verdict` per batch.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from enum import Enum

from kvcore.pb import events_pb2


class Action(Enum):
    IGNORE = "ignore"  # duplicate, stale epoch, or a snapshot part we cannot use
    APPLY = "apply"  # apply the batch's events on top
    COLLECT = "collect"  # a snapshot part: keep its stores until the snapshot is done
    REPLACE = "replace"  # the last part: residency := collected keys + this part's
    HOLD = "hold"  # a part of our snapshot before its ResyncReply: keep batches until then


@dataclass(frozen=True, slots=True)
class Verdict:
    action: Action
    clear_first: bool = False  # a new epoch: forget the replica's residency first
    resync: str | None = None  # ask the sidecar for a snapshot, for this reason


_APPLY = Verdict(Action.APPLY)  # the usual verdict, made once


@dataclass(slots=True)
class _Snapshot:
    snapshot_id: int
    next_seq: int
    keys: list[int] = field(default_factory=list)


class ReplicaStream:
    """Sequencing state of one replica's ``KvEventBatch`` stream."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        """Forget the stream (first sight, or the replica was marked down)."""
        self.epoch: int | None = None
        self.last_seq: int | None = None  # last seq seen in this epoch
        self.exact = False  # residency mirrors the sidecar (keys may still be missing
        # when it reports state_incomplete)
        self.snapshot: _Snapshot | None = None
        self.asked_ids: deque[int] = deque(maxlen=8)  # our recent resync requests' ids
        self.replies: dict[int, tuple[int, int]] = {}  # snapshot id -> (epoch, first seq)
        self.resync_asked_at: float | None = None
        self.open_part = False  # the last batch seen was a snapshot part, not the last

    def accept(self, batch: events_pb2.KvEventBatch) -> Verdict:
        verdict = self._decide(batch)
        if self.last_seq == batch.seq and self.epoch == batch.epoch:
            self.open_part = batch.snapshot and not batch.snapshot_done
        return verdict

    def _decide(self, batch: events_pb2.KvEventBatch) -> Verdict:
        epoch = self.epoch
        if epoch is not None and batch.epoch < epoch:
            return Verdict(Action.IGNORE)
        if epoch is None or batch.epoch > epoch:
            return self._new_epoch(batch, clear=epoch is not None)
        if self.last_seq is not None and batch.seq <= self.last_seq:
            return Verdict(Action.IGNORE)
        if batch.snapshot:
            return self._snapshot_part(batch)
        return self._ordinary(batch)

    def expect_snapshot(self, snapshot_id: int, epoch: int, first_seq: int) -> None:
        """The ``ResyncReply`` to request ``snapshot_id``: its snapshot starts at
        ``first_seq`` of ``epoch``."""
        self.replies[snapshot_id] = (epoch, first_seq)
        for old in [i for i in self.replies if i not in self.asked_ids]:
            del self.replies[old]

    def forget_requests(self) -> None:
        """No reply came: parts of the snapshots asked for so far cannot be placed."""
        self.asked_ids.clear()
        self.replies.clear()

    def collect(self, keys: list[int]) -> None:
        if self.snapshot is not None:
            self.snapshot.keys.extend(keys)

    def take_snapshot(self) -> list[int]:
        """The collected keys once the REPLACE verdict was given."""
        keys = self.snapshot.keys if self.snapshot is not None else []
        self.snapshot = None
        return keys

    def _new_epoch(self, batch: events_pb2.KvEventBatch, *, clear: bool) -> Verdict:
        ours = self._first_of_ours(batch) if batch.snapshot and batch.seq else False
        if ours is None:
            return Verdict(Action.HOLD)
        self.epoch, self.last_seq, self.snapshot, self.exact = batch.epoch, None, None, False
        if batch.seq == 0:
            self.exact = not batch.snapshot
            verdict = self._snapshot_start(batch) if batch.snapshot else self._advance(batch)
            return Verdict(verdict.action, clear_first=clear, resync=verdict.resync)
        if ours:
            verdict = self._snapshot_start(batch)
            return Verdict(verdict.action, clear_first=clear)
        self.last_seq = batch.seq
        if batch.snapshot:  # joined in the middle of a snapshot: wait for ours
            return Verdict(Action.IGNORE, clear_first=clear, resync=_reason(clear, "snapshot"))
        return Verdict(Action.APPLY, clear_first=clear, resync=_reason(clear, "stream"))

    def _ordinary(self, batch: events_pb2.KvEventBatch) -> Verdict:
        if self.snapshot is not None:
            self.snapshot, self.exact, self.last_seq = None, False, batch.seq
            return Verdict(Action.APPLY, resync="snapshot part lost")
        return self._advance(batch)

    def _advance(self, batch: events_pb2.KvEventBatch) -> Verdict:
        contiguous = self.last_seq is None and batch.seq == 0
        contiguous = contiguous or (self.last_seq is not None and batch.seq == self.last_seq + 1)
        self.last_seq = batch.seq
        if contiguous or not self.exact:
            return _APPLY
        self.exact = False
        return Verdict(Action.APPLY, resync="seq gap")

    def _snapshot_part(self, batch: events_pb2.KvEventBatch) -> Verdict:
        snap = self.snapshot
        if (
            snap is not None
            and batch.seq == snap.next_seq
            and batch.snapshot_id == snap.snapshot_id
        ):
            self.last_seq = batch.seq
            snap.next_seq += 1
            return Verdict(Action.REPLACE if batch.snapshot_done else Action.COLLECT)
        follows = self.last_seq is not None and batch.seq == self.last_seq + 1
        first = (follows and snap is None and not self.open_part) or self._first_of_ours(batch)
        if first is None:
            return Verdict(Action.HOLD)
        if first:
            return self._snapshot_start(batch)
        self.snapshot, self.exact, self.last_seq = None, False, batch.seq
        return Verdict(Action.IGNORE, resync="snapshot part lost")

    def _first_of_ours(self, batch: events_pb2.KvEventBatch) -> bool | None:
        """Whether this part starts a snapshot we asked for, as its reply says; ``None``
        when it is ours but its reply has not been seen yet."""
        if batch.snapshot_id == 0 or batch.snapshot_id not in self.asked_ids:
            return False
        reply = self.replies.get(batch.snapshot_id)
        return None if reply is None else reply == (batch.epoch, batch.seq)

    def _snapshot_start(self, batch: events_pb2.KvEventBatch) -> Verdict:
        self.last_seq = batch.seq
        self.snapshot = _Snapshot(batch.snapshot_id, batch.seq + 1)
        return Verdict(Action.REPLACE if batch.snapshot_done else Action.COLLECT)

    def snapshot_applied(self) -> None:
        self.exact, self.resync_asked_at = True, None


def _reason(new_epoch: bool, what: str) -> str:
    return f"new epoch, missed its start ({what})" if new_epoch else f"unknown stream ({what})"
