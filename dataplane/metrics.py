"""The proxy's Prometheus metrics, in one registry per worker process.

Names (prefix ``kvroute_proxy_``):

| metric | labels | what |
|---|---|---|
| ``requests_total`` | workload, replica, outcome | requests by how they ended (below) |
| ``decision_seconds`` | strategy | classify + render + tokenize + key + score |
| ``prompt_tokens_total`` | workload, replica | prompt tokens routed |
| ``predicted_cached_tokens_total`` | workload, replica | cached tokens the router expected |
| ``measured_cached_tokens_total`` | workload, replica | cached tokens the engine reported |
| ``measured_requests_total`` | workload, replica | responses that reported cached tokens |
| ``upstream_ttfb_seconds`` | replica | request sent -> first body byte from the replica |
| ``retries_total`` | reason | attempts on another replica (reasons below) |
| ``retries_refused_total`` | | retries the retry budget did not allow |
| ``state_age_seconds`` | | since the last control-plane update (+Inf: never; 0: static) |
| ``circuit_open_replicas`` | | replicas a circuit breaker keeps out |
| ``requests_in_flight`` | | requests sent to a replica and not finished (the HPA's metric) |
| ``tokenizer_mismatch`` | model | 1 while the tokenizer probe flags the model |

Outcomes: ``ok``, ``upstream_error`` (a 5xx or a broken stream), ``client_error`` (a 4xx
from the engine), ``no_replica``, ``cancelled`` (the client went away). Retry reasons:
``connect``, ``status_502``, ``status_503``, ``disconnect``. Only requests that reached
a replica carry its id; requests refused before routing are counted with ``replica=""``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.registry import Collector

PREFIX = "kvroute_proxy_"
CONTENT_TYPE = CONTENT_TYPE_LATEST.encode()
DECISION_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.003, 0.005, 0.01, 0.025, 0.1)
TTFB_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)


class ProxyMetrics:
    """Every metric of one worker; ``registry`` is what ``/metrics`` renders."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter(
            PREFIX + "requests", "Requests by outcome", ["workload", "replica", "outcome"],
            registry=r,
        )  # fmt: skip
        self.decision = Histogram(
            PREFIX + "decision_seconds", "Routing decision time", ["strategy"],
            buckets=DECISION_BUCKETS, registry=r,
        )  # fmt: skip
        pair = ["workload", "replica"]
        self.prompt_tokens = Counter(PREFIX + "prompt_tokens", "Prompt tokens", pair, registry=r)
        self.predicted = Counter(
            PREFIX + "predicted_cached_tokens", "Cached tokens predicted", pair, registry=r
        )
        self.measured = Counter(
            PREFIX + "measured_cached_tokens", "Cached tokens reported", pair, registry=r
        )
        self.measured_requests = Counter(
            PREFIX + "measured_requests", "Responses reporting cached tokens", pair, registry=r
        )
        self.ttfb = Histogram(
            PREFIX + "upstream_ttfb_seconds", "Upstream time to first byte", ["replica"],
            buckets=TTFB_BUCKETS, registry=r,
        )  # fmt: skip
        self.retries = Counter(PREFIX + "retries", "Retries by reason", ["reason"], registry=r)
        self.retries_refused = Counter(
            PREFIX + "retries_refused", "Retries the budget refused", registry=r
        )
        self.state_age = Gauge(PREFIX + "state_age_seconds", "Routing state age", registry=r)
        self.circuit_open = Gauge(
            PREFIX + "circuit_open_replicas", "Replicas kept out by a breaker", registry=r
        )
        self.in_flight = Gauge(
            PREFIX + "requests_in_flight", "Requests sent to a replica, not finished", registry=r
        )
        # label children by label values: labels() takes a lock and builds a tuple each time
        self._requests: dict[tuple[str, str, str], Any] = {}
        self._decisions: dict[str, Any] = {}
        self._ttfbs: dict[str, Any] = {}
        self._fidelity: dict[tuple[str, str], tuple[Any, Any, Any, Any]] = {}

    def count(self, workload: str, replica: str, outcome: str) -> None:
        key = (workload, replica, outcome)
        child = self._requests.get(key)
        if child is None:
            child = self._requests[key] = self.requests.labels(*key)
        child.inc()

    def decided(self, strategy: str, seconds: float) -> None:
        child = self._decisions.get(strategy)
        if child is None:
            child = self._decisions[strategy] = self.decision.labels(strategy)
        child.observe(seconds)

    def first_byte(self, replica: str, seconds: float) -> None:
        """A replica's time to first byte (``upstream_ttfb_seconds``)."""
        child = self._ttfbs.get(replica)
        if child is None:
            child = self._ttfbs[replica] = self.ttfb.labels(replica)
        child.observe(seconds)

    def watch(
        self,
        state_age: Callable[[], float],
        circuit_open: Callable[[], float],
        mismatches: Callable[[], dict[str, str]],
    ) -> None:
        """Read the gauges from the service at scrape time."""
        self.state_age.set_function(state_age)
        self.circuit_open.set_function(circuit_open)
        self.registry.register(_MismatchCollector(mismatches))

    def fidelity(
        self,
        workload: str,
        replica: str,
        prompt_tokens: int,
        predicted: int,
        measured: int | None,
    ) -> None:
        children = self._fidelity.get((workload, replica))
        if children is None:
            children = self._fidelity[(workload, replica)] = tuple(  # type: ignore[assignment]
                metric.labels(workload, replica)
                for metric in (self.prompt_tokens, self.predicted, self.measured,
                               self.measured_requests)
            )  # fmt: skip
            assert children is not None
        prompt, predicted_child, measured_child, measured_requests = children
        prompt.inc(prompt_tokens)
        predicted_child.inc(predicted)
        if measured is not None:
            measured_child.inc(measured)
            measured_requests.inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _MismatchCollector(Collector):
    """``tokenizer_mismatch{model}``: 1 for each model the probe flagged."""

    def __init__(self, mismatches: Callable[[], dict[str, str]]) -> None:
        self._mismatches = mismatches

    def collect(self) -> Iterator[Metric]:
        family = GaugeMetricFamily(
            PREFIX + "tokenizer_mismatch",
            "Models whose engines tokenize the probe differently from this proxy",
            labels=["model"],
        )
        for model in self._mismatches():
            family.add_metric([model], 1.0)
        yield family
