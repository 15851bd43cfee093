"""The proxy's per-request metrics render exactly as prometheus_client's own would."""

from __future__ import annotations

from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, Counter, Histogram

from dataplane.metrics import DECISION_BUCKETS, PREFIX, ProxyMetrics

STRATEGIES = st.sampled_from(["kv_aware", "round_robin"])
SECONDS = st.one_of(st.sampled_from(DECISION_BUCKETS), st.floats(0, 0.5))


def samples(registry: CollectorRegistry, name: str) -> set[tuple[str, Any, float]]:
    """A family's samples, without the creation times only prometheus_client writes."""
    found = set()
    for family in registry.collect():
        if family.name == name:
            found |= {
                (s.name, tuple(sorted(s.labels.items())), s.value)
                for s in family.samples
                if not s.name.endswith("_created")
            }
    return found


@settings(max_examples=40)
@given(observed=st.lists(st.tuples(STRATEGIES, SECONDS), max_size=30))
def test_decision_histogram_is_what_a_prometheus_histogram_would_show(
    observed: list[tuple[str, float]],
) -> None:
    metrics = ProxyMetrics()
    reference = CollectorRegistry()
    histogram = Histogram(
        PREFIX + "decision_seconds", "x", ["strategy"], buckets=DECISION_BUCKETS,
        registry=reference,
    )  # fmt: skip
    for strategy, seconds in observed:
        metrics.decided(strategy, seconds)
        histogram.labels(strategy).observe(seconds)
    name = PREFIX + "decision_seconds"
    assert samples(metrics.registry, name) == samples(reference, name)


@settings(max_examples=40)
@given(
    requests=st.lists(
        st.tuples(
            st.sampled_from(["r0", "r1"]), st.integers(0, 9000), st.none() | st.integers(0, 99)
        ),
        max_size=20,
    )
)
def test_fidelity_counters_add_up_per_replica(requests: list[tuple[str, int, int | None]]) -> None:
    metrics = ProxyMetrics()
    reference = CollectorRegistry()
    prompt = Counter(PREFIX + "prompt_tokens", "x", ["workload", "replica"], registry=reference)
    measured = Counter(
        PREFIX + "measured_cached_tokens", "x", ["workload", "replica"], registry=reference
    )
    for replica, tokens, cached in requests:
        metrics.fidelity("default", replica, tokens, 0, cached)
        prompt.labels("default", replica).inc(tokens)
        if cached is not None:
            measured.labels("default", replica).inc(cached)
    for name in ("prompt_tokens", "measured_cached_tokens"):
        assert samples(metrics.registry, PREFIX + name) == samples(reference, PREFIX + name)


def test_a_scrape_names_every_series_before_any_request() -> None:
    text = ProxyMetrics().render().decode()
    for name in ("requests_total counter", "decision_seconds histogram",
                 "upstream_ttfb_seconds histogram", "prompt_tokens_total counter"):  # fmt: skip
        assert f"# TYPE {PREFIX}{name}\n" in text
