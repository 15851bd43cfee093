"""The Prometheus series names kvroute's components really export, read from their own
registries (built the way each component builds them, nothing started)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest

from controlplane.fleet.broadcast import Broadcaster
from controlplane.fleet.routing_server import RoutingStateService
from controlplane.main import load_settings as load_controlplane_settings
from controlplane.service import ControlPlane
from dataplane.main import load_settings as load_proxy_settings
from dataplane.service import ProxyService
from sidecar.observability import SidecarCollector
from sidecar.service import SidecarService
from sidecar.settings import SidecarSettings

SUFFIXES = {
    "counter": ("_total", "_created"),
    "gauge": ("",),
    "histogram": ("_bucket", "_sum", "_count", "_created"),
    "summary": ("", "_sum", "_count", "_created"),
    "info": ("_info",),
    "unknown": ("",),
}
# Series Prometheus itself makes.
PROMETHEUS_OWN = frozenset({"ALERTS", "ALERTS_FOR_STATE", "up", "scrape_duration_seconds"})


def series_names(registry: CollectorRegistry) -> set[str]:
    """Every series name a scrape of ``registry`` can yield (from its TYPE lines, so
    labelled metrics count before their first sample)."""
    names = set()
    for line in generate_latest(registry).decode().splitlines():
        if line.startswith("# TYPE "):
            _, _, family, kind = line.split(" ", 3)
            if kind == "counter":
                family = family.removesuffix("_total")
            names |= {family + suffix for suffix in SUFFIXES[kind]}
    return names


def sidecar_series() -> set[str]:
    registry = CollectorRegistry(auto_describe=False)
    service = SidecarService(SidecarSettings(replica_id="r0", model="m"))
    registry.register(SidecarCollector(service))
    return series_names(registry)


def proxy_series() -> set[str]:
    """One proxy worker's registry, as its service builds it (nothing started)."""
    service = ProxyService(load_proxy_settings(["--controlplane=kvroute-controlplane:50051"]))
    return series_names(service.metrics.registry)


def controlplane_series() -> set[str]:
    """The control plane's registry with its stream parts built as ``start()`` builds
    them (their metrics appear only then), nothing connected."""
    plane = ControlPlane(load_controlplane_settings([]))
    plane.broadcaster = Broadcaster(plane.fleet, plane.records.config)
    plane.routing = RoutingStateService(plane.broadcaster, plane.records.reports, None)
    return series_names(plane.registry)


def exported_series() -> set[str]:
    return sidecar_series() | proxy_series() | controlplane_series()
