"""The gRPC ``kvroute.v1.RoutingState`` service: ``Watch`` for proxies, ``Report`` from them.

No generated stubs (see docs/architecture.md): both methods are bound by their full
names through grpc's generic handler API. ``Watch`` responses are passed through as
bytes already serialized by :mod:`controlplane.fleet.broadcast`, once per version for all
watchers. ``Report`` reads raw bytes, so that a malformed report is counted and skipped
instead of ending the proxy's stream.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass

import grpc
from google.protobuf.message import DecodeError

from controlplane.contracts import ReportSink
from controlplane.fleet.broadcast import Broadcaster
from controlplane.fleet.proxy_places import ProxyPlaces
from controlplane.settings import ControlPlaneSettings
from kvcore.pb import routing_pb2
from kvcore.subjects import PROXY_PLACE_METADATA

log = logging.getLogger(__name__)

SERVICE = "kvroute.v1.RoutingState"
WATCH_METHOD = f"/{SERVICE}/Watch"
REPORT_METHOD = f"/{SERVICE}/Report"


@dataclass(slots=True)
class ReportStats:
    reports: int = 0
    malformed: int = 0
    failed: int = 0  # the sink raised


class RoutingStateService:
    """The two RPCs over a :class:`Broadcaster` and a :class:`ReportSink`."""

    def __init__(
        self,
        broadcaster: Broadcaster,
        reports: ReportSink,
        served_pools: tuple[str, ...] | None,
        places: ProxyPlaces | None = None,
    ) -> None:
        """``places``: numbers each watching proxy (its place in the watch's initial
        metadata, :data:`~kvcore.subjects.PROXY_PLACE_METADATA`); ``None``: no places."""
        self.broadcaster = broadcaster
        self.reports = reports
        self.places = places
        self.served = None if served_pools is None else frozenset(served_pools)
        self.report_stats = ReportStats()

    def handler(self) -> grpc.GenericRpcHandler:
        return grpc.method_handlers_generic_handler(
            SERVICE,
            {
                "Watch": grpc.unary_stream_rpc_method_handler(
                    self.watch, request_deserializer=routing_pb2.WatchRequest.FromString
                ),
                "Report": grpc.stream_unary_rpc_method_handler(self.report),
            },
        )

    async def watch(
        self, request: routing_pb2.WatchRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[bytes]:
        pools = await self._pools(request, context)
        places = self.places
        place = None if places is None else await places.take(request.proxy_id)
        try:
            if place is not None:
                await context.send_initial_metadata(((PROXY_PLACE_METADATA, str(place)),))
            async with contextlib.aclosing(self._updates(request, pools, context)) as updates:
                async for update in updates:
                    yield update
        finally:
            if places is not None and place is not None:
                places.give_back(place)

    async def _updates(
        self,
        request: routing_pb2.WatchRequest,
        pools: frozenset[str] | None,
        context: grpc.aio.ServicerContext,
    ) -> AsyncGenerator[bytes, None]:
        watcher, first = self.broadcaster.watch(
            pools,
            request.have_epoch,
            request.have_version,
            columns=request.residency_columns,
        )
        try:
            for update in first:
                yield update
            while True:
                batch = await watcher.next_batch()
                if watcher.dropped:
                    await context.abort(
                        grpc.StatusCode.RESOURCE_EXHAUSTED,
                        "this watcher fell too far behind and was dropped; reconnect",
                    )
                for update in batch:
                    yield update
        finally:
            self.broadcaster.unwatch(watcher)

    async def _pools(
        self, request: routing_pb2.WatchRequest, context: grpc.aio.ServicerContext
    ) -> frozenset[str] | None:
        asked = frozenset(request.pools)
        if not asked:
            return self.served
        if self.served is not None and not asked <= self.served:
            others = ", ".join(sorted(asked - self.served))
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"pools {others} are not served by this shard (it serves "
                f"{', '.join(sorted(self.served))})",
            )
        return asked

    async def report(
        self, requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext
    ) -> bytes:
        stats, accepted = self.report_stats, 0
        async for data in requests:
            try:
                report = routing_pb2.ProxyReport.FromString(data)
            except DecodeError:
                stats.malformed += 1
                continue
            try:
                await self.reports.record(report)
            except ValueError as exc:
                stats.malformed += 1
                log.info("report refused", extra={"error": str(exc)})
                continue
            except Exception as exc:  # the sink's storage failed: keep the stream open
                stats.failed += 1
                log.warning("report not recorded", extra={"error": type(exc).__name__})
                continue
            stats.reports += 1
            accepted += 1
        return routing_pb2.ReportAck(reports=accepted).SerializeToString()


async def start_server(
    service: RoutingStateService, settings: ControlPlaneSettings
) -> tuple[grpc.aio.Server, int]:
    """Serve on ``grpc_host:grpc_port`` (TLS when a certificate is given); the bound port."""
    server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
    server.add_generic_rpc_handlers((service.handler(),))
    address = f"{settings.grpc_host}:{settings.grpc_port}"
    if settings.grpc_tls_cert is not None and settings.grpc_tls_key is not None:
        credentials = grpc.ssl_server_credentials(
            [(settings.grpc_tls_key.read_bytes(), settings.grpc_tls_cert.read_bytes())]
        )
        port = server.add_secure_port(address, credentials)
    else:
        port = server.add_insecure_port(address)
    await server.start()
    return server, port
