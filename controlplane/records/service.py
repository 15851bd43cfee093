"""Wiring of the records half: build, start and stop its parts in order."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

import aetcd
from fastapi import FastAPI
from opentelemetry.trace import TracerProvider
from prometheus_client import CollectorRegistry

from controlplane.contracts import FleetView
from controlplane.records.api.app import create_app
from controlplane.records.api.context import AdminContext
from controlplane.records.config_store import EtcdConfigStore
from controlplane.records.db.database import Database
from controlplane.records.db.repositories import StatsRepository
from controlplane.records.metrics import RecordsMetrics
from controlplane.records.reports import ReportInbox
from controlplane.records.services.alerts import AlertMonitor
from controlplane.settings import ControlPlaneSettings
from kvcore.subjects import EtcdKeys
from kvruntime.tasks import BackgroundTasks

log = logging.getLogger(__name__)


class Records:
    """Config store, SQL records, report inbox, alerts and the admin API."""

    def __init__(
        self,
        settings: ControlPlaneSettings,
        etcd: aetcd.Client,
        fleet: FleetView,
        registry: CollectorRegistry,
        *,
        tracer_provider: TracerProvider | None = None,
    ) -> None:
        self.settings = settings
        self.fleet = fleet
        self.metrics = RecordsMetrics(registry)
        self.database = Database(settings.database_url.get_secret_value())
        self.store = EtcdConfigStore(etcd, EtcdKeys(settings.etcd_prefix))
        self.metrics.watch_invalid_values(lambda: self.store.invalid_values)
        self.config = self.store
        self.reports = ReportInbox(self.database.sessions, self.metrics)
        self.alerts = AlertMonitor(settings, self.database.sessions, self.metrics)
        self.registry = registry
        self.app = self._build_app(tracer_provider)
        self._tasks = BackgroundTasks()
        self.started = False

    def _build_app(self, tracer_provider: TracerProvider | None) -> FastAPI:
        context = AdminContext(
            settings=self.settings,
            store=self.store,
            database=self.database,
            fleet=self.fleet,
            metrics=self.metrics,
            registry=self.registry,
            ready=self.ready,
        )
        return create_app(context, tracer_provider=tracer_provider)

    async def start(self) -> None:
        """Migrate the database, load and follow the config, start the leader's jobs."""
        await self.database.migrate()
        await self.database.open_connections()
        await self.store.start()
        self._every(self.settings.rollup_interval_s, self.reports.rollup, "rollup")
        self._every(self.settings.alert_interval_s, self.alerts.evaluate, "alerts")
        self._every(24 * 3600, self._prune, "prune")
        self.started = True

    async def aclose(self) -> None:
        self.started = False
        await self._tasks.aclose()
        await self.store.aclose()
        await self.alerts.aclose()
        await self.database.aclose()

    async def ready(self) -> bool:
        return self.started and self.store.loaded and await self.database.ping()

    def _every(self, period_s: float, job: Callable[[], Awaitable[object]], name: str) -> None:
        self._tasks.spawn(self._leader_loop(period_s, job, name), name=name)

    async def _leader_loop(
        self, period_s: float, job: Callable[[], Awaitable[object]], name: str
    ) -> None:
        while True:
            await asyncio.sleep(period_s)
            if not self.fleet.is_leader():
                continue
            try:
                await job()
            except Exception:  # a database hiccup must not end the loop
                log.exception("leader job %s failed; retrying next period", name)

    async def _prune(self) -> None:
        cutoff = int(time.time() - self.settings.stats_retention_days * 86400) // 60 * 60
        async with self.database.sessions() as session:
            await StatsRepository(session).prune(cutoff)
            await session.commit()
