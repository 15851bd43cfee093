"""The proxy's Prometheus metrics, in one registry per worker process (a proxy of several
workers answers a scrape with all of theirs merged: :mod:`dataplane.transport.worker_metrics`).

Names (prefix ``kvroute_proxy_``):

| metric | labels | what |
|---|---|---|
| ``requests_total`` | workload, replica, outcome | requests by how they ended (below) |
| ``decision_seconds`` | strategy | classify + render + tokenize + key + score |
| ``prompt_tokens_total`` | workload, replica | prompt tokens of requests answered whole (below) |
| ``predicted_cached_tokens_total`` | workload, replica | cached tokens routing expected there |
| ``measured_cached_tokens_total`` | workload, replica | cached tokens the engine reported |
| ``measured_requests_total`` | workload, replica | responses that reported cached tokens |
| ``upstream_ttfb_seconds`` | replica | request sent -> first body byte from the replica |
| ``retries_total`` | reason | attempts on another replica (reasons below) |
| ``retries_refused_total`` | | retries the retry budget did not allow |
| ``state_age_seconds`` | | since the last control-plane update (+Inf: never; 0: static) |
| ``circuit_open_replicas`` | | replicas a circuit breaker keeps out |
| ``requests_in_flight`` | | requests sent to a replica and not finished (the HPA's metric) |
| ``tokenizer_mismatch`` | model | 1 while the tokenizer probe flags the model |

The per-request series (all but ``retries*`` and the gauges) are plain numbers in dicts
keyed by label values (:class:`CounterTable`, :class:`HistogramTable`), turned into
metric families only when scraped: adding to one is a dict update, where a
``prometheus_client`` child takes a lock and checks its state on every ``inc``. Only the
worker's event-loop thread writes them, and scrapes run on that thread too.

Outcomes: ``ok``, ``upstream_error`` (a 5xx or a broken stream), ``client_error`` (a 4xx
from the engine), ``no_replica``, ``cancelled`` (the client went away), and for an endpoint
picker (``kvroute-epp``, which exports these same metrics) ``shed`` (its 429). Retry reasons:
``connect``, ``status_502``, ``status_503``, ``disconnect``, ``timeout`` (no byte for
``--upstream-timeout-s``). Only requests that reached a replica carry its id; requests
refused before routing are counted with ``replica=""``. The three token counters count
the same requests, those that ended ``ok`` (:mod:`dataplane.exchange`).
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable, Iterator

from mypy_extensions import mypyc_attr
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

PREFIX = "kvroute_proxy_"
CONTENT_TYPE = CONTENT_TYPE_LATEST.encode()
DECISION_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.003, 0.005, 0.01, 0.025, 0.1)
TTFB_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)


class CounterTable:
    """A labelled counter as numbers by label values; :meth:`collect` at scrape time."""

    def __init__(self, name: str, documentation: str, labels: tuple[str, ...]) -> None:
        self.name = name
        self.documentation = documentation
        self.labels = labels
        self.values: dict[tuple[str, ...], float] = {}

    def add(self, key: tuple[str, ...], amount: float = 1.0) -> None:
        values = self.values
        values[key] = values.get(key, 0.0) + amount

    def collect(self) -> Metric:
        family = CounterMetricFamily(self.name, self.documentation, labels=self.labels)
        for key, value in self.values.items():
            family.add_metric(key, value)
        return family


class HistogramTable:
    """A labelled histogram as bucket counts by label values (each row: one count per
    bucket, ``+Inf`` last, then the sum); :meth:`collect` at scrape time."""

    def __init__(
        self, name: str, documentation: str, labels: tuple[str, ...], buckets: tuple[float, ...]
    ) -> None:
        self.name = name
        self.documentation = documentation
        self.labels = labels
        self.bounds = buckets
        self.rows: dict[tuple[str, ...], list[float]] = {}
        self._les = [floatToGoString(b) for b in buckets] + ["+Inf"]  # type: ignore[no-untyped-call]

    def observe(self, key: tuple[str, ...], value: float) -> None:
        row = self.rows.get(key)
        if row is None:
            row = self.rows[key] = [0.0] * (len(self.bounds) + 2)
        row[bisect_left(self.bounds, value)] += 1  # the first bucket whose bound >= value
        row[-1] += value

    def collect(self) -> Metric:
        family = HistogramMetricFamily(self.name, self.documentation, labels=self.labels)
        for key, row in self.rows.items():
            cumulative, buckets = 0.0, []
            for le, count in zip(self._les, row, strict=False):
                cumulative += count
                buckets.append((le, cumulative))
            family.add_metric(key, buckets, row[-1])
        return family


@mypyc_attr(allow_interpreted_subclasses=True)  # tests log its calls in a subclass
class ProxyMetrics:
    """Every metric of one worker; ``registry`` is what ``/metrics`` renders."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        pair = ("workload", "replica")
        self.requests = CounterTable(
            PREFIX + "requests", "Requests by outcome", ("workload", "replica", "outcome")
        )
        self.decision = HistogramTable(
            PREFIX + "decision_seconds", "Routing decision time", ("strategy",), DECISION_BUCKETS
        )
        self.prompt_tokens = CounterTable(PREFIX + "prompt_tokens", "Prompt tokens", pair)
        self.predicted = CounterTable(
            PREFIX + "predicted_cached_tokens", "Cached tokens predicted", pair
        )
        self.measured = CounterTable(
            PREFIX + "measured_cached_tokens", "Cached tokens reported", pair
        )
        self.measured_requests = CounterTable(
            PREFIX + "measured_requests", "Responses reporting cached tokens", pair
        )
        self.ttfb = HistogramTable(
            PREFIX + "upstream_ttfb_seconds", "Upstream time to first byte", ("replica",),
            TTFB_BUCKETS,
        )  # fmt: skip
        r.register(_Tables([self.requests, self.decision, self.prompt_tokens, self.predicted,
                            self.measured, self.measured_requests, self.ttfb]))  # fmt: skip
        self.retries = Counter(PREFIX + "retries", "Retries by reason", ["reason"], registry=r)
        self.retries_refused = Counter(
            PREFIX + "retries_refused", "Retries the budget refused", registry=r
        )
        self.lora_changes = Counter(
            PREFIX + "lora_adapter_changes",
            "LoRA adapters this proxy loaded or unloaded on replicas",
            ["action", "outcome"],
            registry=r,
        )
        self.state_age = Gauge(PREFIX + "state_age_seconds", "Routing state age", registry=r)
        self.circuit_open = Gauge(
            PREFIX + "circuit_open_replicas", "Replicas kept out by a breaker", registry=r
        )
        self.in_flight = Gauge(
            PREFIX + "requests_in_flight", "Requests sent to a replica, not finished", registry=r
        )

    def count(self, workload: str, replica: str, outcome: str) -> None:
        self.requests.add((workload, replica, outcome))

    def decided(self, strategy: str, seconds: float) -> None:
        self.decision.observe((strategy,), seconds)

    def first_byte(self, replica: str, seconds: float) -> None:
        """A replica's time to first byte (``upstream_ttfb_seconds``)."""
        self.ttfb.observe((replica,), seconds)

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

    def watch_prefill_rates(self, rates: Callable[[], dict[str, float]]) -> None:
        """``prefill_tokens_per_second{replica}``, read at scrape time."""
        self.registry.register(_PrefillRateCollector(rates))

    def fidelity(
        self,
        workload: str,
        replica: str,
        prompt_tokens: int,
        predicted: int,
        measured: int | None,
    ) -> None:
        key = (workload, replica)
        self.prompt_tokens.add(key, prompt_tokens)
        self.predicted.add(key, predicted)
        if measured is not None:
            self.measured.add(key, measured)
            self.measured_requests.add(key)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _Tables(Collector):
    """The tables' families, built at scrape time."""

    def __init__(self, tables: list[CounterTable | HistogramTable]) -> None:
        self._tables = tables

    def collect(self) -> Iterator[Metric]:
        for table in self._tables:
            yield table.collect()


class _PrefillRateCollector(Collector):
    """``prefill_tokens_per_second{replica}``: the prefill rate this worker ranks each
    replica at under kv_cost (learned from its timings, else configured); none without
    a kv_cost workload."""

    def __init__(self, rates: Callable[[], dict[str, float]]) -> None:
        self._rates = rates

    def collect(self) -> Iterator[Metric]:
        family = GaugeMetricFamily(
            PREFIX + "prefill_tokens_per_second",
            "Prefill rate kv_cost ranks each replica at (learned, else configured)",
            labels=["replica"],
        )
        for replica, rate in sorted(self._rates().items()):
            family.add_metric([replica], rate)
        yield family


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
