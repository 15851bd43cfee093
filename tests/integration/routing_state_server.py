"""A real grpc.aio ``RoutingState`` server for the proxy's client tests, scripted by them.

It serves the real proto by full method name (as the control plane does: no generated
stubs), keeps a small fleet (replicas and residency) that published deltas change, a
ring of recent deltas for resuming watchers, and records every Watch request and every
ProxyReport it receives. Tests publish deltas, inject raw updates (a gap), end streams
or stop the server, and watch the client cope.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterable

import grpc

from kvcore.pb import routing_pb2

SERVICE = "kvroute.v1.RoutingState"


class RoutingStateServer:
    def __init__(
        self,
        epoch: int,
        replicas: Iterable[routing_pb2.Replica] = (),
        residency: dict[int, Iterable[int]] | None = None,
        *,
        port: int = 0,
        credentials: grpc.ServerCredentials | None = None,
        chunks: int = 2,
    ) -> None:
        self.epoch = epoch
        self.version = 1
        self.replicas = {r.ordinal: r for r in replicas}
        self.residency = {o: list(keys) for o, keys in (residency or {}).items()}
        self.ring: list[routing_pb2.StateUpdate] = []
        self.watch_requests: list[routing_pb2.WatchRequest] = []
        self.snapshots_sent = 0
        self.reports: list[routing_pb2.ProxyReport] = []
        self.report_streams = 0
        self.silent = False  # after the snapshot, send nothing (a hung control plane)
        self._port = port
        self._credentials = credentials
        self._chunks = chunks
        self._queues: list[asyncio.Queue[routing_pb2.StateUpdate | None]] = []
        self._changed = asyncio.Condition()
        self._server: grpc.aio.Server | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self._port}"

    async def start(self) -> RoutingStateServer:
        server = grpc.aio.server()
        handler = grpc.method_handlers_generic_handler(
            SERVICE,
            {
                "Watch": grpc.unary_stream_rpc_method_handler(
                    self._watch,
                    request_deserializer=routing_pb2.WatchRequest.FromString,
                    response_serializer=routing_pb2.StateUpdate.SerializeToString,
                ),
                "Report": grpc.stream_unary_rpc_method_handler(
                    self._report,
                    request_deserializer=routing_pb2.ProxyReport.FromString,
                    response_serializer=routing_pb2.ReportAck.SerializeToString,
                ),
            },
        )
        server.add_generic_rpc_handlers((handler,))
        target = f"127.0.0.1:{self._port}"
        if self._credentials is None:
            self._port = server.add_insecure_port(target)
        else:
            self._port = server.add_secure_port(target, self._credentials)
        await server.start()
        self._server = server
        return self

    async def stop(self) -> None:
        self.end_streams()
        if self._server is not None:
            await self._server.stop(grace=None)
            self._server = None

    # -- what tests do ------------------------------------------------------------

    def publish(self, delta: routing_pb2.Delta) -> int:
        """Apply ``delta`` to the fleet, keep it in the ring, send it; its version."""
        self.version += 1
        for info in delta.replicas_upserted:
            self.replicas[info.ordinal] = info
        for ordinal in delta.replicas_removed:
            self.replicas.pop(ordinal, None)
            self.residency.pop(ordinal, None)
        for change in delta.residency:
            held = [] if change.cleared else self.residency.get(change.ordinal, [])
            removed = set(change.removed)
            held = [k for k in [*held, *change.added] if k not in removed]
            self.residency[change.ordinal] = held
        update = routing_pb2.StateUpdate(epoch=self.epoch, version=self.version, delta=delta)
        self.ring.append(update)
        self.send(update)
        return self.version

    def send(self, update: routing_pb2.StateUpdate) -> None:
        """Send a raw update to every watcher (a test may send a broken one)."""
        for queue in self._queues:
            queue.put_nowait(update)

    def end_streams(self) -> None:
        for queue in self._queues:
            queue.put_nowait(None)

    async def wait_for_watches(self, count: int) -> None:
        async with self._changed:
            await self._changed.wait_for(lambda: len(self.watch_requests) >= count)

    async def wait_for_reports(self, count: int) -> None:
        async with self._changed:
            await self._changed.wait_for(lambda: len(self.reports) >= count)

    # -- the service ----------------------------------------------------------------

    async def _watch(
        self, request: routing_pb2.WatchRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[routing_pb2.StateUpdate]:
        queue: asyncio.Queue[routing_pb2.StateUpdate | None] = asyncio.Queue()
        self._queues.append(queue)
        async with self._changed:
            self.watch_requests.append(request)
            self._changed.notify_all()
        try:
            for update in self._catch_up(request):
                yield update
            while (update := await queue.get()) is not None:
                if not self.silent:
                    yield update
        finally:
            self._queues.remove(queue)

    def _catch_up(self, request: routing_pb2.WatchRequest) -> list[routing_pb2.StateUpdate]:
        missed = [u for u in self.ring if u.version > request.have_version]
        oldest = self.ring[0].version if self.ring else self.version + 1
        if request.have_epoch == self.epoch and request.have_version >= oldest - 1:
            return missed
        self.snapshots_sent += 1
        return self._snapshot()

    def _snapshot(self) -> list[routing_pb2.StateUpdate]:
        chunks = [routing_pb2.SnapshotChunk(chunk_index=i) for i in range(self._chunks)]
        chunks[0].replicas.extend(self.replicas.values())
        chunks[0].config.CopyFrom(routing_pb2.RoutingConfig(revision=1))
        for i, (ordinal, keys) in enumerate(sorted(self.residency.items())):
            blocks = routing_pb2.ReplicaBlocks(ordinal=ordinal, keys=keys)
            chunks[i % self._chunks].residency.append(blocks)
        chunks[-1].last_chunk = True
        return [
            routing_pb2.StateUpdate(epoch=self.epoch, version=self.version, snapshot=chunk)
            for chunk in chunks
        ]

    async def _report(
        self,
        reports: AsyncIterator[routing_pb2.ProxyReport],
        context: grpc.aio.ServicerContext,
    ) -> routing_pb2.ReportAck:
        self.report_streams += 1
        count = 0
        async for report in reports:
            count += 1
            async with self._changed:
                self.reports.append(report)
                self._changed.notify_all()
        return routing_pb2.ReportAck(reports=count)
