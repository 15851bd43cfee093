"""The many-proxies curve's report: what adding routers behind one balancer costs.

For each workload and each router kind, every router count's engine hit rate (the
engines' own counters), its ratio to the same router alone, the client's TTFT p50 and
p90, and the requests each engine finished. Two targets (issue #39) are checked at the
largest count: a hit rate at least 98% of one router's, and no engine serving more than
1.25x the mean share (a replica left idle or overloaded while the routers agree on
nothing shows there, whatever the hit rate).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.e2e.harness import CHAT, SHARED, ContenderResult, E2EConfig

HIT_TARGET = 0.98  # of one router's hit rate, at the largest router count
SHARE_TARGET = 1.25  # the busiest engine's requests over the mean


@dataclass(frozen=True)
class Point:
    result: ContenderResult

    @property
    def series(self) -> str:
        """The router kind: a count's rows of one series are compared with its first."""
        c = self.result.contender
        mesh = "" if c.router == "kvroute" else (" (mesh)" if c.mesh else " (no mesh)")
        return f"{c.router} {c.policy}{mesh}"

    @property
    def spread(self) -> float:
        """The busiest engine's share over the mean share (1.0: perfectly even)."""
        served = self.result.served
        mean = sum(served) / len(served) if served else 0
        return max(served) / mean if mean else float("inf")


def series(results: list[ContenderResult], workload: str) -> dict[str, list[Point]]:
    """Each router kind's points on ``workload`` by router count; a router alone opens
    every series of its router and policy (smg alone has no mesh to turn on)."""
    points = [Point(r) for r in results if r.contender.workload == workload and r.phase]
    found: dict[str, list[Point]] = {}
    for point in sorted(points, key=lambda p: p.result.contender.instances):
        c = point.result.contender
        if c.instances == 1 and c.router != "kvroute":
            for name in (f"{c.router} {c.policy} (mesh)", f"{c.router} {c.policy} (no mesh)"):
                found.setdefault(name, []).append(point)
        else:
            found.setdefault(point.series, []).append(point)
    return found


def hit_ratio(points: list[Point], point: Point) -> float:
    """``point``'s hit rate over its series' one-router hit rate."""
    one = points[0].result.phase
    assert one is not None and point.result.phase is not None
    if points[0].result.contender.instances != 1 or not one.engine_hit_rate:
        return float("nan")
    return point.result.phase.engine_hit_rate / one.engine_hit_rate


def goals(points: list[Point]) -> tuple[bool, bool]:
    """Whether the largest count keeps the hit rate and spreads the requests."""
    last = points[-1]
    return hit_ratio(points, last) >= HIT_TARGET, last.spread <= SHARE_TARGET


def markdown(config: E2EConfig, results: list[ContenderResult], load: str) -> str:
    chat, shared = config.chat, config.workload
    lines = [
        "# kvroute bench e2e --proxies",
        "",
        f"{config.replicas} kvroute-sim replicas ({config.num_blocks} KV blocks of 16 "
        f"tokens each, time scale {config.time_scale}); 1 to {max(config.proxies)} routers "
        "of each kind behind one round-robin L4 balancer (a Kubernetes Service's stand-in; "
        "a keep-alive connection stays on one router). Hit rate from the engines' "
        "counters; TTFT from the client's clock; requests per engine from the engines' "
        f"own counters. {load}",
        "",
        f"- **chat**: {chat.conversations} conversations x {chat.turns} turns, "
        f"{chat.concurrency} under way at once, each turn sent when the last answered; "
        f"a shared system prompt of ~{chat.system_tokens} tokens, a first message of "
        f"~{chat.opening_tokens}, follow-ups of ~{chat.followup_tokens}, "
        f"{chat.max_tokens} output tokens.",
        f"- **shared-prefix**: {shared.groups} groups x {shared.prompts_per_group} prompts "
        f"(system prompt ~{shared.system_tokens} tokens), {shared.concurrency} clients, "
        "as in the main report.",
        "",
        f"Targets at {max(config.proxies)} routers: hit rate >= {HIT_TARGET:.0%} of one "
        f"router's; the busiest engine's requests <= {SHARE_TARGET}x the mean.",
    ]
    for workload in (CHAT, SHARED):
        lines += ["", f"## {workload}", "", *_table(series(results, workload))]
    lines += ["", *_unavailable(results)]
    return "\n".join(lines).rstrip() + "\n"


def _table(found: dict[str, list[Point]]) -> list[str]:
    lines = [
        "| router | routers | engine hit rate | vs one | TTFT p50 | TTFT p90 "
        "| requests per engine | busiest / mean | lost |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    verdicts = []
    for name, points in found.items():
        for point in points:
            phase = point.result.phase
            assert phase is not None
            served = "/".join(str(n) for n in point.result.served)
            lines.append(
                f"| {name} | {point.result.contender.instances} | {phase.engine_hit_rate:.1%} "
                f"| {hit_ratio(points, point):.1%} | {phase.ttft(0.5) * 1e3:.0f} ms "
                f"| {phase.ttft(0.9) * 1e3:.0f} ms | {served} | {point.spread:.2f}x "
                f"| {phase.errors} |"
            )
        if len(points) > 1:
            hit_met, share_met = goals(points)
            verdicts.append(
                f"- {name} at {points[-1].result.contender.instances} routers: hit rate "
                f"{_verdict(hit_met)}, requests spread {_verdict(share_met)}"
            )
    return [*lines, "", *verdicts]


def _verdict(met: bool) -> str:
    return "met" if met else "**MISSED**"


def _unavailable(results: list[ContenderResult]) -> list[str]:
    return [f"- {r.name} ({r.contender.workload}): not run: {r.unavailable}"
            for r in results if r.phase is None]  # fmt: skip


def rows(results: list[ContenderResult]) -> list[dict[str, Any]]:
    found = []
    for workload in (CHAT, SHARED):
        for name, points in series(results, workload).items():
            for point in points:
                phase, c = point.result.phase, point.result.contender
                assert phase is not None
                found.append({
                    "workload": workload, "series": name, "routers": c.instances,
                    **phase.summary(), "hit_vs_one": round(hit_ratio(points, point), 4),
                    "served_per_engine": point.result.served,
                    "busiest_over_mean": round(point.spread, 3),
                })  # fmt: skip
    return found


def write(config: E2EConfig, results: list[ContenderResult], out_dir: Path, load: str) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    payload = {
        "config": {"replicas": config.replicas, "num_blocks": config.num_blocks,
                   "proxies": list(config.proxies), "chat": vars(config.chat),
                   "shared_prefix": vars(config.workload)},
        "load": load,
        "results": rows(results),
        "not_run": {r.name: r.unavailable for r in results if r.phase is None},
    }  # fmt: skip
    (out_dir / "proxies.json").write_text(json.dumps(payload, indent=2) + "\n")
    (out_dir / "proxies.md").write_text(markdown(config, results, load))
