"""Router events -> ``KvEventBatch`` messages: seq, epoch, coalescing, bounds, snapshots.

No I/O here: the service moves the bytes. What this module guarantees is what the control
plane relies on:

- ``seq`` is contiguous per ``(replica, epoch)`` from 0: a seq is given to a batch only
  when it is built for sending, so a dropped event never leaves a hole that looks like a
  network loss;
- events wait in a buffer bounded in events and in keys (``max_pending_events``,
  ``max_pending_keys``) while NATS is away; past either bound the oldest are dropped,
  counted, and the outbox asks for a snapshot, so the published state becomes exact
  again as soon as a snapshot goes out;
- a snapshot is the sidecar's whole state as ``snapshot=true`` batches, the last one
  ``snapshot_done``, chained runs kept together with their parent key; the events still
  pending when it is taken are already in it, so they are discarded.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

from kvcore.engine_events import MEDIUM_CPU, MEDIUM_DISK, MEDIUM_GPU
from kvcore.pb import events_pb2
from sidecar.key_mapper import RouterEvent, RouterRemoved, RouterStored, chain_runs

MEDIUM_PB = {
    MEDIUM_GPU: events_pb2.MEDIUM_GPU,
    MEDIUM_CPU: events_pb2.MEDIUM_CPU,
    MEDIUM_DISK: events_pb2.MEDIUM_DISK,
}


@dataclass(frozen=True, slots=True)
class OutboxConfig:
    replica_id: str
    pool: str
    max_batch_events: int = 512
    max_event_keys: int = 4096  # longer stores are split, so a message stays small
    max_pending_events: int = 100_000
    max_pending_keys: int = 1_000_000  # ~8 MB of keys
    snapshot_batch_keys: int = 8192


@dataclass(slots=True)
class OutboxStats:
    events_in: int = 0
    events_published: int = 0
    batches_published: int = 0
    events_dropped: int = 0
    snapshots: int = 0


@dataclass(frozen=True, slots=True)
class OutgoingBatch:
    seq: int
    payload: bytes
    events: int
    oldest_received_ns: int | None  # monotonic receive time of its oldest engine frame


@dataclass(slots=True)
class _Pending:
    event: RouterEvent
    received_ns: int


def _weight(event: RouterEvent) -> int:
    return len(event.keys) if isinstance(event, RouterStored | RouterRemoved) else 1


def split_stored(event: RouterStored, limit: int) -> list[RouterStored]:
    """A long store as consecutive stores of at most ``limit`` keys, still chained."""
    if len(event.keys) <= limit:
        return [event]
    parts, parent = [], event.parent_key
    for start in range(0, len(event.keys), limit):
        chunk = event.keys[start : start + limit]
        parts.append(RouterStored(chunk, parent, event.medium))
        parent = chunk[-1]
    return parts


def fill_event(target: events_pb2.KvEvent, event: RouterEvent) -> None:
    if isinstance(event, RouterStored):
        target.stored.keys.extend(event.keys)
        target.stored.medium = MEDIUM_PB.get(event.medium, events_pb2.MEDIUM_OTHER)
        if event.parent_key is not None:
            target.stored.parent_key = event.parent_key
    elif isinstance(event, RouterRemoved):
        target.removed.keys.extend(event.keys)
        target.removed.medium = MEDIUM_PB.get(event.medium, events_pb2.MEDIUM_OTHER)
    else:
        target.cleared.SetInParent()


class Outbox:
    def __init__(self, config: OutboxConfig, epoch: int) -> None:
        self.config = config
        self.stats = OutboxStats()
        self.epoch = epoch
        self.next_seq = 0
        self.needs_snapshot = False
        self._pending: deque[_Pending] = deque()
        self._pending_keys = 0

    @property
    def depth(self) -> int:
        return len(self._pending)

    @property
    def depth_keys(self) -> int:
        return self._pending_keys

    def _pop(self) -> RouterEvent:
        event = self._pending.popleft().event
        self._pending_keys -= _weight(event)
        return event

    def _clear_pending(self) -> None:
        self._pending.clear()
        self._pending_keys = 0

    def add(self, events: Iterable[RouterEvent], received_ns: int) -> None:
        for event in events:
            parts = (
                split_stored(event, self.config.max_event_keys)
                if isinstance(event, RouterStored)
                else [event]
            )
            for part in parts:
                self._pending.append(_Pending(part, received_ns))
                self._pending_keys += _weight(part)
                self.stats.events_in += 1
        self._enforce_bound()

    def _enforce_bound(self) -> None:
        config = self.config
        while self._pending and (
            len(self._pending) > config.max_pending_events
            or self._pending_keys > config.max_pending_keys
        ):
            self._pop()
            self.stats.events_dropped += 1
            self.needs_snapshot = True

    def new_epoch(self, epoch: int) -> None:
        """A new sidecar epoch (engine restart): seq restarts, nothing old is sent."""
        self.epoch, self.next_seq = epoch, 0
        self._clear_pending()
        self.needs_snapshot = False

    def _batch(self, **fields: object) -> events_pb2.KvEventBatch:
        batch = events_pb2.KvEventBatch(
            replica_id=self.config.replica_id,
            pool=self.config.pool,
            epoch=self.epoch,
            seq=self.next_seq,
            ts=time.time(),
            **fields,  # type: ignore[arg-type]
        )
        self.next_seq += 1
        return batch

    def take_batch(self) -> OutgoingBatch | None:
        """The next batch of pending events, or ``None`` when nothing waits."""
        if not self._pending:
            return None
        batch = self._batch()
        count = min(len(self._pending), self.config.max_batch_events)
        oldest = self._pending[0].received_ns
        for _ in range(count):
            fill_event(batch.events.add(), self._pop())
        self.stats.batches_published += 1
        self.stats.events_published += count
        return OutgoingBatch(batch.seq, batch.SerializeToString(), count, oldest)

    def snapshot(
        self, held: Iterable[tuple[str, int, int | None]], snapshot_id: int
    ) -> list[OutgoingBatch]:
        """The whole state as snapshot batches; pending events are in it, so dropped."""
        self._clear_pending()
        self.needs_snapshot = False
        self.stats.snapshots += 1
        runs = list(chain_runs(held))
        groups = _group_runs(runs, self.config.snapshot_batch_keys) or [[]]
        out = []
        for index, group in enumerate(groups):
            done = index == len(groups) - 1
            batch = self._batch(snapshot=True, snapshot_done=done, snapshot_id=snapshot_id)
            for run in group:
                fill_event(batch.events.add(), run)
            out.append(OutgoingBatch(batch.seq, batch.SerializeToString(), len(group), None))
        return out


def _group_runs(runs: list[RouterStored], limit: int) -> list[list[RouterStored]]:
    groups: list[list[RouterStored]] = []
    size = limit
    for run in runs:
        for part in split_stored(run, limit):
            if size + len(part.keys) > limit:
                groups.append([])
                size = 0
            groups[-1].append(part)
            size += len(part.keys)
    return groups
