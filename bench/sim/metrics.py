"""What a run measured: hit rate (and its ratio to the oracle), TTFT, throughput, balance."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

from bench.sim.simulator import RunOutcome
from bench.sim.workloads import oracle_hit_rate


def percentile(sorted_values: list[float], q: float) -> float:
    """The q-quantile (0-1) by linear interpolation; NaN for no values."""
    if not sorted_values:
        return math.nan
    pos = q * (len(sorted_values) - 1)
    low = math.floor(pos)
    high = min(low + 1, len(sorted_values) - 1)
    return sorted_values[low] + (sorted_values[high] - sorted_values[low]) * (pos - low)


@dataclass
class RunMetrics:
    policy: str
    requests: int
    completed: int
    lost: int  # routed but never answered: must be 0
    rejected: int  # larger than one replica's whole cache
    hit_rate: float
    oracle_hit_rate: float
    ttft_mean_s: float
    ttft_p50_s: float
    ttft_p90_s: float
    ttft_p99_s: float
    throughput_tok_s: float  # output tokens per second of virtual time
    requests_per_s: float
    load_imbalance: float  # max / mean per-replica busy time
    busy_share: float  # mean replica's busy time over the run (how near saturation)
    prefill_share: float  # mean replica's time spent prefilling over the run
    load_share: list[float]  # each replica's share of the requests served
    decision_us: float  # mean wall time of one routing decision
    wall_s: float  # wall time of the whole run
    cpu_s: float  # CPU time of the whole run (on a shared machine, what a quiet one would take)
    # inter-token latency: each answer's mean gap between tokens after its first
    itl_mean_s: float = math.nan  # over the answers of more than one token
    itl_p99_s: float = math.nan
    ttft_cdf: list[float] = field(default_factory=list, repr=False)  # 101 quantiles
    adapter_loads_per_min: float = math.nan  # LoRA adapters loaded, per virtual minute

    @property
    def oracle_ratio(self) -> float:
        return self.hit_rate / self.oracle_hit_rate if self.oracle_hit_rate else math.nan

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "oracle_ratio": self.oracle_ratio}


def summarize(policy: str, outcome: RunOutcome, block_size: int) -> RunMetrics:
    done = [r for r in outcome.requests if not math.isnan(r.finished_at)]
    routed = [r for r in outcome.requests if r.replica >= 0]
    prompt = sum(r.prompt_tokens for r in done)
    ttfts = sorted(r.ttft for r in done)
    itls = sorted(
        (r.finished_at - r.first_token_at) / (r.output_tokens - 1)
        for r in done
        if r.output_tokens > 1
    )
    first = min((r.arrival for r in outcome.requests), default=0.0)
    span = max(outcome.end - first, 1e-9)
    busy = outcome.busy_s
    mean_busy = sum(busy) / len(busy) if busy else 0.0
    served = sum(outcome.served) or 1
    return RunMetrics(
        policy=policy,
        requests=len(outcome.requests),
        completed=len(done),
        lost=len(routed) - len(done),
        rejected=outcome.rejected,
        hit_rate=sum(r.cached_tokens for r in done) / prompt if prompt else 0.0,
        oracle_hit_rate=oracle_hit_rate(routed, block_size),
        ttft_mean_s=sum(ttfts) / len(ttfts) if ttfts else math.nan,
        ttft_p50_s=percentile(ttfts, 0.5),
        ttft_p90_s=percentile(ttfts, 0.9),
        ttft_p99_s=percentile(ttfts, 0.99),
        throughput_tok_s=sum(r.output_tokens for r in done) / span,
        requests_per_s=len(done) / span,
        load_imbalance=max(busy) / mean_busy if mean_busy else math.nan,
        busy_share=mean_busy / span,
        prefill_share=sum(outcome.prefill_s) / max(len(busy), 1) / span,
        load_share=[s / served for s in outcome.served],
        decision_us=outcome.decide_s / max(len(routed), 1) * 1e6,
        wall_s=outcome.wall_s,
        cpu_s=outcome.cpu_s,
        itl_mean_s=sum(itls) / len(itls) if itls else math.nan,
        itl_p99_s=percentile(itls, 0.99),
        ttft_cdf=[percentile(ttfts, q / 100) for q in range(101)],
        adapter_loads_per_min=(
            math.nan if outcome.adapter_loads is None else outcome.adapter_loads / span * 60
        ),
    )
