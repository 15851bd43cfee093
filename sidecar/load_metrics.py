"""An engine's Prometheus ``/metrics`` text -> the load figures a ``LoadReport`` carries.

Pure parsing, no HTTP. Only the lines of the few metrics the router needs are read, so a
large exposition (histograms per model and engine) costs little. Series of one metric
(several engine cores, DP ranks) are summed, except the usage ratio, which is averaged.

The queries counter also tells a restarted engine (:func:`restarted_between`): a
Prometheus counter only goes back when its process started again, and a new engine
process starts with an empty cache, whether or not its KV events say so.

=================  ==============================================  ========================
LoadReport field   vLLM (first name present wins)                  SGLang
=================  ==============================================  ========================
running            vllm:num_requests_running                       sglang:num_running_reqs
waiting            vllm:num_requests_waiting                       sglang:num_queue_reqs
kv_usage           vllm:kv_cache_usage_perc, gpu_cache_usage_perc  sglang:token_usage
queries (tokens)   vllm:prefix_cache_queries_total (+ old names)   sglang:prompt_tokens_total
hits (tokens)      vllm:prefix_cache_hits_total (+ old names)      sglang:cached_tokens_total
capacity, size     vllm:cache_config_info{num_gpu_blocks,block_size}  --
prefill_requests   vllm:request_prefill_time_seconds_count         TTFT's _count (*)
prefill_seconds    vllm:request_prefill_time_seconds_sum           TTFT's _sum less queue
prefill_computed   vllm:request_prefill_kv_computed_tokens_sum     prompt less cached tokens
queue_seconds      vllm:request_queue_time_seconds_sum             sglang:queue_time_seconds
=================  ==============================================  ========================

(*) ``sglang:time_to_first_token_seconds``.

The prefill figures are the engine's own timing of its requests (their exact definitions
are in ``enginesim/metrics.py``, which emits them as the engines do): how many requests it
timed, the seconds from the step that first admitted each to its first token (vLLM's
*prefill* phase; requests admitted together each count the whole step) and the prompt
tokens they computed. They are cumulative, so a reader takes differences between two
reports (``kvcore.policies.engine_rates``). Where the engine lacks a series:

- a vLLM without the computed-tokens histogram (older releases): its prefix-cache queries less hits
  stand in (counted when requests are scheduled, not when they finish: the same tokens,
  some seconds apart);
- SGLang times no prefill of its own: its time to first token less its queueing stands in
  (tokenization and its processes' hops included), and only where it reports its
  queueing (``sglang:queue_time_seconds``); without that the prefill figures stay 0.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

RUNNING = ("vllm:num_requests_running", "sglang:num_running_reqs")
WAITING = ("vllm:num_requests_waiting", "sglang:num_queue_reqs")
USAGE = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc", "sglang:token_usage")
QUERIES = (
    "vllm:prefix_cache_queries_total",
    "vllm:prefix_cache_queries",
    "vllm:gpu_prefix_cache_queries_total",
    "vllm:gpu_prefix_cache_queries",
    "sglang:prompt_tokens_total",
)
HITS = (
    "vllm:prefix_cache_hits_total",
    "vllm:prefix_cache_hits",
    "vllm:gpu_prefix_cache_hits_total",
    "vllm:gpu_prefix_cache_hits",
    "sglang:cached_tokens_total",
)
CACHE_INFO = "vllm:cache_config_info"
VLLM_PREFILL = "vllm:request_prefill_time_seconds"
VLLM_QUEUE = "vllm:request_queue_time_seconds"
VLLM_COMPUTED = "vllm:request_prefill_kv_computed_tokens_sum"
SGLANG_TTFT = "sglang:time_to_first_token_seconds"
SGLANG_QUEUE = "sglang:queue_time_seconds_sum"
_PHASES = (
    f"{VLLM_PREFILL}_count",
    f"{VLLM_PREFILL}_sum",
    f"{VLLM_QUEUE}_sum",
    VLLM_COMPUTED,
    f"{SGLANG_TTFT}_count",
    f"{SGLANG_TTFT}_sum",
    SGLANG_QUEUE,
)
_WANTED = frozenset((*RUNNING, *WAITING, *USAGE, *QUERIES, *HITS, CACHE_INFO, *_PHASES))
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


@dataclass(frozen=True, slots=True)
class PrefillTotals:
    """The engine's timing of its requests' prefills, cumulative (module docstring)."""

    requests: int = 0
    seconds: float = 0.0
    computed_tokens: int = 0
    queue_seconds: float = 0.0


@dataclass(frozen=True, slots=True)
class EngineLoad:
    running: int = 0
    waiting: int = 0
    kv_usage: float = 0.0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    queries_reported: bool = False  # the queries counter was in the exposition
    capacity_blocks: int = 0
    engine_block_size: int = 0
    role: str = ""  # the engine's P/D role where it tells it (SGLang): prefill/decode/both
    bootstrap_port: int = 0  # an SGLang prefill server's bootstrap server
    prefill: PrefillTotals | None = None  # the engine's own prefill timing, where it has one


def _sample(line: str) -> tuple[str, str, float] | None:
    """``(name, labels, value)`` of one exposition line, or ``None``."""
    brace = line.find("{")
    space = line.find(" ")
    if brace != -1 and (space == -1 or brace < space):
        close = line.rfind("}")
        name, labels, rest = line[:brace], line[brace + 1 : close], line[close + 1 :]
    else:
        name, labels, rest = line[:space], "", line[space:]
    if name not in _WANTED:
        return None
    try:
        value = float(rest.split()[0])
    except (IndexError, ValueError):
        return None
    return (name, labels, value) if math.isfinite(value) else None


def _collect(text: str) -> tuple[dict[str, list[float]], dict[str, str]]:
    series: dict[str, list[float]] = {}
    cache_info: dict[str, str] = {}
    for line in text.splitlines():
        if not line or line[0] == "#":
            continue
        sample = _sample(line)
        if sample is None:
            continue
        name, labels, value = sample
        series.setdefault(name, []).append(value)
        if name == CACHE_INFO:
            cache_info = dict(_LABEL.findall(labels))
    return series, cache_info


def _first(series: dict[str, list[float]], names: tuple[str, ...]) -> list[float]:
    return next((series[n] for n in names if n in series), [])


def _int_label(labels: dict[str, str], name: str) -> int:
    try:
        return max(0, int(labels.get(name, "0")))
    except ValueError:
        return 0


def _total(series: dict[str, list[float]], name: str) -> float | None:
    values = series.get(name)
    return None if values is None else sum(values)


def _prefill(series: dict[str, list[float]], queries: int, hits: int) -> PrefillTotals | None:
    """The engine's prefill timing (see the module docstring), ``None`` without one."""
    count = _total(series, f"{VLLM_PREFILL}_count")
    if count is not None:  # vLLM
        computed = _total(series, VLLM_COMPUTED)
        return PrefillTotals(
            requests=max(0, round(count)),
            seconds=max(0.0, _total(series, f"{VLLM_PREFILL}_sum") or 0.0),
            computed_tokens=max(0, round(computed if computed is not None else queries - hits)),
            queue_seconds=max(0.0, _total(series, f"{VLLM_QUEUE}_sum") or 0.0),
        )
    count, queued = _total(series, f"{SGLANG_TTFT}_count"), _total(series, SGLANG_QUEUE)
    if count is None or queued is None:
        return None
    ttft = _total(series, f"{SGLANG_TTFT}_sum") or 0.0
    return PrefillTotals(
        requests=max(0, round(count)),
        seconds=max(0.0, ttft - queued),
        computed_tokens=max(0, queries - hits),
        queue_seconds=max(0.0, queued),
    )


def parse_engine_load(text: str) -> EngineLoad:
    """The load figures in one ``/metrics`` exposition (vLLM or SGLang names)."""
    series, cache_info = _collect(text)
    usage = _first(series, USAGE)
    queries = _first(series, QUERIES)
    queried, hits = max(0, round(sum(queries))), max(0, round(sum(_first(series, HITS))))
    return EngineLoad(
        running=max(0, round(sum(_first(series, RUNNING)))),
        waiting=max(0, round(sum(_first(series, WAITING)))),
        kv_usage=min(1.0, max(0.0, sum(usage) / len(usage))) if usage else 0.0,
        prefix_cache_queries=queried,
        prefix_cache_hits=hits,
        queries_reported=bool(queries),
        capacity_blocks=_int_label(cache_info, "num_gpu_blocks"),
        engine_block_size=_int_label(cache_info, "block_size"),
        prefill=_prefill(series, queried, hits),
    )


def restarted_between(before: EngineLoad | None, after: EngineLoad) -> bool:
    """Whether the engine restarted between two scrapes: its prefix-cache queries counter
    went back (a counter's reset, as Prometheus's ``rate()`` reads it)."""
    return (
        before is not None
        and before.queries_reported
        and after.queries_reported
        and after.prefix_cache_queries < before.prefix_cache_queries
    )
