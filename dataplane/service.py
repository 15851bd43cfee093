"""One worker's proxy, built from settings: state, router, upstream pool, app.

:class:`ProxyService` owns every part of one serving process and their lifetimes
(``async start()`` / ``aclose()``); ``main.py`` runs one per worker. In static mode
(``--static-replicas``) the fleet is fixed and each replica's ``/v1/models`` tells what it
serves (asked at start and every ``STATIC_REFRESH_S``); otherwise the state comes from a
control plane through :class:`~dataplane.state_client.StateClient`.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from typing import Any

import aiohttp
from opentelemetry.sdk.trace.export import SpanExporter

from dataplane.app import AppOptions, ProxyApp
from dataplane.breaker import CircuitBreakers, RetryBudget
from dataplane.exchange import Dispatcher, Policies
from dataplane.first_byte import FirstByteDeadlines, SuspectProber
from dataplane.fleet.state import FleetState
from dataplane.hot_prefixes import HotPrefixBook
from dataplane.lora import LoraPlacement
from dataplane.metrics import ProxyMetrics
from dataplane.model_cards import ModelCards, cards_of
from dataplane.pd import PdSplit, sglang_role
from dataplane.reporter import Reporter
from dataplane.routing import Defaults, Router
from dataplane.settings import ProxySettings
from dataplane.state_client import StateClient
from dataplane.tokenizer_probe import TokenizerProbe
from dataplane.tracing import Tracing
from dataplane.transport.worker_metrics import Siblings, WorkerGroup
from dataplane.upstream import Upstream
from kvcore.index import read_always_index
from kvcore.workload import RoutingConfig, parse_workload
from kvruntime.tasks import BackgroundTasks

log = logging.getLogger("dataplane")
STATIC_REFRESH_S = 10.0


def static_routing(settings: ProxySettings) -> RoutingConfig:
    """The one workload of static mode (``--static-strategy``)."""
    workload = parse_workload({"name": "default", "strategy": settings.static_strategy})
    return RoutingConfig(workloads=(workload,), rules=(), default_workload="default")


class ProxyService:
    """Everything one worker process serves with."""

    def __init__(
        self,
        settings: ProxySettings,
        span_exporter: SpanExporter | None = None,
        group: WorkerGroup | None = None,
    ) -> None:
        self.settings = settings
        self.tracing = Tracing(span_exporter) if settings.tracing else None
        if settings.static:
            self.fleet = FleetState.from_static(
                settings.static_replicas, default_routing=static_routing(settings)
            )
        else:
            self.fleet = FleetState(
                max_age_s=settings.state_max_age_s,
                prefill_step_s=settings.prefill_step_ms / 1000,
                index=read_always_index(settings.residency_index),
            )
        self.router = Router(
            self.fleet,
            Defaults(settings.tokenizer, settings.block_size, settings.tenant_header),
            random.Random(),
            place=settings.proxy_index,
        )
        # without --proxy-index, the place the control plane numbers this proxy's watch with
        numbered = self.router.take_place if settings.proxy_index is None else None
        self.state_client = (
            None if settings.static else StateClient(settings, self.fleet, on_place=numbered)
        )
        self.metrics = ProxyMetrics()
        self.siblings = None if group is None else Siblings(group, self.metrics.registry)
        self.replica_tls = settings.replica_ssl_context()  # for https:// replicas
        self.probe = TokenizerProbe(
            self.fleet,
            settings.tokenizer,
            load=self.router.tokenizers.load,
            ssl_context=self.replica_tls,
        )
        self.hot_prefixes = None if settings.static else HotPrefixBook()
        self.router.hot = self.hot_prefixes
        self.reporter = (
            None
            if self.hot_prefixes is None
            else Reporter(
                settings,
                health=self.probe.model_health,
                hot=self.hot_prefixes.report,
                rates=self.fleet.inflight.learned_rates,
            )
        )
        self.upstream = Upstream(
            settings.connect_timeout_s, settings.upstream_timeout_s, self.replica_tls
        )
        self.breakers = CircuitBreakers(settings.breaker_failures, settings.breaker_open_s)
        self.prober = SuspectProber(
            self.breakers,
            self.fleet.replicas,
            self.upstream,
            settings.probe_interval_s,
            settings.probe_timeout_s,
            time.monotonic,
        )
        self.deadlines = FirstByteDeadlines(
            settings.first_byte_floor_s,
            settings.first_byte_factor,
            settings.first_byte_tokens_per_s,
            settings.upstream_timeout_s,
            time.monotonic,
            ask=self.prober.ask,
        )
        self.dispatcher = Dispatcher(
            self.fleet,
            self.router,
            self.upstream,
            self.metrics,
            Policies(settings.retry_attempts, settings.retry_after_s),
            self.breakers,
            RetryBudget(settings.retry_budget, settings.retry_min_per_s, time.monotonic()),
            self.reporter,
            deadlines=self.deadlines,
        )
        self.dispatcher.split = PdSplit(self.dispatcher)
        options = AppOptions(
            max_body_bytes=settings.max_body_bytes,
            auth=settings.auth,
            debug_headers=settings.debug_headers,
            static=settings.static,
            state_max_age_s=settings.state_max_age_s,
            cors_allowed_origins=tuple(settings.cors_allowed_origins),
            metrics_apart=settings.metrics_port is not None,
        )
        self.app = ProxyApp(
            options,
            self.fleet,
            self.router,
            self.dispatcher,
            self.metrics,
            self._readiness,
            self.tracing,
            None if self.siblings is None else self.siblings.render,
            ModelCards(self.upstream),
            self._lora_placement(),
        )
        self.metrics.watch(self._state_age, self._open_breakers, self.probe.mismatches)
        self.metrics.in_flight.set_function(self.fleet.inflight.total)
        self.metrics.watch_prefill_rates(self.fleet.inflight.prefill_rates)
        self._tasks = BackgroundTasks()

    async def start(self) -> None:
        _say_who_is_isolated(self.settings)
        if self.siblings is not None:
            await self.siblings.start()
        await self.upstream.start()
        await asyncio.to_thread(self.router.tokenizers.load, self.settings.tokenizer)
        if self.state_client is not None:
            await self.state_client.start()
            if self.reporter is not None:
                await self.reporter.start()
        else:
            await self._discover_static()
            self._tasks.spawn(self._refresh_static(), name="static-refresh")
        await self.probe.start()
        self._tasks.spawn(self.prober.run(), name="suspect-prober")
        self._tasks.spawn(self.deadlines.run(), name="first-byte-deadlines")

    async def aclose(self) -> None:
        await self._tasks.aclose()
        await self.probe.aclose()
        if self.reporter is not None:
            await self.reporter.aclose()
        if self.state_client is not None:
            await self.state_client.aclose()
        await self.upstream.aclose()
        if self.tracing is not None:
            self.tracing.shutdown()
        if self.siblings is not None:
            await self.siblings.aclose()

    # -- static mode ---------------------------------------------------------------

    async def _refresh_static(self) -> None:
        while True:
            await asyncio.sleep(STATIC_REFRESH_S)
            await self._discover_static()

    async def _discover_static(self) -> None:
        """Ask every static replica what it serves (``/v1/models``)."""
        timeout = aiohttp.ClientTimeout(total=self.settings.connect_timeout_s + 2)
        connector = aiohttp.TCPConnector(ssl=self.replica_tls or True)
        async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
            for endpoint in self.fleet.replicas.endpoints():
                names, kind = await _served_names(session, endpoint.base_url)
                if names:
                    self.fleet.set_served_names(endpoint.ordinal, names, kind)
                if kind == "sglang":  # its P/D role and bootstrap port, where it has one
                    role, port = await sglang_role(session, endpoint.base_url)
                    if role is not None and (role, port) != (
                        endpoint.role,
                        endpoint.bootstrap_port,
                    ):
                        self.fleet.set_role(endpoint.ordinal, role, port)

    def _lora_placement(self) -> LoraPlacement:
        lora = LoraPlacement(self.fleet, self.upstream)
        changes = self.metrics.lora_changes
        lora.counted = lambda action, outcome: changes.labels(action, outcome).inc()
        return lora

    # -- what /metrics and /readyz read ---------------------------------------------

    def _state_age(self) -> float:
        return 0.0 if self.settings.static else self.fleet.replicas.age_s()

    def _open_breakers(self) -> float:
        return len(self.breakers.open_ids(time.monotonic()))

    def _readiness(self) -> dict[str, Any]:
        detail: dict[str, Any] = {
            "circuit_open": self.breakers.open_ids(time.monotonic()),
            "tokenizer_mismatch": self.probe.mismatches(),
        }
        if self.state_client is not None:
            detail["state"] = self.state_client.status()
            detail["config_error"] = self.fleet.config_error
        if self.reporter is not None:
            detail["report"] = self.reporter.status()
        return detail


async def _served_names(session: aiohttp.ClientSession, base_url: str) -> tuple[list[str], str]:
    """The model names a static replica's ``/v1/models`` lists and its engine kind, which
    its cards' ``owned_by`` tells: "vllm" or "sglang" (their ``ModelCard`` defaults), ""
    for anything else."""
    try:
        async with session.get(base_url + "/v1/models") as response:
            if response.status != 200:
                return [], ""
            cards = cards_of(await response.read())
    except (aiohttp.ClientError, TimeoutError) as exc:
        log.warning("static replica unreachable", extra={"url": base_url, "error": str(exc)})
        return [], ""
    if cards is None:
        return [], ""
    owners = {c.get("owned_by") for c in cards}
    kind = owners.pop() if len(owners) == 1 else ""
    return [c["id"] for c in cards], kind if kind in ("vllm", "sglang") else ""


def _say_who_is_isolated(settings: ProxySettings) -> None:
    """Without ``--auth`` the proxy knows no client's tenant: say at start-up whose word
    it takes for it (``kvcore.tenancy``)."""
    if settings.auth:
        return
    if settings.tenant_header:
        log.warning(
            "no --auth: a request's tenant is its %s header, which a front proxy that "
            "authenticates clients must set (any client can name any tenant otherwise)",
            settings.tenant_header,
        )
        return
    log.warning(
        "no --auth: tenants are not isolated (any client can reach any cache namespace, "
        "and a cache hit tells it another client sent that prompt); use --auth, or "
        "--tenant-header behind a front proxy that authenticates"
    )
