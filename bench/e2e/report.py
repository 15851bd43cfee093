"""The end-to-end benchmark's report: JSON for machines, Markdown for people, PNG plots.

Each goal of the benchmark issue is checked here against the figures of one run and
printed beside its target, ``met`` or ``MISSED``; a goal whose contenders did not run
says so instead of passing silently.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.e2e import misses
from bench.e2e.harness import PINNED, ContenderResult, E2EConfig
from kvroute.demo import PhaseResult, plot_ttft

TRACED = "kvroute kv_aware"  # contenders whose every request goes to requests.jsonl


@dataclass(frozen=True)
class Goal:
    text: str
    measured: str
    met: bool | None  # None: a contender it needs did not run


def _phase(results: list[ContenderResult], name: str) -> PhaseResult | None:
    for result in results:
        if result.name == name and result.phase is not None:
            return result.phase
    return None


def _ratio_goal(
    results: list[ContenderResult],
    text: str,
    ours: str,
    theirs: str,
    figure: Callable[[PhaseResult], float],
    limit: float,
) -> Goal:
    a, b = _phase(results, ours), _phase(results, theirs)
    if a is None or b is None:
        return Goal(text, "not run", None)
    ratio = figure(a) / figure(b) if figure(b) else float("inf")
    return Goal(text, f"{ratio:.2f}x", ratio <= limit)


def goals(config: E2EConfig, results: list[ContenderResult]) -> list[Goal]:
    """The issue's end-to-end goals, each against this run's figures."""
    p50: Callable[[PhaseResult], float] = lambda r: r.ttft(0.5)  # noqa: E731
    found = [
        _ratio_goal(results, "kv_aware TTFT p50 <= 0.5x sglang-router cache_aware",
                    "kvroute kv_aware", "sglang-router cache_aware", p50, 0.5),
        _ratio_goal(results, "kv_aware TTFT p50 <= 0.25x round_robin",
                    "kvroute kv_aware", "kvroute round_robin", p50, 0.25),
    ]  # fmt: skip
    ours = _phase(results, "kvroute kv_aware")
    for peer in ("sglang-router cache_aware", "vllm-router cache_aware"):
        theirs = _phase(results, peer)
        text = f"kv_aware hit rate above {peer}'s"
        if ours is None or theirs is None:
            found.append(Goal(text, "not run", None))
            continue
        limit = misses.limit_hit_rate(ours.answers, config.workload.request_groups())
        measured = (
            f"{ours.engine_hit_rate:.1%} vs {theirs.engine_hit_rate:.1%} (the limit, only "
            f"each group's first request missing: {limit:.1%})"
        )
        found.append(Goal(text, measured, ours.engine_hit_rate > theirs.engine_hit_rate))
    scaled = next((r.phase for r in results if r.name.startswith("kvroute kv_aware x")), None)
    text = "kv_aware behind an L4 balancer: hit rate within 5% of one proxy's"
    if ours is None or scaled is None:
        found.append(Goal(text, "not run", None))
    else:
        drop = 1 - scaled.engine_hit_rate / ours.engine_hit_rate if ours.engine_hit_rate else 1
        change = "the same" if drop == 0 else f"{abs(drop):.1%} {'lower' if drop > 0 else 'higher'}"
        found.append(Goal(text, change, drop <= 0.05))
    return found


def row(config: E2EConfig, result: ContenderResult) -> dict[str, Any]:
    if result.phase is None:
        return {"contender": result.name, "unavailable": result.unavailable}
    found, _ = misses.classify(result.phase.answers, config.workload.request_groups())
    return {"contender": result.name, **result.phase.summary(), "misses": found.to_dict()}


def markdown(config: E2EConfig, results: list[ContenderResult], found: list[Goal]) -> str:
    w = config.workload
    lines = [
        "# kvroute bench e2e",
        "",
        f"{config.replicas} kvroute-sim replicas ({config.num_blocks} KV blocks of 16 tokens "
        f"each, time scale {config.time_scale}); shared-prefix chat: {w.groups} groups x "
        f"{w.prompts_per_group} prompts, system prompt ~{w.system_tokens} tokens, question "
        f"~{w.question_tokens}, {w.max_tokens} output tokens, {w.concurrency} concurrent "
        "clients. Regime: cache pressure (the groups' prefixes exceed one replica's cache, "
        "fit the fleet). Hit rate from the engines' counters; TTFT from the client's clock.",
        "",
        "| contender | engine hit rate | cached (responses) | TTFT p50 | TTFT p90 | req/s | lost |",
        "|---|---|---|---|---|---|---|",
    ]
    for result in results:
        if result.phase is None:
            lines.append(f"| {result.name} | not run: {result.unavailable} | | | | | |")
            continue
        s = result.phase.summary()
        lines.append(
            f"| {result.name} | {s['engine_hit_rate']:.1%} | {s['reported_cached_share']:.1%} "
            f"| {s['ttft_p50_s'] * 1e3:.0f} ms | {s['ttft_p90_s'] * 1e3:.0f} ms "
            f"| {s['requests_per_s']} | {s['errors']} |"
        )
    lines += ["", *_miss_table(config, results)]
    lines += ["", "| goal | measured | verdict |", "|---|---|---|"]
    for goal in found:
        verdict = "not run" if goal.met is None else ("met" if goal.met else "**MISSED**")
        lines.append(f"| {goal.text} | {goal.measured} | {verdict} |")
    lines += _floor(results)
    return "\n".join(lines) + "\n"


def _miss_table(config: E2EConfig, results: list[ContenderResult]) -> list[str]:
    """Misses by cause (see ``bench.e2e.misses``), for every contender that ran."""
    lines = [
        "Requests that missed their group's shared prefix, by cause (first: the group's "
        "first request, which every router misses; in flight: sent to a replica whose "
        "copies of the group had not answered yet; evicted: the replica had served the "
        "group before; elsewhere: sent away from the group's replicas; unknown: the router "
        "does not say where it sent it). Over-predicted: kvroute predicted the prefix "
        "cached and the engine had less.",
        "",
        "| contender | missed | first | in flight | evicted | elsewhere | unknown "
        "| prefix tokens lost beyond the first | over-predicted |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    groups = config.workload.request_groups()
    for result in results:
        if result.phase is None:
            continue
        m, _ = misses.classify(result.phase.answers, groups)
        lines.append(
            f"| {result.name} | {m.first + m.avoidable} | {m.first} | {m.in_flight} "
            f"| {m.evicted} | {m.elsewhere} | {m.unknown} | {m.lost_tokens} "
            f"| {m.over_predicted if result.contender.router == 'kvroute' else '-'} |"
        )
    return lines


def _floor(results: list[ContenderResult]) -> list[str]:
    """The pinned reference's TTFT beside SGLang's: how low a router's p50 can go."""
    pinned = next((r.phase for r in results if r.contender.router == PINNED and r.phase), None)
    sglang = _phase(results, "sglang-router cache_aware")
    if pinned is None or sglang is None:
        return []
    ratio = pinned.ttft(0.5) / sglang.ttft(0.5)
    return [
        "",
        f"The floor: with no router at all and each group pinned to one engine (an "
        f"oracle's placement), TTFT p50 is {pinned.ttft(0.5) * 1e3:.0f} ms, "
        f"{ratio:.2f}x sglang-router cache_aware's; a router can only add to it.",
    ]


def write(config: E2EConfig, results: list[ContenderResult], out_dir: Path) -> list[Goal]:
    out_dir.mkdir(parents=True, exist_ok=True)
    found = goals(config, results)
    payload = {
        "config": {"replicas": config.replicas, "num_blocks": config.num_blocks,
                   "time_scale": config.time_scale, "workload": vars(config.workload)},
        "results": [row(config, r) for r in results],
        "goals": [vars(g) for g in found],
    }  # fmt: skip
    (out_dir / "e2e.json").write_text(json.dumps(payload, indent=2) + "\n")
    (out_dir / "e2e.md").write_text(markdown(config, results, found))
    write_requests(config, results, out_dir / "requests.jsonl")
    phases = [r.phase for r in results if r.phase is not None]
    plot_ttft(phases, out_dir / "e2e_ttft_cdf.png", "kvroute bench e2e: TTFT per contender")
    plot_hit_rates(phases, out_dir / "e2e_hit_rate.png")
    return found


def write_requests(config: E2EConfig, results: list[ContenderResult], path: Path) -> None:
    """Every request of the kv_aware runs, one JSON line each, with its miss cause."""
    groups = config.workload.request_groups()
    lines = [
        json.dumps({"contender": r.name, **line}, separators=(",", ":"))
        for r in results
        if r.phase is not None and r.name.startswith(TRACED)
        for line in misses.records(r.phase.answers, groups)
    ]
    path.write_text("".join(f"{line}\n" for line in lines))


def plot_hit_rates(phases: list[PhaseResult], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    figure, axes = plt.subplots(figsize=(8, 4))
    names = [p.strategy for p in phases]
    axes.barh(names, [p.engine_hit_rate * 100 for p in phases])
    axes.set_xlabel("engine prefix-cache hit rate (%)")
    axes.set_xlim(0, 100)
    axes.invert_yaxis()
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
