"""``kvroute_proxy_requests_in_flight``, the gauge the proxies' HorizontalPodAutoscaler
scales on: requests sent to any replica and not finished, in this worker."""

from __future__ import annotations

import time

from prometheus_client import generate_latest

from dataplane.main import load_settings
from dataplane.service import ProxyService


def in_flight(service: ProxyService) -> float:
    for line in generate_latest(service.metrics.registry).decode().splitlines():
        if line.startswith("kvroute_proxy_requests_in_flight "):
            return float(line.split()[1])
    raise AssertionError("no kvroute_proxy_requests_in_flight sample")


def test_the_gauge_follows_requests_sent_and_finished() -> None:
    service = ProxyService(
        load_settings(["--static-replicas=http://127.0.0.1:9,http://127.0.0.1:10"])
    )
    assert in_flight(service) == 0
    now = time.time()
    first = service.fleet.inflight.on_sent(0, now)
    second = service.fleet.inflight.on_sent(1, now)
    service.fleet.inflight.on_sent(1, now)
    assert in_flight(service) == 3
    service.fleet.inflight.on_done(second)
    service.fleet.inflight.on_done(second)  # a request ends once, however often it is reported
    service.fleet.inflight.on_done(first)
    assert in_flight(service) == 1
