"""Prometheus metrics under the engines' own names, so load scrapers work unchanged.

``vllm`` formats (vLLM V1, ``vllm/v1/metrics/loggers.py``; labels ``model_name``,
``engine``): ``vllm:num_requests_running``, ``vllm:num_requests_waiting``,
``vllm:kv_cache_usage_perc``, ``vllm:prefix_cache_queries_total``,
``vllm:prefix_cache_hits_total`` (tokens, the local cache's only),
``vllm:external_prefix_cache_queries_total`` and ``vllm:external_prefix_cache_hits_total``
(tokens looked up in and read over the KV connector: the simulator's vLLM engines act as
started with one in ``kv_both`` role, so, as vLLM's scheduler records its connector stats,
every request queries what the local cache lacks and a P/D decode's read is its hits),
``vllm:prompt_tokens_total``,
``vllm:generation_tokens_total``, ``vllm:time_to_first_token_seconds``,
``vllm:e2e_request_latency_seconds`` and ``vllm:cache_config_info`` (``block_size``,
``num_gpu_blocks``, ``prefix_caching_hash_algo``...).

``sglang`` format (labels ``model_name``): ``sglang:num_running_reqs``,
``sglang:num_queue_reqs``, ``sglang:token_usage``, ``sglang:num_used_tokens``,
``sglang:cache_hit_rate``, ``sglang:prompt_tokens_total``,
``sglang:generation_tokens_total``, ``sglang:cached_tokens_total``,
``sglang:time_to_first_token_seconds``, ``sglang:e2e_request_latency_seconds``.

Each engine owns its registry (no global state). Gauges are read from the engine when
scraped; counters and histograms are fed by ``Engine`` as requests are admitted and
finish, so the scheduler itself knows nothing of metrics.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_LATENCY_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5,
    0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip


@dataclass(frozen=True)
class LoadSnapshot:
    running: int
    waiting: int
    kv_usage: float
    used_tokens: int


class EngineMetrics(Protocol):
    def on_admitted(
        self, prompt_tokens: int, hit_tokens: int, read_tokens: int, cached_tokens: int
    ) -> None:
        """A request admitted: its prompt, the tokens found in the local cache, those
        read from another engine (P/D, ``pd.py``) and the cached tokens its answer
        reports."""

    def on_first_token(self, ttft_s: float) -> None: ...
    def on_finished(self, e2e_s: float, generated: int) -> None: ...
    def render(self, load: LoadSnapshot) -> bytes: ...


@dataclass(frozen=True)
class CacheConfig:
    model: str
    block_size: int
    num_blocks: int
    hash_algo: str


class _Builder:
    """Creates labelled metric children in one registry with one label set."""

    def __init__(self, registry: CollectorRegistry, labels: dict[str, str]) -> None:
        self.registry, self.labels = registry, labels

    def gauge(self, name: str, doc: str) -> Gauge:
        return Gauge(name, doc, list(self.labels), registry=self.registry).labels(**self.labels)

    def counter(self, name: str, doc: str) -> Counter:
        metric = Counter(name, doc, list(self.labels), registry=self.registry)
        return metric.labels(**self.labels)

    def histogram(self, name: str, doc: str) -> Histogram:
        metric = Histogram(
            name, doc, list(self.labels), buckets=_LATENCY_BUCKETS, registry=self.registry
        )
        return metric.labels(**self.labels)


class VllmMetrics:
    def __init__(self, cfg: CacheConfig) -> None:
        self.registry = r = CollectorRegistry(auto_describe=True)
        b = _Builder(r, {"model_name": cfg.model, "engine": "0"})
        gauge, counter, histogram = b.gauge, b.counter, b.histogram

        self.running = gauge("vllm:num_requests_running", "Requests in execution batches.")
        self.waiting = gauge("vllm:num_requests_waiting", "Requests waiting to be processed.")
        self.usage = gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent.")
        self.queries = counter("vllm:prefix_cache_queries", "Prefix cache queries, in tokens.")
        self.hits = counter("vllm:prefix_cache_hits", "Prefix cache hits, in tokens.")
        self.external_queries = counter(
            "vllm:external_prefix_cache_queries",
            "External prefix cache queries from KV connector cross-instance cache sharing, "
            "in terms of number of queried tokens.",
        )
        self.external_hits = counter(
            "vllm:external_prefix_cache_hits",
            "External prefix cache hits from KV connector cross-instance cache sharing, in "
            "terms of number of cached tokens.",
        )
        self.prompt = counter("vllm:prompt_tokens", "Prefill tokens processed.")
        self.generation = counter("vllm:generation_tokens", "Generation tokens processed.")
        self.ttft = histogram("vllm:time_to_first_token_seconds", "Time to first token.")
        self.e2e = histogram("vllm:e2e_request_latency_seconds", "End-to-end request latency.")
        info = {
            "block_size": str(cfg.block_size),
            "num_gpu_blocks": str(cfg.num_blocks),
            "enable_prefix_caching": "True",
            "prefix_caching_hash_algo": cfg.hash_algo,
            "cache_dtype": "auto",
        }
        Gauge("vllm:cache_config_info", "Information of the LLMEngine CacheConfig.",
              list(info), registry=r).labels(**info).set(1)  # fmt: skip

    def on_admitted(
        self, prompt_tokens: int, hit_tokens: int, read_tokens: int, cached_tokens: int
    ) -> None:
        self.queries.inc(prompt_tokens)
        self.hits.inc(hit_tokens)  # vLLM's prefix cache stats: the local lookup's
        self.external_queries.inc(prompt_tokens - hit_tokens)  # the connector's lookup
        self.external_hits.inc(min(read_tokens, prompt_tokens - hit_tokens))
        self.prompt.inc(prompt_tokens)

    def on_first_token(self, ttft_s: float) -> None:
        self.ttft.observe(ttft_s)

    def on_finished(self, e2e_s: float, generated: int) -> None:
        self.e2e.observe(e2e_s)
        self.generation.inc(generated)

    def render(self, load: LoadSnapshot) -> bytes:
        self.running.set(load.running)
        self.waiting.set(load.waiting)
        self.usage.set(load.kv_usage)
        return generate_latest(self.registry)


class SglangMetrics:
    def __init__(self, cfg: CacheConfig) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        b = _Builder(self.registry, {"model_name": cfg.model})
        gauge, counter, histogram = b.gauge, b.counter, b.histogram
        self._hit_tokens = 0
        self._queried_tokens = 0

        self.running = gauge("sglang:num_running_reqs", "The number of running requests.")
        self.queue = gauge("sglang:num_queue_reqs", "The number of requests in the queue.")
        self.usage = gauge("sglang:token_usage", "The token usage.")
        self.used = gauge("sglang:num_used_tokens", "The number of used tokens.")
        self.hit_rate = gauge("sglang:cache_hit_rate", "The prefix cache hit rate.")
        self.prompt = counter("sglang:prompt_tokens", "Number of prefill tokens processed.")
        self.generation = counter("sglang:generation_tokens", "Number of generation tokens.")
        self.cached = counter("sglang:cached_tokens", "Number of cached prompt tokens.")
        self.ttft = histogram("sglang:time_to_first_token_seconds", "Time to first token.")
        self.e2e = histogram("sglang:e2e_request_latency_seconds", "End-to-end latency.")

    def on_admitted(
        self, prompt_tokens: int, hit_tokens: int, read_tokens: int, cached_tokens: int
    ) -> None:
        # what its answer reports cached, as SGLang counts each finished request's
        self.prompt.inc(prompt_tokens)
        self.cached.inc(cached_tokens)
        self._queried_tokens += prompt_tokens
        self._hit_tokens += cached_tokens

    def on_first_token(self, ttft_s: float) -> None:
        self.ttft.observe(ttft_s)

    def on_finished(self, e2e_s: float, generated: int) -> None:
        self.e2e.observe(e2e_s)
        self.generation.inc(generated)

    def render(self, load: LoadSnapshot) -> bytes:
        self.running.set(load.running)
        self.queue.set(load.waiting)
        self.usage.set(load.kv_usage)
        self.used.set(load.used_tokens)
        if self._queried_tokens:
            self.hit_rate.set(self._hit_tokens / self._queried_tokens)
        return generate_latest(self.registry)


def make_metrics(event_format: str, cfg: CacheConfig) -> EngineMetrics:
    return SglangMetrics(cfg) if event_format == "sglang" else VllmMetrics(cfg)
