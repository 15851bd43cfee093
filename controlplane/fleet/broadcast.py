"""The routing state as a stream: snapshots, versioned deltas, a ring, many watchers.

Every <= ``delta_interval_ms`` (and at least once a second, as a heartbeat, so a proxy
can tell a quiet fleet from a hung control plane) the fleet's :class:`ChangeLog` becomes
one version: a ``StateUpdate`` carrying the config change (if any) for everyone, plus one
serialized ``Delta`` per pool. A watcher's message for that version is the concatenation
of the common part and its pools' parts: protobuf merges concatenated messages, so each
version is serialized once, whatever the number of watchers.

Versions are kept in a ring, so a proxy that reconnects with a recent ``(epoch,
version)`` gets only what it missed. A snapshot is cut between two versions from the
live state; the changes not yet flushed are in it and again in the next delta, which is
harmless (see :mod:`controlplane.fleet.changes`). Each watcher has a bounded queue; one that
falls that far behind is dropped (its stream ends and it reconnects), so a slow proxy
never delays the others.
"""

from __future__ import annotations

import asyncio
import time
from collections import defaultdict, deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from controlplane.contracts import ConfigSource
from controlplane.fleet.changes import ChangeLog
from controlplane.fleet.fleet import Fleet
from controlplane.fleet.fleet_view import replica_pb
from kvcore.index.base import U64
from kvcore.index.columns import keys_by_replica, restricted, to_columns
from kvcore.pb import routing_pb2

HEARTBEAT_S = 1.0
_FIXED64 = 8
_CHUNK_SLACK = 4096  # framing of chunk, update and per-replica fields


class EmptyConfig:
    """A :class:`ConfigSource` with no workloads, models or keys (fleet-only tests)."""

    def current(self) -> routing_pb2.RoutingConfig:
        return routing_pb2.RoutingConfig()

    def subscribe(self, on_change: object) -> None:
        return None


@dataclass(slots=True)
class Version:
    version: int
    common: bytes  # StateUpdate(epoch, version, delta=config change or empty)
    pools: dict[str, bytes]  # pool -> StateUpdate(delta=that pool's changes)

    def for_pools(self, pools: frozenset[str] | None) -> bytes:
        if pools is None:
            return self.common + b"".join(self.pools.values())
        return self.common + b"".join(part for p, part in self.pools.items() if p in pools)


@dataclass(eq=False)
class Watcher:
    """One proxy's stream: its pools and a bounded queue of serialized updates."""

    pools: frozenset[str] | None
    limit: int
    queue: deque[bytes] = field(default_factory=deque)
    ready: asyncio.Event = field(default_factory=asyncio.Event)
    dropped: bool = False

    def offer(self, version: Version) -> None:
        if self.dropped:
            return
        if len(self.queue) >= self.limit:
            self.dropped = True
            self.queue.clear()
        else:
            self.queue.append(version.for_pools(self.pools))
        self.ready.set()

    async def next_batch(self) -> list[bytes]:
        """The queued updates (waiting for one); empty once the watcher was dropped."""
        await self.ready.wait()
        self.ready.clear()
        batch = list(self.queue)
        self.queue.clear()
        return batch


@dataclass(slots=True)
class BroadcastStats:
    versions: int = 0
    snapshots: int = 0
    watchers_dropped: int = 0
    lag_sum_s: float = 0.0  # first change -> delta out, summed over versions with changes
    lag_max_s: float = 0.0
    lags: int = 0


class Broadcaster:
    """Turns the fleet's changes into versions and hands them to the watchers."""

    def __init__(
        self,
        fleet: Fleet,
        config: ConfigSource,
        *,
        interval_s: float = 0.025,
        ring: int = 1200,
        queue: int = 512,
        chunk_bytes: int = 3 * 1024 * 1024,
        shards: Callable[[], list[routing_pb2.PoolShard]] = list,
    ) -> None:
        self.fleet, self.config, self.shards = fleet, config, shards
        self.epoch = time.time_ns() // 1000
        self.version = 0
        self.interval_s, self.queue_limit, self.chunk_bytes = interval_s, queue, chunk_bytes
        self.ring: deque[Version] = deque(maxlen=ring)
        self.watchers: set[Watcher] = set()
        self.stats = BroadcastStats()
        self._changed = asyncio.Event()
        self._snapshot_cache: tuple[int, frozenset[str] | None, bool, list[bytes]] | None = None
        fleet.changes.on_change = self._changed.set
        config.subscribe(fleet.changes.config_changed)

    async def run(self) -> None:
        """Flush a version every interval with changes, and a heartbeat when quiet."""
        while True:
            try:
                await asyncio.wait_for(self._changed.wait(), HEARTBEAT_S)
            except TimeoutError:
                self.flush()
                continue
            since = self.fleet.changes.since
            wait = 0.0 if since is None else since + self.interval_s - time.monotonic()
            if wait > 0:
                await asyncio.sleep(wait)
            self._changed.clear()
            self.flush()

    def covering(self) -> tuple[int, int]:
        """``(epoch, version)`` of the first version that carries every change applied so
        far: the last one published, or the next when changes wait for it (a flush takes
        them all)."""
        return self.epoch, self.version + (0 if self.fleet.changes.empty() else 1)

    def flush(self) -> Version:
        """Publish everything changed since the last version as the next version."""
        changes = self.fleet.changes.take()
        self.version += 1
        version = Version(self.version, self._common(changes), self._pool_parts(changes))
        self.ring.append(version)
        self.stats.versions += 1
        if changes.since is not None:
            self._lag(time.monotonic() - changes.since)
        for watcher in list(self.watchers):
            watcher.offer(version)
            if watcher.dropped:
                self.stats.watchers_dropped += 1
                self.watchers.discard(watcher)
        return version

    def _lag(self, lag: float) -> None:
        stats = self.stats
        stats.lag_sum_s += lag
        stats.lags += 1
        stats.lag_max_s = max(stats.lag_max_s, lag)

    def _common(self, changes: ChangeLog) -> bytes:
        update = routing_pb2.StateUpdate(epoch=self.epoch, version=self.version)
        update.delta.SetInParent()
        if changes.config:
            update.delta.config.CopyFrom(self.config.current())
        return update.SerializeToString()

    def _pool_parts(self, changes: ChangeLog) -> dict[str, bytes]:
        by_ordinal = self.fleet.by_ordinal
        deltas: dict[str, routing_pb2.Delta] = defaultdict(routing_pb2.Delta)
        for ordinal in changes.replicas:
            record = by_ordinal[ordinal]
            deltas[record.pool].replicas_upserted.append(replica_pb(record))
        for ordinal in changes.loads - changes.replicas:
            record = by_ordinal[ordinal]
            if record.load is not None:
                deltas[record.pool].loads.add(ordinal=ordinal, load=record.load)
        for ordinal, net in changes.residency.items():
            delta = deltas[by_ordinal[ordinal].pool]
            delta.residency.add(
                ordinal=ordinal, cleared=net.cleared, added=net.added, removed=net.removed
            )
        return {
            pool: routing_pb2.StateUpdate(delta=d).SerializeToString() for pool, d in deltas.items()
        }

    # -- watchers ------------------------------------------------------------------------
    def watch(
        self,
        pools: frozenset[str] | None,
        have_epoch: int,
        have_version: int,
        *,
        columns: bool = False,
    ) -> tuple[Watcher, list[bytes]]:
        """Register a watcher and return what it must receive first: the versions it
        missed, or a snapshot (its residency as columns if ``columns``). Synchronous,
        so nothing changes in between."""
        watcher = Watcher(pools, self.queue_limit)
        self.watchers.add(watcher)
        missed = self._missed(pools, have_epoch, have_version)
        if missed is not None:
            return watcher, missed
        return watcher, self.snapshot(pools, columns=columns)

    def unwatch(self, watcher: Watcher) -> None:
        self.watchers.discard(watcher)

    def _missed(
        self, pools: frozenset[str] | None, have_epoch: int, have_version: int
    ) -> list[bytes] | None:
        if have_epoch != self.epoch or have_version > self.version:
            return None
        if have_version == self.version:
            return []
        if not self.ring or self.ring[0].version > have_version + 1:
            return None
        return [v.for_pools(pools) for v in self.ring if v.version > have_version]

    # -- snapshots -----------------------------------------------------------------------
    def snapshot(self, pools: frozenset[str] | None, *, columns: bool = False) -> list[bytes]:
        """The state of ``pools`` as serialized chunks, each below ``chunk_bytes``."""
        cached = self._snapshot_cache
        if cached is not None and cached[:3] == (self.version, pools, columns):
            return cached[3]
        chunks = list(self._chunks(pools, columns))
        self._snapshot_cache = (self.version, pools, columns, chunks)
        self.stats.snapshots += 1
        return chunks

    def _chunks(self, pools: frozenset[str] | None, columns: bool) -> Iterator[bytes]:
        records = self.fleet.replicas_in(pools)
        chunk = routing_pb2.SnapshotChunk(chunk_index=0)
        chunk.config.CopyFrom(self.config.current())
        chunk.replicas.extend(replica_pb(r) for r in records)
        chunk.shards.extend(s for s in self.shards() if pools is None or s.pool in pools)
        keys, masks = restricted(*self.fleet.index.residency(), [r.ordinal for r in records])
        if columns:
            yield from self._column_chunks(chunk, keys, masks)
            return
        room = self.chunk_bytes - chunk.ByteSize() - _CHUNK_SLACK
        for ordinal, held in keys_by_replica(keys, masks):
            keys_of_replica: list[int] = held.tolist()
            start = 0
            while start < len(keys_of_replica):
                if room < 64 * _FIXED64:
                    yield self._chunk_update(chunk, last=False)
                    chunk = routing_pb2.SnapshotChunk(chunk_index=chunk.chunk_index + 1)
                    room = self.chunk_bytes - _CHUNK_SLACK
                part = keys_of_replica[start : start + room // _FIXED64 - 4]
                chunk.residency.add(ordinal=ordinal, keys=part)
                room -= (len(part) + 4) * _FIXED64
                start += len(part)
        yield self._chunk_update(chunk, last=True)

    def _column_chunks(
        self, chunk: routing_pb2.SnapshotChunk, keys: U64, masks: U64
    ) -> Iterator[bytes]:
        """The rows cut into chunks' ``residency_columns``, each chunk below the size."""
        per_row = _FIXED64 * (1 + masks.shape[1])
        start = 0
        while True:
            rows = max(1, (self.chunk_bytes - chunk.ByteSize() - _CHUNK_SLACK) // per_row)
            end = min(start + rows, keys.size)
            total = keys.size if start == 0 else 0
            to_columns(chunk.residency_columns, keys[start:end], masks[start:end], total_rows=total)
            if end == keys.size:
                yield self._chunk_update(chunk, last=True)
                return
            yield self._chunk_update(chunk, last=False)
            chunk = routing_pb2.SnapshotChunk(chunk_index=chunk.chunk_index + 1)
            start = end

    def _chunk_update(self, chunk: routing_pb2.SnapshotChunk, *, last: bool) -> bytes:
        chunk.last_chunk = last
        update = routing_pb2.StateUpdate(epoch=self.epoch, version=self.version, snapshot=chunk)
        return update.SerializeToString()
