"""The fleet as the control plane knows it: replicas, their load and liveness, residency.

This is the state both instances keep warm from NATS and serve to proxies. It is
synchronous and does no I/O: ``controlplane.fleet.ingest`` decodes messages and calls
:meth:`Fleet.on_announce`, :meth:`Fleet.on_load` and :meth:`Fleet.on_batch`; asking a
sidecar for a resync goes through the ``resync`` callback; every change is also recorded
in :attr:`Fleet.changes` for the next delta to proxies.

Liveness comes from evidence about a replica, not from the bus's silence. A replica
silent past the heartbeat timeout is marked down (its residency dropped) only when its
silence says something about it: silence counts from when this instance's NATS link last
came up, never while it is down, and when more than ``panic_threshold`` of the live replicas
fall silent together (Envoy's panic threshold; "together": silent past half the timeout
when the first is past all of it, so replicas whose last reports were a sweep apart are
not downed one by one) the bus, not the fleet, is the likelier fault. Those replicas are
kept as they were and flagged ``stale`` instead: proxies go on routing to them on their
last state and on what they see themselves (connect failures, their breaker). Any message
from a replica clears ``stale``; an announce or a load report clears ``down``.

Replicas get a small ordinal on first sight (the residency index's bit), stable for the
life of the process. Only the device tier (``MEDIUM_GPU``) is residency: routing cares
about what a prefill can reuse without a copy.
"""

from __future__ import annotations

import itertools
import random
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from controlplane.fleet.changes import ChangeLog
from controlplane.fleet.stream import Action, ReplicaStream
from kvcore.index import MAX_REPLICA_ORDINAL, CompactResidencyIndex
from kvcore.pb import events_pb2

GPU = events_pb2.MEDIUM_GPU
MAX_HELD_BATCHES = 10_000  # waiting for a ResyncReply; past this, stop waiting
TOGETHER_SHARE = 0.5  # of the heartbeat timeout: silent this long beside a silent one


class FleetFull(RuntimeError):
    """More replicas than the residency index has ordinals for."""


@dataclass(slots=True)
class ReplicaRecord:
    ordinal: int
    replica_id: str
    pool: str
    announce: events_pb2.ReplicaAnnounce | None = None
    load: events_pb2.LoadReport | None = None
    last_seen: float = 0.0  # monotonic
    last_seen_wall: float = 0.0
    down: bool = False
    stale: bool = False  # silent while silence was no evidence: kept as it was, not downed
    draining: bool = False  # set by an operator, persisted in etcd
    stream: ReplicaStream = field(default_factory=ReplicaStream)
    held: list[events_pb2.KvEventBatch] | None = None  # batches kept until a ResyncReply
    held_since: float = 0.0
    # the keys of prefixes being warmed there, not confirmed yet (None: not warming;
    # controlplane.fleet.warmup sets it on the leader)
    warmup: frozenset[int] | None = None

    @property
    def announced(self) -> bool:
        return self.announce is not None

    @property
    def is_draining(self) -> bool:
        return self.draining or (self.announce is not None and self.announce.draining)

    @property
    def state_incomplete(self) -> bool:
        return self.announce is not None and self.announce.state_incomplete


@dataclass(slots=True)
class FleetStats:
    block_events: int = 0  # keys stored or removed, plus clears
    batches: int = 0
    batches_ignored: int = 0
    snapshots_applied: int = 0
    resyncs: dict[str, int] = field(default_factory=dict)  # reason -> count
    replicas_kept_stale: int = 0  # times a silent replica was kept (stale) instead


Resync = Callable[[ReplicaRecord, str, int], None]  # record, reason, snapshot_id


class Fleet:
    """Replicas by id and ordinal, one residency index, and the change log."""

    def __init__(
        self,
        *,
        heartbeat_timeout_s: float,
        resync_retry_s: float = 2.0,
        resync: Resync | None = None,
        panic_threshold: float = 0.5,
    ) -> None:
        self.index = CompactResidencyIndex()
        self.by_id: dict[str, ReplicaRecord] = {}
        self.by_ordinal: dict[int, ReplicaRecord] = {}
        self.drained: set[str] = set()  # replica ids an operator drained (from etcd)
        self.changes = ChangeLog()
        self.stats = FleetStats()
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.panic_threshold = panic_threshold
        self.resync_retry_s = resync_retry_s
        self.resync: Resync = resync or (lambda record, reason, snapshot_id: None)
        self._snapshot_ids = itertools.count(random.randrange(1, 2**62))

    # -- membership and load ---------------------------------------------------------
    def record(self, pool: str, replica_id: str, now: float) -> ReplicaRecord:
        """The replica's record, created (with the next ordinal) on first sight."""
        record = self.by_id.get(replica_id)
        if record is None:
            ordinal = len(self.by_ordinal)
            if ordinal > MAX_REPLICA_ORDINAL:
                raise FleetFull(f"more than {MAX_REPLICA_ORDINAL + 1} replicas")
            record = ReplicaRecord(ordinal, replica_id, pool, last_seen=now)
            record.draining = replica_id in self.drained
            self.by_id[replica_id] = self.by_ordinal[ordinal] = record
            self.changes.replica(ordinal)
        return record

    def on_announce(self, msg: events_pb2.ReplicaAnnounce, now: float) -> ReplicaRecord:
        record = self.record(msg.pool, msg.replica_id, now)
        changed = record.announce is None or _announce_differs(record.announce, msg)
        record.announce, record.pool = msg, msg.pool
        self._seen(record, now)
        if self._revive(record) or changed:
            self.changes.replica(record.ordinal)
        self._resync_if_unknown(record)
        return record

    def on_load(self, msg: events_pb2.LoadReport, pool: str, now: float) -> None:
        record = self.record(pool, msg.replica_id, now)
        record.load = msg
        self._seen(record, now)
        if self._revive(record):
            self.changes.replica(record.ordinal)
        self.changes.load(record.ordinal)
        self._resync_if_unknown(record)

    def _seen(self, record: ReplicaRecord, now: float) -> None:
        record.last_seen, record.last_seen_wall = now, time.time()
        record.stale = False

    @staticmethod
    def _revive(record: ReplicaRecord) -> bool:
        """An announce or a load report proves the replica's sidecar is there: not down
        (its residency comes back through the resync an unknown stream asks for)."""
        if not record.down:
            return False
        record.down = False
        return True

    def _resync_if_unknown(self, record: ReplicaRecord) -> None:
        if not record.down and record.stream.epoch is None:
            self._ask_resync(record, "unknown stream")

    def _ask_resync(self, record: ReplicaRecord, reason: str) -> None:
        stream = record.stream
        now = time.monotonic()
        asked = stream.resync_asked_at
        if asked is not None and now - asked < self.resync_retry_s:
            return
        stream.resync_asked_at = now
        snapshot_id = next(self._snapshot_ids)
        stream.asked_ids.append(snapshot_id)
        self.stats.resyncs[reason] = self.stats.resyncs.get(reason, 0) + 1
        self.resync(record, reason, snapshot_id)

    def set_draining(self, replica_id: str, draining: bool) -> ReplicaRecord | None:
        """Drain or undrain, also a replica not seen yet (it starts drained)."""
        if draining:
            self.drained.add(replica_id)
        else:
            self.drained.discard(replica_id)
        record = self.by_id.get(replica_id)
        if record is not None and record.draining != draining:
            record.draining = draining
            self.changes.replica(record.ordinal)
        return record

    def set_warmup(self, replica_id: str, pending: frozenset[int] | None) -> None:
        """A warm-up's state as the leader shared it (see ``Leadership``); a replica not
        seen yet is left alone (the leader shares it again as its warm-up goes on)."""
        record = self.by_id.get(replica_id)
        if record is not None and record.warmup != pending:
            record.warmup = pending
            self.changes.replica(record.ordinal)

    # -- residency -----------------------------------------------------------------
    def on_batch(self, batch: events_pb2.KvEventBatch, pool: str, now: float) -> None:
        record = self.record(pool, batch.replica_id, now)
        self._seen(record, now)
        self.stats.batches += 1
        if record.held is not None:
            record.held.append(batch)
            if len(record.held) > MAX_HELD_BATCHES:
                self.release(record, reply_lost=True)
            return
        self._sequence(record, batch)

    def _sequence(self, record: ReplicaRecord, batch: events_pb2.KvEventBatch) -> None:
        stream = record.stream
        verdict = stream.accept(batch)
        if verdict.action is Action.HOLD:
            record.held, record.held_since = [batch], time.monotonic()
            return
        if verdict.clear_first:
            self.clear(record)
        if verdict.resync is not None:
            self._ask_resync(record, verdict.resync)
        action = verdict.action
        if action is Action.APPLY:
            self._apply(record.ordinal, batch.events)
        elif action is Action.IGNORE:
            self.stats.batches_ignored += 1
        else:
            stream.collect(_stored_keys(batch.events))
            if action is Action.REPLACE:
                self._replace(record, stream.take_snapshot())
                stream.snapshot_applied()

    def _apply(self, ordinal: int, events: object) -> None:
        """Apply events in order; consecutive stores (or removals) go to the index as one
        call, which keeps their order relative to the other kind."""
        counted = 0
        for kind, keys in _runs_of(events):
            if kind == "stored":
                self.index.add(ordinal, keys)
                self.changes.residency_of(ordinal).add(keys)
            elif kind == "removed":
                self.index.remove(ordinal, keys)
                self.changes.residency_of(ordinal).remove(keys)
            else:
                self.index.clear_replica(ordinal)
                self.changes.residency_of(ordinal).clear()
            counted += len(keys) or 1
        self.stats.block_events += counted

    def _replace(self, record: ReplicaRecord, keys: list[int]) -> None:
        self.clear(record)
        self.index.add(record.ordinal, keys)
        self.changes.residency_of(record.ordinal).add(keys)
        self.stats.block_events += len(keys)
        self.stats.snapshots_applied += 1

    def clear(self, record: ReplicaRecord) -> None:
        self.index.clear_replica(record.ordinal)
        self.changes.residency_of(record.ordinal).clear()

    # -- liveness --------------------------------------------------------------------
    def expire(self, now: float, heard_since: float | None = 0.0) -> list[ReplicaRecord]:
        """Mark replicas silent past the heartbeat timeout down, or stale when silence is
        no evidence (see the module docstring); the caller drops the downed replicas'
        residency with :meth:`drop_steps`.

        ``heard_since`` is when this instance's NATS link last came up (monotonic), or
        ``None`` while it is down: silence counts only from then."""
        live = [r for r in self.by_ordinal.values() if not r.down]
        silences = [(r, self._silent_for(r, now, heard_since)) for r in live]
        silent = [r for r, s in silences if s > self.heartbeat_timeout_s]
        if not silent:
            return []
        together = sum(1 for _, s in silences if s > self.heartbeat_timeout_s * TOGETHER_SHARE)
        if heard_since is None or together > self.panic_threshold * len(live):
            for record in silent:
                self._keep_stale(record)
            return []
        for record in silent:
            self._mark_down(record)
        return silent

    @staticmethod
    def _silent_for(record: ReplicaRecord, now: float, heard_since: float | None) -> float:
        if heard_since is None:
            return now - record.last_seen
        return now - max(record.last_seen, heard_since)

    def _keep_stale(self, record: ReplicaRecord) -> None:
        if not record.stale:
            record.stale = True
            self.stats.replicas_kept_stale += 1

    def _mark_down(self, record: ReplicaRecord) -> None:
        record.down, record.stale = True, False
        record.stream.reset()
        self.changes.replica(record.ordinal)
        self.changes.residency_of(record.ordinal).clear()

    def stale_count(self) -> int:
        return sum(1 for r in self.by_ordinal.values() if r.stale and not r.down)

    def resync_all(self, reason: str) -> None:
        """Ask every live replica for its state (after this instance could not hear it)."""
        for record in self.by_ordinal.values():
            if not record.down:
                self._ask_resync(record, reason)

    def drop_steps(self, record: ReplicaRecord, chunk: int) -> Iterator[int]:
        """Drop a down replica's residency in steps (lookups stop seeing it at once)."""
        return self.index.clear_replica_steps(record.ordinal, chunk=chunk)

    def on_resync_reply(
        self, record: ReplicaRecord, snapshot_id: int, epoch: int, first_seq: int
    ) -> None:
        """The sidecar accepted resync ``snapshot_id``: its snapshot starts at
        ``first_seq``; batches held for this are sequenced now."""
        record.stream.expect_snapshot(snapshot_id, epoch, first_seq)
        self.release(record)

    def release(self, record: ReplicaRecord, *, reply_lost: bool = False) -> None:
        """Sequence the held batches again (once the reply came, or without it)."""
        held, record.held = record.held, None
        if reply_lost:
            record.stream.forget_requests()
        for batch in held or ():
            if record.held is not None:  # held again (a part of a later request)
                record.held.append(batch)
            else:
                self._sequence(record, batch)

    def retry_resyncs(self) -> None:
        """Stop waiting for replies that did not come; ask again for overdue snapshots."""
        now = time.monotonic()
        for record in self.by_ordinal.values():
            if record.held is not None and now - record.held_since >= self.resync_retry_s:
                self.release(record, reply_lost=True)
            if not record.down and not record.stream.exact:
                self._ask_resync(record, "snapshot overdue")

    def replicas_in(self, pools: frozenset[str] | None) -> list[ReplicaRecord]:
        records = self.by_ordinal.values()
        return [r for r in records if pools is None or r.pool in pools]


def _runs_of(events: object) -> Iterator[tuple[str, list[int]]]:
    """``(kind, keys)`` of each run of consecutive device-tier stores or removals, and
    ``("cleared", [])`` for each clear, in order."""
    kind, keys = "", list[int]()
    for event in events:  # type: ignore[attr-defined]
        this = event.WhichOneof("kind")
        if this == "cleared":
            if keys:
                yield kind, keys
            kind, keys = "", []
            yield "cleared", []
            continue
        body = event.stored if this == "stored" else event.removed
        if body.medium != GPU:
            continue
        if this != kind and keys:
            yield kind, keys
            keys = []
        kind = this
        keys.extend(body.keys)
    if keys:
        yield kind, keys


def _stored_keys(events: object) -> list[int]:
    keys: list[int] = []
    for event in events:  # type: ignore[attr-defined]
        if event.WhichOneof("kind") == "stored" and event.stored.medium == GPU:
            keys.extend(event.stored.keys)
    return keys


def _announce_differs(old: events_pb2.ReplicaAnnounce, new: events_pb2.ReplicaAnnounce) -> bool:
    """Whether anything a proxy sees changed (the timestamp does not count)."""
    old_ts, new_ts = old.ts, new.ts
    try:
        old.ts = new.ts = 0.0
        return bool(old != new)
    finally:
        old.ts, new.ts = old_ts, new_ts
