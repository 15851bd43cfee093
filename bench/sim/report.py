"""The simulator's reports: ``report.json`` for machines, ``report.md`` for people, PNG plots.

Plots (matplotlib, Agg backend, only when asked for): per scenario one PNG with the TTFT
CDF per policy, each policy's hit rate beside the oracle's, and each replica's share of
the requests; for the scale mode, decision time against fleet size and prompt length.
"""

from __future__ import annotations

import json
import math
import platform
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.sim.runner import ScenarioResult
from bench.sim.scale import ScaleResult


def environment() -> dict[str, Any]:
    """Where and when the figures were measured."""
    try:
        load = Path("/proc/loadavg").read_text().split()[:3]
    except OSError:
        load = []
    return {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "python": sys.version.split()[0],
        "machine": platform.machine(),
        "load_average": load,
    }


def write_json(
    path: Path, command: str, results: Sequence[ScenarioResult], scale: ScaleResult | None
) -> None:
    body = {
        "command": command,
        "environment": environment(),
        "scenarios": [r.to_dict() for r in results],
        "scale": scale.to_dict() if scale else None,
    }
    path.write_text(json.dumps(body, indent=1, default=_json_default) + "\n")


def _json_default(value: object) -> object:
    if isinstance(value, float) and math.isnan(value):
        return None
    raise TypeError(f"not JSON serialisable: {value!r}")


def _fmt(value: float, spec: str) -> str:
    return "-" if value is None or math.isnan(value) else format(value, spec)


def markdown(command: str, results: Sequence[ScenarioResult], scale: ScaleResult | None) -> str:
    env = environment()
    lines = [
        "# kvroute bench sim",
        "",
        f"`{command}` on {env['date']} (Python {env['python']}, load average "
        f"{' '.join(env['load_average']) or 'unknown'}).",
        "",
    ]
    for result in results:
        lines += _scenario_markdown(result)
    if scale is not None:
        lines += scale.markdown()
    return "\n".join(lines) + "\n"


def _scenario_markdown(result: ScenarioResult) -> list[str]:
    lines = [
        f"## {result.name}",
        "",
        f"{result.regime}. {result.replicas} replicas, {result.router_instances} router "
        f"instance(s), residency delay {result.residency_delay_s * 1e3:g} ms, load sampled "
        f"every {result.load_period_s * 1e3:g} ms."
        + "".join(
            f" Replica {ordinal} runs every step {factor:g}x slower."
            for ordinal, factor in result.slowdown
        ),
        "",
    ]
    if result.skipped:
        return [*lines, f"Skipped: {result.skipped}.", ""]
    lines += [
        "| policy | hit rate | / oracle | TTFT mean | p50 | p90 | p99 | ITL mean | output tok/s | "
        "imbalance | busy (prefill) | decision | lost |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result.runs:
        lines.append(
            f"| `{r.policy}` | {r.hit_rate:.1%} | {_fmt(r.oracle_ratio, '.1%')} | "
            f"{_fmt(r.ttft_mean_s, '.3f')} s | {_fmt(r.ttft_p50_s, '.3f')} s | "
            f"{_fmt(r.ttft_p90_s, '.3f')} s | {_fmt(r.ttft_p99_s, '.3f')} s | "
            f"{_fmt(r.itl_mean_s * 1e3, '.1f')} ms | {r.throughput_tok_s:,.0f} | "
            f"{_fmt(r.load_imbalance, '.2f')} | "
            f"{r.busy_share:.0%} ({r.prefill_share:.0%}) | {r.decision_us:.0f} us | {r.lost} |"
        )
    if result.runs:
        lines.append(
            f"| oracle (one unlimited cache) | {result.runs[0].oracle_hit_rate:.1%} | "
            "100% | | | | | | | | | | |"
        )
    loads = [r for r in result.runs if not math.isnan(r.adapter_loads_per_min)]
    if loads:  # the adapters scenarios (bench/sim/lora.py)
        shown = ", ".join(f"`{r.policy}` {r.adapter_loads_per_min:,.1f}" for r in loads)
        lines += ["", f"LoRA adapter loads per minute: {shown}."]
    lines += ["", *(f"- {g.verdict}: {g.goal} ({g.detail})" for g in result.goals), ""]
    return lines


def plot_scenario(result: ScenarioResult, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (cdf, hits, share) = plt.subplots(1, 3, figsize=(16, 4.5))
    for r in result.runs:
        cdf.plot(r.ttft_cdf, [q / 100 for q in range(101)], label=r.policy)
    cdf.set_xscale("log")
    cdf.set(title="TTFT CDF", xlabel="time to first token (s)", ylabel="fraction of requests")
    cdf.legend(fontsize=6)
    names = [r.policy for r in result.runs]
    hits.barh(names, [r.hit_rate for r in result.runs], color="tab:blue")
    if result.runs:
        hits.axvline(result.runs[0].oracle_hit_rate, color="k", linestyle="--", label="oracle")
    hits.set(title="prefix-cache hit rate vs the oracle", xlabel="hit rate")
    hits.tick_params(axis="y", labelsize=6)
    hits.legend(fontsize=7)
    for i, r in enumerate(result.runs):
        share.plot(range(len(r.load_share)), r.load_share, marker=".", label=r.policy, alpha=0.8)
        del i
    share.set(title="per-replica share of requests", xlabel="replica", ylabel="share")
    fig.suptitle(f"{result.name}: {result.replicas} replicas, {result.router_instances} router(s)")
    fig.tight_layout()
    fig.savefig(path, dpi=60)
    plt.close(fig)


def write_reports(
    out: Path,
    command: str,
    results: Sequence[ScenarioResult],
    scale: ScaleResult | None,
    *,
    plots: bool,
) -> list[Path]:
    """Write the report files into ``out``; returns their paths."""
    out.mkdir(parents=True, exist_ok=True)
    written = [out / "report.json", out / "report.md"]
    write_json(written[0], command, results, scale)
    written[1].write_text(markdown(command, results, scale))
    if plots:
        for result in results:
            if result.runs:
                png = out / f"{result.name}.png"
                plot_scenario(result, png)
                written.append(png)
        if scale is not None:
            png = out / "scale.png"
            scale.plot(png)
            written.append(png)
    return written
