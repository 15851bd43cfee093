"""The records half's Prometheus metrics, registered in the registry it is given."""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram


class RecordsMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.report_rows = Counter(
            "kvroute_controlplane_report_rows",
            "Proxy report rows stored for the per-minute rollup.",
            registry=registry,
        )
        self.report_rows_rejected = Counter(
            "kvroute_controlplane_report_rows_rejected",
            "Proxy report rows refused as malformed, by reason.",
            ["reason"],
            registry=registry,
        )
        self.rolled_up_rows = Counter(
            "kvroute_controlplane_report_rows_rolled_up",
            "Report rows added to workload_stats by this instance (the leader).",
            registry=registry,
        )
        self.alerts_open = Gauge(
            "kvroute_controlplane_alerts_open",
            "Open alerts, by workload and kind (set by the leader).",
            ["workload", "kind"],
            registry=registry,
        )
        self.alert_changes = Counter(
            "kvroute_controlplane_alert_changes",
            "Alerts opened and closed, by kind and new state.",
            ["kind", "state"],
            registry=registry,
        )
        self.webhook_failures = Counter(
            "kvroute_controlplane_alert_webhook_failures",
            "Alert webhook POSTs that failed or were refused.",
            registry=registry,
        )
        self.admin_requests = Counter(
            "kvroute_controlplane_admin_requests",
            "Admin API requests, by method, route and status.",
            ["method", "route", "status"],
            registry=registry,
        )
        self.admin_latency = Histogram(
            "kvroute_controlplane_admin_request_seconds",
            "Admin API request latency.",
            ["method", "route"],
            registry=registry,
        )
        self.config_invalid = Gauge(
            "kvroute_controlplane_config_invalid_values",
            "Config values in etcd ignored as invalid since start.",
            registry=registry,
        )

    def watch_invalid_values(self, read: Callable[[], int]) -> None:
        self.config_invalid.set_function(lambda: float(read()))
