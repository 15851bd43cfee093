"""A proxy of several workers scrapes as one: its workers' metrics merged."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families

from dataplane.http_errors import ServiceUnavailable
from dataplane.metrics import PREFIX, ProxyMetrics
from dataplane.transport.worker_metrics import Siblings, WorkerGroup, families, merge, render

# one request: worker, replica, outcome, decision seconds, prompt tokens, cached (or unknown)
REQUESTS = st.lists(
    st.tuples(
        st.integers(0, 2),
        st.sampled_from(["r0", "r1"]),
        st.sampled_from(["ok", "cancelled"]),
        st.floats(0, 0.02),
        st.integers(0, 9000),
        st.none() | st.integers(0, 99),
    ),
    max_size=25,
)


def served(metrics: ProxyMetrics, request: tuple[Any, ...]) -> None:
    _, replica, outcome, seconds, tokens, cached = request
    metrics.count("default", replica, outcome)
    metrics.decided("kv_aware", seconds)
    metrics.first_byte(replica, seconds)
    metrics.fidelity("default", replica, tokens, tokens // 2, cached)
    metrics.retries.labels("connect").inc()


def parsed(text: bytes) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of an exposition text but creation times, by name and labels."""
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text.decode())
        for s in family.samples
        if not s.name.endswith("_created")
    }


def test_one_workers_metrics_render_as_they_always_did() -> None:
    metrics = ProxyMetrics()
    metrics.watch(lambda: math.inf, lambda: 1.0, lambda: {"m": "ids differ"})
    for request in [(0, "r0", "ok", 0.001, 100, 16), (0, "r1", "cancelled", 0.3, 7, None)]:
        served(metrics, request)
    assert render(merge([families(metrics.registry)])) == metrics.render()


@settings(max_examples=30, deadline=None)
@given(requests=REQUESTS)
def test_counters_and_histograms_add_up_across_workers(requests: list[tuple[Any, ...]]) -> None:
    """What three workers counted, merged, is what one process serving every request
    would have counted."""
    workers = [ProxyMetrics() for _ in range(3)]
    whole = ProxyMetrics()
    for request in requests:
        served(workers[request[0]], request)
        served(whole, request)
    merged = parsed(render(merge(families(w.registry) for w in workers)))
    assert merged == pytest.approx(parsed(whole.render()))  # sums of seconds: float order


def test_gauges_add_up_only_for_requests_in_flight() -> None:
    """Requests in flight are each worker's own; the other gauges are each worker's
    judgement of the same fleet: the worst one stands (the stalest state)."""
    first, second = ProxyMetrics(), ProxyMetrics()
    first.watch(lambda: 0.5, lambda: 1.0, lambda: {"a": "ids differ"})
    second.watch(lambda: math.inf, lambda: 0.0, lambda: {"b": "ids differ"})
    first.in_flight.set(3)
    second.in_flight.set(4)
    merged = parsed(render(merge([families(first.registry), families(second.registry)])))
    assert merged[(PREFIX + "requests_in_flight", ())] == 7
    assert merged[(PREFIX + "state_age_seconds", ())] == math.inf
    assert merged[(PREFIX + "circuit_open_replicas", ())] == 1
    mismatched = {labels for (name, labels), _ in merged.items() if name.endswith("mismatch")}
    assert mismatched == {(("model", "a"),), (("model", "b"),)}


async def test_the_scraped_worker_gathers_its_siblings_over_their_sockets(
    tmp_path: Path,
) -> None:
    workers = [ProxyMetrics() for _ in range(2)]
    siblings = [
        Siblings(WorkerGroup(str(tmp_path), i, 2), w.registry) for i, w in enumerate(workers)
    ]
    for sibling in siblings:
        await sibling.start()
    try:
        served(workers[0], (0, "r0", "ok", 0.001, 10, 5))
        served(workers[1], (1, "r0", "ok", 0.002, 20, 0))
        served(workers[1], (1, "r1", "ok", 0.002, 30, None))
        for sibling in siblings:  # whichever worker a scrape reaches
            merged = parsed(await sibling.render())
            r0 = (("replica", "r0"), ("workload", "default"))
            assert merged[(PREFIX + "requests_total", (("outcome", "ok"), *r0))] == 2
            assert merged[(PREFIX + "prompt_tokens_total", r0)] == 30
            assert merged[(PREFIX + "retries_total", (("reason", "connect"),))] == 3
        await siblings[1].aclose()
        with pytest.raises(ServiceUnavailable, match="worker 1 of 2"):
            await siblings[0].render()  # a partial sum would read as a counter reset
    finally:
        for sibling in siblings:
            await sibling.aclose()
