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

**A request's queueing and prefill, as each engine times them** (what a router needs to
tell a replica's own prefill speed from the work queued ahead of a request; the sidecar
reads them, ``sidecar/load_metrics.py``):

- vLLM V1 (``vllm/v1/metrics/stats.py``, ``IterationStats.update_from_finished_request``;
  ``loggers.py``), every one observed once per request *when it finishes*, not when its
  first token comes:

  - ``vllm:request_queue_time_seconds`` (histogram): from the request's first ``QUEUED``
    engine-core event (added to the scheduler's waiting queue) to its first ``SCHEDULED``
    event (the step that first admits it; a preempted request keeps its first);
  - ``vllm:request_prefill_time_seconds`` (histogram): from that first ``SCHEDULED`` to its
    first token (the engine-core timestamp of the step output carrying it), preemptions
    during the prefill included. Requests admitted in one step each record the whole
    step: two prompts prefilled together both record the step's length (both prefills,
    and the decode of the running batch the step also ran), not each its own share;
  - ``vllm:request_prefill_kv_computed_tokens`` (histogram, newer vLLM only): the
    prompt tokens whose KV the request computed, its prompt less its cached tokens (local
    and connector hits) at its first scheduling;
  - buckets: vLLM's ``request_latency_buckets`` for the two times (0.3 s to 7,680 s), the
    1-2-5 series up to ``max_model_len`` for the tokens; labels ``model_name``, ``engine``.

  Also there and not used here: ``vllm:request_prompt_tokens`` (whole prompts, cached
  included), ``vllm:iteration_tokens_total`` (tokens per engine step, prompt and
  generation, no time), ``vllm:request_inference_time_seconds`` and
  ``vllm:request_decode_time_seconds``. vLLM has no per-step time series.
- SGLang 0.5 (``python/sglang/srt/metrics/collector.py``):

  - ``sglang:queue_time_seconds`` (histogram, buckets 0 to 3,000 s): from the request's
    entry into the scheduler's waiting queue to its entry into a forward batch (the
    prefill batch that takes it), observed then;
  - ``sglang:time_to_first_token_seconds`` (histogram, above): from the tokenizer
    manager's receipt of the request to its first output, observed at the first token;
  - ``sglang:prompt_tokens_total`` and ``sglang:cached_tokens_total`` (counters, above):
    a finished request's prompt and cached tokens.

  SGLang has no per-request prefill-time histogram: its time in prefill is its time to
  first token less its queueing (tokenization and the hops between its processes
  included). Newer SGLang also counts ``sglang:realtime_tokens_total{mode=
  "prefill_compute"|"prefill_cache"|"decode"}`` per batch and, only with its device timer
  enabled, ``sglang:gpu_execution_seconds_total{category}``; ``sglang:gen_throughput`` is
  decode tokens per second between two log intervals, not prefill.

The simulator records them exactly so: a request's queueing runs from its submission to
the start of the step that first admits it, its prefill from that start to the end of
the step (the first token), for every request of the step alike.
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
# vLLM's request_latency_buckets (queue, prefill, decode, inference times)
_VLLM_REQUEST_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
    120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip
_SGLANG_QUEUE_BUCKETS = (
    0.0, 0.1, 0.2, 0.5, 1, 2, 3, 4, 5, 10, 15, 20, 30, 40, 50, 60, 70, 80, 90, 100, 200,
    300, 400, 500, 600, 700, 800, 900, 1000, 1200, 1400, 1600, 1800, 2000, 2500, 3000,
)  # fmt: skip


def buckets_1_2_5(limit: int) -> tuple[float, ...]:
    """vLLM's ``build_1_2_5_buckets``: 1, 2, 5, 10, 20, 50... up to ``limit``."""
    buckets: list[float] = []
    exponent = 0
    while True:
        for mantissa in (1, 2, 5):
            value = mantissa * 10**exponent
            if value > limit:
                return tuple(buckets)
            buckets.append(float(value))
        exponent += 1


@dataclass(frozen=True, slots=True)
class RequestTiming:
    """One request's engine-side times (see the module docstring): ``queue_s`` from its
    submission to the start of the step that first admitted it, ``prefill_s`` from there
    to its first token, ``computed_tokens`` its prompt less its cached tokens."""

    queue_s: float
    prefill_s: float
    computed_tokens: int


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

    def on_first_token(self, ttft_s: float, timing: RequestTiming) -> None: ...
    def on_finished(self, e2e_s: float, generated: int, timing: RequestTiming | None) -> None:
        """A request finished; ``timing`` is ``None`` for one never admitted."""

    def render(self, load: LoadSnapshot) -> bytes: ...


@dataclass(frozen=True)
class CacheConfig:
    model: str
    block_size: int
    num_blocks: int
    hash_algo: str
    max_model_len: int = 1 << 20


class _Builder:
    """Creates labelled metric children in one registry with one label set."""

    def __init__(self, registry: CollectorRegistry, labels: dict[str, str]) -> None:
        self.registry, self.labels = registry, labels

    def gauge(self, name: str, doc: str) -> Gauge:
        return Gauge(name, doc, list(self.labels), registry=self.registry).labels(**self.labels)

    def counter(self, name: str, doc: str) -> Counter:
        metric = Counter(name, doc, list(self.labels), registry=self.registry)
        return metric.labels(**self.labels)

    def histogram(
        self, name: str, doc: str, buckets: tuple[float, ...] = _LATENCY_BUCKETS
    ) -> Histogram:
        metric = Histogram(name, doc, list(self.labels), buckets=buckets, registry=self.registry)
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
        self.queue_time = histogram(
            "vllm:request_queue_time_seconds",
            "Histogram of time spent in WAITING phase for request.",
            _VLLM_REQUEST_BUCKETS,
        )
        self.prefill_time = histogram(
            "vllm:request_prefill_time_seconds",
            "Histogram of time spent in PREFILL phase for request.",
            _VLLM_REQUEST_BUCKETS,
        )
        self.computed = histogram(
            "vllm:request_prefill_kv_computed_tokens",
            "Histogram of new KV tokens computed during prefill (excluding cached tokens).",
            buckets_1_2_5(cfg.max_model_len),
        )
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

    def on_first_token(self, ttft_s: float, timing: RequestTiming) -> None:
        self.ttft.observe(ttft_s)

    def on_finished(self, e2e_s: float, generated: int, timing: RequestTiming | None) -> None:
        self.e2e.observe(e2e_s)
        self.generation.inc(generated)
        if timing is not None:  # vLLM observes a request's phases when it finishes
            self.queue_time.observe(timing.queue_s)
            self.prefill_time.observe(timing.prefill_s)
            self.computed.observe(timing.computed_tokens)

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
        self.queue_time = histogram(
            "sglang:queue_time_seconds",
            "Histogram of queueing time in seconds.",
            _SGLANG_QUEUE_BUCKETS,
        )

    def on_admitted(
        self, prompt_tokens: int, hit_tokens: int, read_tokens: int, cached_tokens: int
    ) -> None:
        # what its answer reports cached, as SGLang counts each finished request's
        self.prompt.inc(prompt_tokens)
        self.cached.inc(cached_tokens)
        self._queried_tokens += prompt_tokens
        self._hit_tokens += cached_tokens

    def on_first_token(self, ttft_s: float, timing: RequestTiming) -> None:
        self.queue_time.observe(timing.queue_s)  # at its prefill batch: its step's end here
        self.ttft.observe(ttft_s)

    def on_finished(self, e2e_s: float, generated: int, timing: RequestTiming | None) -> None:
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
