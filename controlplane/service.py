"""``ControlPlane(settings)``: every part of one control-plane instance, started and stopped.

Built here, in this order: the etcd client, the Prometheus registry, the fleet (ingest
from NATS, the :class:`LiveFleetView`), leadership (election, membership, drains), the
records half (``Records``: config store, SQL, admin API; any factory with its shape),
the routing-state broadcaster and gRPC server, and uvicorn serving the records' ASGI app
on ``admin_host:admin_port``. :attr:`ControlPlane.ready_line` says where each listens;
``main`` prints it once everything accepts connections.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from typing import Any, Protocol

import aetcd
import grpc
import uvicorn
from prometheus_client import CollectorRegistry, make_asgi_app

from controlplane.admission.webhook import injection_config, with_webhook
from controlplane.contracts import ConfigSource, FleetView, ReportSink
from controlplane.etcd_client import EtcdClient
from controlplane.fleet.broadcast import Broadcaster, EmptyConfig
from controlplane.fleet.fleet import Fleet
from controlplane.fleet.fleet_view import LiveFleetView
from controlplane.fleet.ingest import Ingest
from controlplane.fleet.leadership import Leadership
from controlplane.fleet.learned_rates import LearnedRates
from controlplane.fleet.metrics import FleetCollector
from controlplane.fleet.proxy_places import ProxyPlaces
from controlplane.fleet.routing_server import RoutingStateService, start_server
from controlplane.fleet.warmup import Warmer, WarmupCollector, workloads_of
from controlplane.fleet.warmup_transfer import EngineTransfers
from controlplane.settings import ControlPlaneSettings
from kvcore.pb import routing_pb2
from kvruntime.sockets import bind_tcp
from kvruntime.tasks import BackgroundTasks

log = logging.getLogger(__name__)

ASGIApp = Callable[..., Any]


class RecordsLike(Protocol):
    """The records half as the service uses it (``controlplane.records.Records``)."""

    @property
    def config(self) -> ConfigSource: ...

    @property
    def reports(self) -> ReportSink: ...

    @property
    def app(self) -> ASGIApp: ...

    async def start(self) -> None: ...

    async def aclose(self) -> None: ...


RecordsFactory = Callable[
    [ControlPlaneSettings, aetcd.Client, FleetView, CollectorRegistry], RecordsLike
]


class ServiceError(RuntimeError):
    """The instance could not start (a port taken, a server unreachable)."""


class CountingSink:
    """A :class:`ReportSink` that only counts (fleet-only runs)."""

    def __init__(self) -> None:
        self.received: list[routing_pb2.ProxyReport] = []

    async def record(self, report: routing_pb2.ProxyReport) -> None:
        self.received.append(report)
        del self.received[:-100]


class WarmupTee:
    """The records' :class:`ReportSink`, with each report also given to the warm-up (its
    hot prefixes) and the learned rates (``/v1/replicas``)."""

    def __init__(self, sink: ReportSink, hot: Callable[[routing_pb2.ProxyReport], None]) -> None:
        self._sink, self._hot = sink, hot

    async def record(self, report: routing_pb2.ProxyReport) -> None:
        self._hot(report)
        await self._sink.record(report)


class FleetOnlyRecords:
    """Records without SQL or etcd config: empty config, /healthz, /readyz, /metrics."""

    def __init__(
        self,
        settings: ControlPlaneSettings,
        etcd: aetcd.Client,
        fleet: FleetView,
        registry: CollectorRegistry,
    ) -> None:
        self.config: ConfigSource = EmptyConfig()
        self.reports: ReportSink = CountingSink()
        self.app: ASGIApp = _health_app(make_asgi_app(registry))

    async def start(self) -> None:
        return None

    async def aclose(self) -> None:
        return None


def _health_app(metrics: ASGIApp) -> ASGIApp:
    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"] == "/metrics":
            await metrics(scope, receive, send)
            return
        if scope["type"] != "http":
            return
        found = scope["path"] in ("/healthz", "/readyz")
        await send({"type": "http.response.start", "status": 200 if found else 404})
        await send({"type": "http.response.body", "body": b"ok\n" if found else b""})

    return app


class ControlPlane:
    def __init__(
        self, settings: ControlPlaneSettings, *, records: RecordsFactory = FleetOnlyRecords
    ) -> None:
        self.settings = settings
        self.registry = CollectorRegistry()
        self.etcd = EtcdClient(settings, timeout_s=max(1.0, settings.lease_ttl_s / 2))
        self.fleet = Fleet(
            heartbeat_timeout_s=settings.heartbeat_timeout_s,
            resync_retry_s=settings.resync_timeout_s,
            panic_threshold=settings.panic_threshold,
        )
        self.ingest = Ingest(settings, self.fleet)
        self.leadership = Leadership(settings, self.etcd, self.fleet)
        self.completions = EngineTransfers()  # sends warm-up completions, and moves
        self.warmer = Warmer(
            self.fleet,
            lambda: workloads_of(self.records.config.current()),
            self.leadership.is_leader,
            self.completions.send,
            share=self.leadership.share_warmup,
            move=self.completions.move,
        )
        self.leadership.on_step_down(self.warmer.step_down)
        self.learned = LearnedRates()
        self.view = LiveFleetView(
            self.fleet,
            drains=self.leadership,
            is_leader=self.leadership.is_leader,
            warmup=self.warmer.state_of,
            learned=self.learned.state_of,
            position=lambda: self.broadcaster.covering() if self.broadcaster else (0, 0),
        )
        self.records = records(settings, self.etcd, self.view, self.registry)
        self.broadcaster: Broadcaster | None = None
        self.routing: RoutingStateService | None = None
        self.places: ProxyPlaces | None = None
        self.grpc_port = 0
        self.admin_port = 0
        self._grpc: grpc.aio.Server | None = None
        self._uvicorn: uvicorn.Server | None = None
        self._tasks = BackgroundTasks()
        self.registry.register(
            FleetCollector(
                self.fleet,
                self.ingest,
                lambda: self.broadcaster,
                lambda: self.routing,
                self.leadership.is_leader,
            )
        )
        self.registry.register(WarmupCollector(self.warmer))

    @property
    def ready_line(self) -> str:
        s = self.settings
        return (
            f"kvroute-controlplane ready instance={s.instance_id} shard={s.shard} "
            f"admin={'https' if s.admin_tls_cert else 'http'}://{s.admin_host}:{self.admin_port} "
            f"grpc={s.grpc_host}:{self.grpc_port}"
        )

    async def start(self) -> None:
        s = self.settings
        await self.ingest.start()
        try:  # first, so that an etcd that does not answer is one clear line
            await self.leadership.start()
        except aetcd.ClientError as exc:
            endpoints = ",".join(s.etcd_endpoints)
            raise ServiceError(
                f"etcd at {endpoints} did not answer ({type(exc).__name__})"
            ) from exc
        await self.records.start()
        self.broadcaster = Broadcaster(
            self.fleet,
            self.records.config,
            interval_s=s.delta_interval_ms / 1000,
            ring=s.delta_ring,
            queue=s.watcher_queue,
            chunk_bytes=s.snapshot_chunk_bytes,
            shards=self._shards,
        )
        self._tasks.spawn(self.broadcaster.run(), name="broadcast")
        reports = WarmupTee(self.records.reports, self._on_report)
        self.places = ProxyPlaces(self.etcd, self.leadership.keys, s.shard, s.lease_ttl_s)
        self.routing = RoutingStateService(self.broadcaster, reports, s.served_pools(), self.places)
        try:
            self._grpc, self.grpc_port = await start_server(self.routing, s)
        except RuntimeError as exc:
            raise ServiceError(f"cannot serve gRPC on {s.grpc_host}:{s.grpc_port}: {exc}") from exc
        await self._start_admin()
        await self.warmer.start()

    def _on_report(self, report: routing_pb2.ProxyReport) -> None:
        self.warmer.on_report(report)
        self.learned.on_report(report)

    def admin_app(self) -> ASGIApp:
        """What the admin port serves: the records' app, with ``POST /mutate`` (sidecar
        injection) in front."""
        return with_webhook(self.records.app, injection_config(self.settings))

    def _shards(self) -> list[routing_pb2.PoolShard]:
        """Which shard serves each of ``--pools``, and its leader (for snapshots)."""
        leader, shard = self.leadership.leader_instance, self.settings.shard
        return [
            routing_pb2.PoolShard(pool=pool, shard=shard, leader_instance=leader)
            for pool in self.settings.pools
        ]

    async def _start_admin(self) -> None:
        s = self.settings
        try:
            sock = bind_tcp(s.admin_host, s.admin_port)
        except OSError as exc:
            raise ServiceError(
                f"cannot serve the admin API on {s.admin_host}:{s.admin_port}: {exc.strerror}"
            ) from exc
        self.admin_port = sock.getsockname()[1]
        config = uvicorn.Config(
            self.admin_app(),
            lifespan="off",
            log_config=None,
            access_log=False,
            ssl_certfile=s.admin_tls_cert,
            ssl_keyfile=s.admin_tls_key,
        )
        server = self._uvicorn = uvicorn.Server(config)
        config.load()
        server.lifespan = config.lifespan_class(config)
        await server.startup(sockets=[sock])
        self._tasks.spawn(server.main_loop(), name="admin-api")

    async def aclose(self) -> None:
        if self._uvicorn is not None:
            self._uvicorn.should_exit = True
        if self._grpc is not None:
            await self._grpc.stop(grace=0.5)
        await self._tasks.aclose()
        if self.places is not None:
            await self.places.aclose()
        await self.warmer.aclose()
        await self.completions.aclose()
        if self._uvicorn is not None and self._uvicorn.started:
            await self._uvicorn.shutdown()
        await self.leadership.aclose()
        await self.ingest.aclose()
        await self.records.aclose()
        with contextlib.suppress(aetcd.ClientError):
            await self.etcd.close()
