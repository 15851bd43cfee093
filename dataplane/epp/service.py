"""The endpoint picker's process: its parts, built from settings, and its three ports.

The parts are the proxy's (state client, router, dispatcher's bookkeeping, reporter,
tokenizer probe, metrics), so a picker and a proxy on one control plane route alike.
The ports are the reference picker's: ext_proc on ``grpc_port`` (with TLS when given a
certificate), gRPC health on ``health_port`` (and on the ext_proc port too, for a
gateway's own health checks of its ext_proc cluster), Prometheus on ``metrics_port``.
Health: ``liveness`` serves while the process does; ``readiness``, the ext_proc
service's name and ``""`` serve once the routing state's first snapshot is in, and
stop serving on SIGTERM, before the streams in progress are given ``shutdown_grace_s``.
Any number of pickers serve at once: each keeps its own copy of the control plane's map.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import AsyncIterator
from typing import Any

import grpc
from envoy.service.ext_proc.v3 import external_processor_pb2 as ext_proc
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ext_proc_grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from dataplane.breaker import CircuitBreakers, RetryBudget
from dataplane.epp.picker import Picker
from dataplane.epp.settings import EppSettings
from dataplane.epp.stream import ProtocolViolation, RequestStream, StreamOptions
from dataplane.exchange import Dispatcher, Policies
from dataplane.fleet.state import FleetState
from dataplane.metrics import CONTENT_TYPE, ProxyMetrics
from dataplane.reporter import Reporter
from dataplane.routing import Defaults, Router
from dataplane.state_client import StateClient
from dataplane.tokenizer_probe import TokenizerProbe
from dataplane.transport.server import HttpServer, Request, Response
from dataplane.upstream import Upstream
from kvcore.index import read_always_index
from kvruntime.sockets import bind_tcp
from kvruntime.tasks import BackgroundTasks

log = logging.getLogger("dataplane.epp")
EXT_PROC_SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"
READY_SERVICES = ("", "readiness", EXT_PROC_SERVICE)
HEALTH_SERVICES = ("liveness", *READY_SERVICES)
METRICS_PAGES = ("/metrics", "/healthz", "/readyz")  # on the metrics port
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class EndpointPicker(ext_proc_grpc.ExternalProcessorServicer):  # type: ignore[misc]
    """``ExternalProcessor/Process``: one :class:`RequestStream` per stream."""

    def __init__(self, picker: Picker, options: StreamOptions) -> None:
        self.picker = picker
        self.options = options
        self.open_streams = 0
        self._idle = asyncio.Event()
        self._idle.set()

    async def wait_idle(self) -> None:
        """Until no stream is open (each has counted its request)."""
        await self._idle.wait()

    async def Process(  # the RPC's name
        self,
        request_iterator: AsyncIterator[ext_proc.ProcessingRequest],
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[ext_proc.ProcessingResponse]:
        stream = RequestStream(self.picker, self.options)
        self.open_streams += 1
        self._idle.clear()
        try:
            async for message in request_iterator:
                try:
                    answers = await stream.on_message(message)
                except ProtocolViolation as exc:
                    log.warning("ext_proc stream refused: %s", exc)
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
                for answer in answers:
                    yield answer
                if stream.closed:
                    break
        except Exception:
            log.exception("ext_proc stream failed")
            raise
        finally:
            stream.end()
            self.open_streams -= 1
            if not self.open_streams:
                self._idle.set()


class EppService:
    """Everything one picker process serves with."""

    def __init__(self, settings: EppSettings) -> None:
        self.settings = settings
        proxy = settings.proxy_settings()
        self.fleet = FleetState(
            max_age_s=settings.state_max_age_s,
            prefill_step_s=settings.prefill_step_ms / 1000,
            index=read_always_index(settings.residency_index),
        )
        self.state_client = StateClient(proxy, self.fleet)
        self.metrics = ProxyMetrics()
        self.router = Router(
            self.fleet,
            Defaults(proxy.tokenizer, proxy.block_size, proxy.tenant_header),
            random.Random(),
        )
        self.probe = TokenizerProbe(
            self.fleet, settings.tokenizer, load=self.router.tokenizers.load
        )
        self.reporter = Reporter(
            proxy, health=self.probe.model_health, rates=self.fleet.inflight.learned_rates
        )
        self.breakers = CircuitBreakers(proxy.breaker_failures, proxy.breaker_open_s)
        self.dispatcher = Dispatcher(
            self.fleet,
            self.router,
            Upstream(proxy.connect_timeout_s, proxy.upstream_timeout_s),  # the gateway sends
            self.metrics,
            Policies(settings.fallback_endpoints, proxy.retry_after_s),
            self.breakers,
            RetryBudget(proxy.retry_budget, proxy.retry_min_per_s, time.monotonic()),
            self.reporter,
        )
        self.picker = Picker(
            self.fleet,
            self.router,
            self.dispatcher,
            fallbacks=settings.fallback_endpoints,
            sheddable=frozenset(settings.sheddable_objectives),
        )
        self.servicer = EndpointPicker(self.picker, StreamOptions(settings.max_body_bytes))
        self.health = health.aio.HealthServicer()
        self.metrics.watch(self.fleet.replicas.age_s, self._open_breakers, self.probe.mismatches)
        self.metrics.in_flight.set_function(self.fleet.inflight.total)
        self._servers: list[grpc.aio.Server] = []
        self._metrics_server: HttpServer | None = None
        self._tasks = BackgroundTasks()
        self.ports: dict[str, int] = {}

    # -- lifecycle ------------------------------------------------------------------

    async def start(self) -> None:
        """Bind and serve the three ports (readiness follows the state: :meth:`_ready`)."""
        settings = self.settings
        await self.health.set("liveness", SERVING)
        for service in READY_SERVICES:
            await self.health.set(service, NOT_SERVING)
        await asyncio.to_thread(self.router.tokenizers.load, settings.tokenizer)
        main = grpc.aio.server(options=[("grpc.max_receive_message_length", 64 * 1024 * 1024)])
        ext_proc_grpc.add_ExternalProcessorServicer_to_server(self.servicer, main)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, main)
        target = f"{_host(settings.host)}:{settings.grpc_port}"
        if settings.tls_cert is not None and settings.tls_key is not None:
            credentials = grpc.ssl_server_credentials(
                [(settings.tls_key.read_bytes(), settings.tls_cert.read_bytes())]
            )
            self.ports["grpc"] = main.add_secure_port(target, credentials)
        else:
            self.ports["grpc"] = main.add_insecure_port(target)
        probes = grpc.aio.server()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, probes)
        self.ports["health"] = probes.add_insecure_port(
            f"{_host(settings.host)}:{settings.health_port}"
        )
        if not self.ports["grpc"] or not self.ports["health"]:
            raise OSError("cannot bind the ext_proc or health port")
        self._servers = [main, probes]
        await self._serve_metrics()
        await self.state_client.start()
        await self.reporter.start()
        await self.probe.start()
        for server in self._servers:
            await server.start()
        self._tasks.spawn(self._ready(), name="epp-readiness")

    async def _serve_metrics(self) -> None:
        sock = bind_tcp(self.settings.host, self.settings.metrics_port)
        sock.listen(128)
        self.ports["metrics"] = sock.getsockname()[1]
        self._metrics_server = HttpServer(self._metrics_page, max_body_bytes=1024)
        await self._metrics_server.start(sock)

    async def _metrics_page(self, request: Request, response: Response) -> None:
        if request.path == "/metrics":
            response.send(200, [(b"content-type", CONTENT_TYPE)], self.metrics.render())
        elif request.path in ("/healthz", "/readyz"):
            ready = self.state_client.ready or request.path == "/healthz"
            response.send(200 if ready else 503, [(b"content-type", b"text/plain")], b"ok")
        else:
            response.send(404, [(b"content-type", b"text/plain")], b"not found")

    async def _ready(self) -> None:
        await self.state_client.wait_ready()
        for service in READY_SERVICES:
            await self.health.set(service, SERVING)
        log.info("routing state synced: ready")

    async def stop_serving(self) -> None:
        """Readiness off (the gateway and Kubernetes stop sending), streams go on."""
        for service in READY_SERVICES:
            await self.health.set(service, NOT_SERVING)

    async def aclose(self, grace_s: float = 0.0) -> None:
        await self._tasks.aclose()
        await self.health.enter_graceful_shutdown()
        for server in self._servers:
            await server.stop(grace_s)
        if self._metrics_server is not None:
            await self._metrics_server.aclose(0)
        await self.probe.aclose()
        await self.reporter.aclose()
        await self.state_client.aclose()

    def _open_breakers(self) -> float:
        return len(self.breakers.open_ids(time.monotonic()))

    def status(self) -> dict[str, Any]:
        return {"streams": self.servicer.open_streams, "state": self.state_client.status()}


def _host(host: str) -> str:
    return f"[{host}]" if ":" in host else host
