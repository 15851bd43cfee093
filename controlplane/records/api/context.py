"""What the admin API's routes reach: built once by :class:`~controlplane.records.Records`."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from prometheus_client import CollectorRegistry

from controlplane.contracts import FleetView
from controlplane.records.config_store import EtcdConfigStore
from controlplane.records.db.database import Database
from controlplane.records.metrics import RecordsMetrics
from controlplane.settings import ControlPlaneSettings


@dataclass(frozen=True, slots=True)
class AdminContext:
    settings: ControlPlaneSettings
    store: EtcdConfigStore
    database: Database
    fleet: FleetView
    metrics: RecordsMetrics
    registry: CollectorRegistry
    ready: Callable[[], Awaitable[bool]]
