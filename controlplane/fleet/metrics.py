"""Prometheus metrics of the fleet half, read from plain counters at scrape time.

The ingest path counts with plain ints (a prometheus ``Counter.inc`` takes a lock, too
dear at 200,000 events a second); this collector turns them into metric families when
``/metrics`` is scraped, in the registry the admin API serves.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from controlplane.fleet.broadcast import Broadcaster
from controlplane.fleet.fleet import Fleet
from controlplane.fleet.fleet_view import status_of
from controlplane.fleet.ingest import Ingest
from controlplane.fleet.routing_server import RoutingStateService


class FleetCollector(Collector):
    def __init__(
        self,
        fleet: Fleet,
        ingest: Ingest,
        broadcaster: Callable[[], Broadcaster | None],
        routing: Callable[[], RoutingStateService | None],
        is_leader: Callable[[], bool],
    ) -> None:
        self.fleet, self.ingest = fleet, ingest
        self.broadcaster, self.routing, self.is_leader = broadcaster, routing, is_leader

    def collect(self) -> Iterator[Metric]:
        yield from self._ingest()
        yield from self._fleet()
        yield from self._stream()
        yield _gauge("kvroute_controlplane_leader", "1 on the shard's leader", self.is_leader())

    def _ingest(self) -> Iterator[Metric]:
        stats = self.fleet.stats
        yield _counter(
            "kvroute_controlplane_block_events",
            "Block events (keys stored or removed, clears) applied to the residency index",
            stats.block_events,
        )
        yield _counter("kvroute_controlplane_batches", "Event batches received", stats.batches)
        yield _counter(
            "kvroute_controlplane_batches_ignored",
            "Duplicate, stale or unusable batches",
            stats.batches_ignored,
        )
        yield _counter(
            "kvroute_controlplane_snapshots_applied",
            "Sidecar snapshots that replaced a replica's residency",
            stats.snapshots_applied,
        )
        yield _labelled(
            CounterMetricFamily,
            "kvroute_controlplane_resyncs",
            "Resyncs asked",
            "reason",
            Counter(stats.resyncs),
        )
        yield _labelled(
            CounterMetricFamily,
            "kvroute_controlplane_malformed_messages",
            "NATS messages counted and skipped",
            "kind",
            self.ingest.malformed,
        )

    def _fleet(self) -> Iterator[Metric]:
        yield _gauge(
            "kvroute_controlplane_resident_keys",
            "Distinct block keys held by any replica",
            self.fleet.index.key_count(),
        )
        statuses: Counter[str] = Counter(status_of(r) for r in self.fleet.by_ordinal.values())
        for status in ("healthy", "draining", "down"):
            statuses.setdefault(status, 0)
        yield _labelled(
            GaugeMetricFamily,
            "kvroute_controlplane_replicas",
            "Replicas by status",
            "status",
            statuses,
        )
        yield _gauge(
            "kvroute_controlplane_replicas_stale",
            "Replicas silent past the heartbeat timeout but kept: this instance's NATS link "
            "was down, or too many fell silent at once",
            self.fleet.stale_count(),
        )
        yield _counter(
            "kvroute_controlplane_replicas_kept_stale",
            "Times a silent replica was kept as stale instead of marked down",
            self.fleet.stats.replicas_kept_stale,
        )
        yield _gauge(
            "kvroute_controlplane_nats_connected",
            "1 while NATS is connected",
            self.ingest.connected,
        )

    def _stream(self) -> Iterator[Metric]:
        broadcaster, routing = self.broadcaster(), self.routing()
        if broadcaster is not None:
            stats = broadcaster.stats
            yield _gauge(
                "kvroute_controlplane_watchers", "Proxies watching", len(broadcaster.watchers)
            )
            yield _counter("kvroute_controlplane_versions", "Versions published", stats.versions)
            yield _counter(
                "kvroute_controlplane_snapshots_built", "Snapshots built", stats.snapshots
            )
            yield _counter(
                "kvroute_controlplane_watchers_dropped",
                "Watchers dropped for falling behind",
                stats.watchers_dropped,
            )
            yield _gauge(
                "kvroute_controlplane_delta_lag_max_seconds",
                "Longest wait of a change for its delta",
                stats.lag_max_s,
            )
            mean = stats.lag_sum_s / stats.lags if stats.lags else 0.0
            yield _gauge(
                "kvroute_controlplane_delta_lag_mean_seconds",
                "Mean wait of a change for its delta",
                mean,
            )
        if routing is not None:
            reports = routing.report_stats
            yield _counter(
                "kvroute_controlplane_reports", "Proxy reports recorded", reports.reports
            )
            yield _counter(
                "kvroute_controlplane_reports_malformed",
                "Proxy reports counted and skipped",
                reports.malformed,
            )
            yield _counter(
                "kvroute_controlplane_reports_failed",
                "Proxy reports the records half failed to store",
                reports.failed,
            )


def _counter(name: str, documentation: str, value: float) -> Metric:
    return CounterMetricFamily(name, documentation, value=value)


def _gauge(name: str, documentation: str, value: float) -> Metric:
    return GaugeMetricFamily(name, documentation, value=value)


def _labelled(
    kind: type[CounterMetricFamily] | type[GaugeMetricFamily],
    name: str,
    documentation: str,
    label: str,
    values: Counter[str],
) -> Metric:
    family = kind(name, documentation, labels=[label])
    for key, value in sorted(values.items()):
        family.add_metric([key], value)
    return family
