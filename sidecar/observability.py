"""``/healthz``, ``/metrics`` and JSON logs: the sidecar seen from outside.

Metrics wrap the service rather than live in it: the domain keeps plain counters
(``SourceStats``, ``MapperStats``, ``OutboxStats``, ``PipelineStats``) and
:class:`SidecarCollector` reads them at scrape time into a per-service registry, so the
hot path pays an integer increment and nothing else.

Metric names (all prefixed ``kvroute_sidecar_``): ``frames_received_total``,
``frames_rejected_total{reason}``, ``frames_undecodable_total{reason}``,
``events_received_total{type}``,
``events_rejected_total{reason}``, ``events_translated_total``,
``events_published_total``, ``batches_published_total``, ``events_dropped_total``,
``seq_gaps_total``, ``frames_lost_total``, ``duplicates_total``, ``engine_restarts_total``,
``replays_total{result}``, ``replayed_frames_total``, ``unknown_parents_total``,
``unknown_removals_total``, ``rebuilds_total``, ``internal_errors_total``,
``snapshots_total``, ``buffer_depth``, ``buffer_keys``, ``engine_blocks``, ``router_keys``,
``state_incomplete``, ``engine_up``, ``nats_connected``, ``engine_lag_seconds``, ``epoch``,
``publish_latency_seconds``.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from aiohttp import web
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from sidecar.pipeline import LATENCY_BUCKETS_S
from sidecar.zmq_source import total_stats

if TYPE_CHECKING:
    from sidecar.service import SidecarService

PREFIX = "kvroute_sidecar_"


def _counter(name: str, doc: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(PREFIX + name, doc, value=value)


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(PREFIX + name, doc, value=value)


def _labelled(name: str, doc: str, label: str, values: dict[str, int]) -> CounterMetricFamily:
    family = CounterMetricFamily(PREFIX + name, doc, labels=[label])
    for key, value in sorted(values.items()):
        family.add_metric([key], value)
    return family


class SidecarCollector(Collector):
    def __init__(self, service: SidecarService) -> None:
        self.service = service

    def collect(self) -> Iterator[Metric]:
        yield from self._engine_side()
        yield from self._router_side()
        yield from self._state()
        yield self._latency()

    def _engine_side(self) -> Iterator[Metric]:
        sources = self.service.sources
        s = total_stats([source.stats for source in sources]) if sources else None
        p = self.service.pipeline.stats
        yield _counter("frames_received", "ZMQ messages received", s.frames_received if s else 0)
        yield _labelled(
            "frames_rejected", "Malformed ZMQ messages", "reason", s.frames_rejected if s else {}
        )
        yield _labelled(
            "frames_undecodable", "Payloads that are not a batch", "reason", p.frames_undecodable
        )
        yield _labelled("events_received", "Engine events decoded", "type", p.events_received)
        yield _labelled("events_rejected", "Engine events skipped", "reason", p.events_rejected)
        yield _counter("seq_gaps", "Sequence gaps seen", s.gaps if s else 0)
        yield _counter("frames_lost", "Batches replay could not recover", s.frames_lost if s else 0)
        yield _counter("duplicates", "Duplicate batches skipped", s.duplicates if s else 0)
        yield _counter("engine_restarts", "Engine restarts seen", s.restarts if s else 0)
        replays = CounterMetricFamily(PREFIX + "replays", "Replay requests", labels=["result"])
        for result in ("ok", "partial", "failed"):
            replays.add_metric([result], getattr(s, f"replays_{result}") if s else 0)
        yield replays
        yield _counter("replayed_frames", "Batches got by replay", s.replayed_frames if s else 0)

    def _router_side(self) -> Iterator[Metric]:
        m = self.service.pipeline.mapper_stats
        o = self.service.outbox.stats
        p = self.service.pipeline.stats
        yield _counter("events_translated", "Router events produced", p.router_events)
        yield _counter("events_published", "Router events published", o.events_published)
        yield _counter("batches_published", "KvEventBatch messages", o.batches_published)
        yield _counter("events_dropped", "Router events dropped (buffer full)", o.events_dropped)
        yield _counter("unknown_parents", "Stores with an unknown parent", m.unknown_parents)
        yield _counter("unknown_removals", "Removals of unknown blocks", m.unknown_removals)
        yield _counter("rebuilds", "State rebuilds from replay", p.rebuilds)
        yield _counter("internal_errors", "Items that hit a sidecar bug", p.internal_errors)
        yield _counter("snapshots", "Snapshots published", o.snapshots)

    def _state(self) -> Iterator[Metric]:
        service = self.service
        yield _gauge("buffer_depth", "Router events waiting to publish", service.outbox.depth)
        yield _gauge("buffer_keys", "Router keys waiting to publish", service.outbox.depth_keys)
        yield _gauge("engine_blocks", "Engine blocks mapped", service.pipeline.mapper.engine_blocks)
        yield _gauge("router_keys", "Router keys held", service.pipeline.mapper.router_keys)
        yield _gauge("state_incomplete", "1 if events were lost", service.pipeline.state_incomplete)
        yield _gauge("engine_up", "1 if the engine answered", service.engine_status.up)
        yield _gauge("nats_connected", "1 if NATS is connected", service.link.connected)
        yield _gauge(
            "engine_lag_seconds", "Now minus last batch ts", service.pipeline.stats.engine_lag_s
        )
        yield _gauge("epoch", "Sidecar epoch", service.outbox.epoch)

    def _latency(self) -> Metric:
        h = self.service.pipeline.stats.latency
        buckets = [(str(b), float(c)) for b, c in zip(LATENCY_BUCKETS_S, h.buckets, strict=True)]
        buckets.append(("+Inf", float(h.count)))
        return HistogramMetricFamily(
            PREFIX + "publish_latency_seconds",
            "ZMQ receive to NATS publish",
            buckets=buckets,
            sum_value=h.total_s,
        )


def create_app(service: SidecarService) -> web.Application:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(SidecarCollector(service))

    async def healthz(request: web.Request) -> web.Response:
        body = {
            "ready": service.ready,
            "engine_up": service.engine_status.up,
            "nats_connected": service.link.connected,
            "state_incomplete": service.pipeline.state_incomplete,
            "epoch": service.outbox.epoch,
        }
        return web.json_response(body, status=200 if service.ready else 503)

    async def metrics(request: web.Request) -> web.Response:
        return web.Response(body=generate_latest(registry), content_type="text/plain")

    app = web.Application()
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/metrics", metrics)
    return app
