"""A minimal ``RoutingState.Watch`` client: applies snapshots and deltas to plain sets.

What the benchmarks and tests use to see the routing state as a proxy would, without
the proxy: it checks the stream's rules (one version for all chunks of a snapshot,
then deltas each one version higher, on one epoch) and keeps, per ordinal, the replica
and the set of keys it holds.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import grpc

from kvcore.pb import routing_pb2

WATCH_METHOD = "/kvroute.v1.RoutingState/Watch"
REPORT_METHOD = "/kvroute.v1.RoutingState/Report"


class StreamBroken(AssertionError):
    """The stream broke its own rules (a version gap, a chunk out of order)."""


@dataclass
class StateMirror:
    epoch: int = 0
    version: int = 0
    complete: bool = False  # a whole snapshot was applied
    replicas: dict[int, routing_pb2.Replica] = field(default_factory=dict)
    residency: dict[int, set[int]] = field(default_factory=dict)
    config: routing_pb2.RoutingConfig = field(default_factory=routing_pb2.RoutingConfig)
    shards: list[routing_pb2.PoolShard] = field(default_factory=list)
    updates: int = 0
    snapshots: int = 0
    on_update: Callable[[routing_pb2.StateUpdate], None] | None = None
    _pending: tuple[dict[int, routing_pb2.Replica], dict[int, set[int]], int] | None = None

    def apply(self, update: routing_pb2.StateUpdate) -> None:
        self.updates += 1
        if update.WhichOneof("body") == "snapshot":
            self._chunk(update)
        else:
            self._delta(update)
        if self.on_update is not None:
            self.on_update(update)

    def _chunk(self, update: routing_pb2.StateUpdate) -> None:
        chunk = update.snapshot
        if chunk.chunk_index == 0:
            self._pending = ({}, {}, 0)
            self.config, self.shards = chunk.config, list(chunk.shards)
        if self._pending is None or chunk.chunk_index != self._pending[2]:
            raise StreamBroken(f"chunk {chunk.chunk_index} out of order")
        replicas, residency, index = self._pending
        replicas.update((r.ordinal, r) for r in chunk.replicas)
        for blocks in chunk.residency:
            residency.setdefault(blocks.ordinal, set()).update(blocks.keys)
        self._pending = (replicas, residency, index + 1)
        if chunk.last_chunk:
            self.replicas, self.residency = replicas, residency
            self.epoch, self.version, self.complete = update.epoch, update.version, True
            self._pending = None
            self.snapshots += 1

    def _delta(self, update: routing_pb2.StateUpdate) -> None:
        if not self.complete or update.epoch != self.epoch:
            raise StreamBroken("delta before a snapshot, or of another epoch")
        if update.version != self.version + 1:
            raise StreamBroken(f"version {update.version} after {self.version}")
        delta = update.delta
        if delta.HasField("config"):
            self.config = delta.config
        self.replicas.update((r.ordinal, r) for r in delta.replicas_upserted)
        for load in delta.loads:
            if load.ordinal in self.replicas:
                self.replicas[load.ordinal].load.CopyFrom(load.load)
        for change in delta.residency:
            held = self.residency.setdefault(change.ordinal, set())
            if change.cleared:
                held.clear()
            held.update(change.added)
            held.difference_update(change.removed)
        self.version = update.version

    def keys_of(self, replica_id: str) -> set[int]:
        for ordinal, replica in self.replicas.items():
            if replica.replica_id == replica_id:
                return self.residency.get(ordinal, set())
        return set()


async def watch(
    address: str,
    mirror: StateMirror,
    *,
    pools: tuple[str, ...] = (),
    resume: bool = False,
    credentials: grpc.ChannelCredentials | None = None,
) -> None:
    """Apply the stream to ``mirror`` until it ends (raises grpc's error if it fails)."""
    options = [("grpc.max_receive_message_length", 16 * 1024 * 1024)]
    if credentials is None:
        channel = grpc.aio.insecure_channel(address, options=options)
    else:
        channel = grpc.aio.secure_channel(address, credentials, options=options)
    async with channel:
        method = channel.unary_stream(
            WATCH_METHOD,
            request_serializer=routing_pb2.WatchRequest.SerializeToString,
            response_deserializer=routing_pb2.StateUpdate.FromString,
        )
        request = routing_pb2.WatchRequest(proxy_id="mirror", pools=pools)
        if resume:
            request.have_epoch, request.have_version = mirror.epoch, mirror.version
        async for update in method(request):
            mirror.apply(update)


async def drain(address: str, pools: tuple[str, ...] = (), read: list[int] | None = None) -> None:
    """Read the stream as a proxy would receive it, without parsing or applying it
    (another watcher of the same state), counting the updates in ``read[0]``."""
    options = [("grpc.max_receive_message_length", 16 * 1024 * 1024)]
    async with grpc.aio.insecure_channel(address, options=options) as channel:
        method = channel.unary_stream(
            WATCH_METHOD, request_serializer=routing_pb2.WatchRequest.SerializeToString
        )
        async for _ in method(routing_pb2.WatchRequest(proxy_id="drain", pools=pools)):
            if read is not None:
                read[0] += 1
