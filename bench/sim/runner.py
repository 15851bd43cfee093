"""Runs scenarios and checks the goals the reports must show.

Each contender replays the same stream (open-loop workloads are regenerated from the
same seed; chat sessions follow the same turns, timed by their own answers) on a fresh
fleet. Goals are checked from the figures of one run, side by side, and reported met or
missed plainly; a goal whose contenders were not run is reported as not checked.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from bench.sim.contenders import DEFAULT, PEER_MODELS, router_factory
from bench.sim.lora import AdapterTraffic, LoraSimulation, is_lora
from bench.sim.metrics import RunMetrics, summarize
from bench.sim.pd import PdSimulation, is_pd
from bench.sim.scenarios import Inputs, Scenario
from bench.sim.simulator import SimConfig, Simulation


@dataclass
class GoalCheck:
    goal: str
    met: bool | None  # None: the contenders it compares were not run
    detail: str

    @property
    def verdict(self) -> str:
        return {True: "met", False: "MISSED", None: "not checked"}[self.met]


@dataclass
class ScenarioResult:
    name: str
    regime: str
    replicas: int
    router_instances: int
    residency_delay_s: float
    load_period_s: float
    runs: list[RunMetrics] = field(default_factory=list)
    goals: list[GoalCheck] = field(default_factory=list)
    skipped: str = ""
    slowdown: tuple[tuple[int, float], ...] = ()  # replica ordinal -> times slower

    def run(self, policy: str) -> RunMetrics | None:
        return next((r for r in self.runs if r.policy == policy), None)

    def to_dict(self) -> dict[str, Any]:
        return {
            "scenario": self.name,
            "regime": self.regime,
            "replicas": self.replicas,
            "router_instances": self.router_instances,
            "residency_delay_s": self.residency_delay_s,
            "load_period_s": self.load_period_s,
            "slowdown": [list(pair) for pair in self.slowdown],
            "skipped": self.skipped,
            "runs": [r.to_dict() for r in self.runs],
            "goals": [
                {"goal": g.goal, "verdict": g.verdict, "detail": g.detail} for g in self.goals
            ],
        }


def run_scenario(
    scenario: Scenario,
    inputs: Inputs,
    *,
    policies: Sequence[str] | None = None,
    overrides: dict[str, Any] | None = None,
    progress: Callable[[str], None] = lambda line: None,
) -> ScenarioResult:
    """Every contender of ``scenario`` (or ``policies``) on the same stream."""
    config: SimConfig = replace(scenario.config, **(overrides or {}))
    result = ScenarioResult(
        scenario.name,
        scenario.regime,
        config.replicas,
        config.router_instances,
        config.residency_delay_s,
        config.load_period_s,
        slowdown=config.slowdown,
    )
    if scenario.workload(inputs) is None:
        result.skipped = f"input file not found (--trace {inputs.trace})"
        progress(f"{scenario.name}: skipped, {result.skipped}")
        return result
    for spec in policies or scenario.policies:
        workload = scenario.workload(inputs)
        assert workload is not None
        if is_pd(spec):  # a prefill and a decode pool (bench/sim/pd.py)
            outcome = PdSimulation(config, workload, spec, inputs.seed).run()
        elif is_lora(spec):  # LoRA adapters in slots per replica (bench/sim/lora.py)
            assert isinstance(workload, AdapterTraffic)
            outcome = LoraSimulation(config, workload, spec, inputs.seed).run()
        else:
            factory = router_factory(
                spec, config.shape, seed=inputs.seed, load_period_s=config.load_period_s
            )
            outcome = Simulation(config, workload, factory).run()
        metrics = summarize(spec, outcome, config.shape.block_size)
        result.runs.append(metrics)
        progress(_progress_line(scenario.name, metrics))
    result.goals = check_goals(scenario, result)
    return result


def _progress_line(name: str, m: RunMetrics) -> str:
    return (
        f"{name:24s} {m.policy:34s} hit {m.hit_rate:6.1%} (oracle {m.oracle_hit_rate:6.1%})  "
        f"TTFT mean {m.ttft_mean_s:7.3f} s p99 {m.ttft_p99_s:7.3f} s  "
        f"imbalance {m.load_imbalance:5.2f}  lost {m.lost}  [{m.wall_s:.1f} s]"
    )


def best_kvroute(result: ScenarioResult) -> RunMetrics | None:
    """kvroute's strategy with the lowest mean TTFT in this scenario."""
    from bench.sim.routers import is_kvroute

    ours = [r for r in result.runs if is_kvroute(r.policy)]
    return min(ours, key=lambda r: r.ttft_mean_s, default=None)


def check_goals(scenario: Scenario, result: ScenarioResult) -> list[GoalCheck]:
    checks = [GOALS[goal](result) for goal in scenario.goals]
    if scenario.name != "speed":  # every scenario: the default is kvroute's best
        checks.append(_default_is_best(result))
    return [*checks, *invariants(result)]


def invariants(result: ScenarioResult) -> list[GoalCheck]:
    """What must hold in every run: nothing lost, nobody above the oracle."""
    lost = [f"{r.policy}: {r.lost}" for r in result.runs if r.lost]
    above = [
        f"{r.policy}: {r.hit_rate:.4f} > {r.oracle_hit_rate:.4f}"
        for r in result.runs
        if r.hit_rate > r.oracle_hit_rate + 1e-9
    ]
    return [
        GoalCheck("no lost requests", not lost, "; ".join(lost) or "every routed request answered"),
        GoalCheck(
            "oracle is an upper bound", not above, "; ".join(above) or "every hit rate <= oracle's"
        ),
    ]


def _hit_vs_oracle(result: ScenarioResult) -> GoalCheck:
    goal = f"{DEFAULT} hit rate >= 95% of the oracle's with load imbalance <= 1.25"
    kv = result.run(DEFAULT)
    if kv is None:
        return GoalCheck(goal, None, f"{DEFAULT} not run")
    met = kv.oracle_ratio >= 0.95 and kv.load_imbalance <= 1.25
    detail = f"{kv.oracle_ratio:.1%} of the oracle, imbalance {kv.load_imbalance:.2f}"
    return GoalCheck(goal, met, detail)


def _ahead_of_sglang(result: ScenarioResult) -> GoalCheck:
    goal = f"{DEFAULT} ahead of the modelled SGLang cache_aware on TTFT (mean)"
    kv, sg = result.run(DEFAULT), result.run("sglang:cache_aware")
    if kv is None or sg is None:
        return GoalCheck(goal, None, f"{DEFAULT} or sglang:cache_aware not run")
    detail = f"{kv.ttft_mean_s:.3f} s vs {sg.ttft_mean_s:.3f} s"
    return GoalCheck(goal, kv.ttft_mean_s < sg.ttft_mean_s, detail)


def _kv_beats_rr(result: ScenarioResult) -> GoalCheck:
    goal = f"{DEFAULT} beats round_robin on hit rate and mean TTFT"
    return _beats(goal, result.run(DEFAULT), result.run("round_robin"))


def _default_is_best(result: ScenarioResult) -> GoalCheck:
    goal = f"{DEFAULT} (the default) within 3% of the best kvroute strategy's mean TTFT"
    kv, best = result.run(DEFAULT), best_kvroute(result)
    if kv is None or best is None:
        return GoalCheck(goal, None, f"{DEFAULT} not run")
    ratio = kv.ttft_mean_s / best.ttft_mean_s if best.ttft_mean_s else 1.0
    detail = f"{kv.ttft_mean_s:.3f} s = {ratio:.3f}x {best.policy}'s {best.ttft_mean_s:.3f} s"
    return GoalCheck(goal, ratio <= 1.03, detail)


def best_peer(result: ScenarioResult) -> RunMetrics | None:
    """The modelled peer router (not random) with the lowest mean TTFT in this scenario."""
    peers = [r for r in result.runs if r.policy in PEER_MODELS]
    return min(peers, key=lambda r: r.ttft_mean_s, default=None)


def _ahead_of_peers(result: ScenarioResult) -> GoalCheck:
    goal = f"{DEFAULT} mean TTFT >= 20% below the best peer model's, p99 no worse"
    kv, peer = result.run(DEFAULT), best_peer(result)
    if kv is None or peer is None:
        return GoalCheck(goal, None, f"{DEFAULT} or the peer models not run")
    ratio = kv.ttft_mean_s / peer.ttft_mean_s if peer.ttft_mean_s else 1.0
    met = ratio <= 0.8 and kv.ttft_p99_s <= peer.ttft_p99_s
    detail = (
        f"mean {kv.ttft_mean_s:.3f} s = {ratio:.3f}x {peer.policy}'s {peer.ttft_mean_s:.3f} s; "
        f"p99 {kv.ttft_p99_s:.3f} s vs {peer.ttft_p99_s:.3f} s"
    )
    return GoalCheck(goal, met, detail)


def _mooncake_ttft(result: ScenarioResult) -> GoalCheck:
    goal = "best kvroute mean TTFT <= 1/6 of random's and <= 0.6x least_load's"
    best, rnd, ll = best_kvroute(result), result.run("random"), result.run("least_load")
    if best is None or rnd is None or ll is None:
        return GoalCheck(goal, None, "kvroute strategies, random or least_load not run")
    met = best.ttft_mean_s <= rnd.ttft_mean_s / 6 and best.ttft_mean_s <= 0.6 * ll.ttft_mean_s
    detail = (
        f"{best.policy} {best.ttft_mean_s:.3f} s = {best.ttft_mean_s / rnd.ttft_mean_s:.3f}x "
        f"random ({rnd.ttft_mean_s:.3f} s), {best.ttft_mean_s / ll.ttft_mean_s:.3f}x "
        f"least_load ({ll.ttft_mean_s:.3f} s)"
    )
    return GoalCheck(goal, met, detail)


def _no_reuse(result: ScenarioResult) -> GoalCheck:
    goal = f"{DEFAULT} within 5% of round_robin's mean TTFT and throughput"
    kv, rr = result.run(DEFAULT), result.run("round_robin")
    if kv is None or rr is None:
        return GoalCheck(goal, None, f"{DEFAULT} or round_robin not run")
    ttft = kv.ttft_mean_s / rr.ttft_mean_s if rr.ttft_mean_s else math.inf
    thr = kv.throughput_tok_s / rr.throughput_tok_s if rr.throughput_tok_s else 0.0
    met = ttft <= 1.05 and thr >= 0.95
    return GoalCheck(goal, met, f"TTFT {ttft:.3f}x, throughput {thr:.3f}x round_robin's")


def _speed(result: ScenarioResult) -> GoalCheck:
    goal = "a 64-replica, 100,000-request run in under 60 s of wall time"
    run = result.runs[0] if result.runs else None
    if run is None:
        return GoalCheck(goal, None, "not run")
    detail = (
        f"{run.requests:,} requests, {result.replicas} replicas: {run.wall_s:.1f} s "
        f"({run.decision_us:.0f} us of it per routing decision; {run.cpu_s:.1f} s of CPU, "
        f"load average {os.getloadavg()[0]:.1f})"
    )
    return GoalCheck(goal, run.requests >= 100_000 and run.wall_s < 60, detail)


def _pd_beats_rr(result: ScenarioResult) -> GoalCheck:
    goal = "P/D: kvroute's pairs (pd:kv_cost) beat round-robin prefill on hit rate and mean TTFT"
    return _beats(goal, result.run("pd:kv_cost"), result.run("pd:round_robin"))


def _pd_ahead_of_smg(result: ScenarioResult) -> GoalCheck:
    goal = "P/D: kvroute's pairs (pd:kv_cost) beat smg's PD router model on mean TTFT"
    ours, smg = result.run("pd:kv_cost"), result.run("smg-pd:cache_aware")
    if ours is None or smg is None:
        return GoalCheck(goal, None, "pd:kv_cost or smg-pd:cache_aware not run")
    detail = (
        f"TTFT {ours.ttft_mean_s:.3f} s vs {smg.ttft_mean_s:.3f} s; "
        f"hit {ours.hit_rate:.1%} vs {smg.hit_rate:.1%}"
    )
    return GoalCheck(goal, ours.ttft_mean_s < smg.ttft_mean_s, detail)


def _beats(goal: str, ours: RunMetrics | None, theirs: RunMetrics | None) -> GoalCheck:
    if ours is None or theirs is None:
        return GoalCheck(goal, None, "a contender it compares was not run")
    met = ours.hit_rate > theirs.hit_rate and ours.ttft_mean_s < theirs.ttft_mean_s
    detail = (
        f"hit {ours.hit_rate:.1%} vs {theirs.hit_rate:.1%}; "
        f"TTFT {ours.ttft_mean_s:.3f} s vs {theirs.ttft_mean_s:.3f} s"
    )
    return GoalCheck(goal, met, detail)


def _lora_beats(result: ScenarioResult) -> GoalCheck:
    goal = (
        "adapters: kvroute (lora:kv_cost) has a hit rate at least round-robin's and loading "
        "on every miss's, a lower mean TTFT and fewer adapter loads"
    )
    ours, rr, miss = (result.run(p) for p in ("lora:kv_cost", "lora-miss:round_robin",
                                              "lora-miss:kv_cost"))  # fmt: skip
    if ours is None or rr is None or miss is None:
        return GoalCheck(goal, None, "a contender it compares was not run")
    met = all(
        ours.hit_rate >= other.hit_rate
        and ours.ttft_mean_s < other.ttft_mean_s
        and ours.adapter_loads_per_min < other.adapter_loads_per_min
        for other in (rr, miss)
    )
    detail = "; ".join(
        f"{r.policy}: hit {r.hit_rate:.1%}, TTFT {r.ttft_mean_s:.3f} s, "
        f"{r.adapter_loads_per_min:.1f} loads/min"
        for r in (ours, rr, miss)
    )
    return GoalCheck(goal, met, detail)


def _slow_share(result: ScenarioResult) -> GoalCheck:
    goal = (
        f"{DEFAULT} sends the slowed replicas at most 2x their share of the fleet's speed, "
        "and beats round_robin on mean TTFT"
    )
    kv, rr = result.run(DEFAULT), result.run("round_robin")
    if kv is None or rr is None or not result.slowdown:
        return GoalCheck(goal, None, f"{DEFAULT} or round_robin not run, or no replica slowed")
    slowed = {i: factor for i, factor in result.slowdown if i < result.replicas}
    speed = [1 / slowed.get(i, 1.0) for i in range(result.replicas)]
    fair = sum(speed[i] for i in slowed) / sum(speed)
    share = sum(kv.load_share[i] for i in slowed)
    rr_share = sum(rr.load_share[i] for i in slowed)
    met = share <= 2 * fair and kv.ttft_mean_s < rr.ttft_mean_s
    detail = (
        f"{share:.1%} of the requests against a fair {fair:.1%} (round_robin {rr_share:.1%}); "
        f"TTFT {kv.ttft_mean_s:.3f} s vs {rr.ttft_mean_s:.3f} s"
    )
    return GoalCheck(goal, met, detail)


GOALS: dict[str, Callable[[ScenarioResult], GoalCheck]] = {
    "lora_beats": _lora_beats,
    "slow_share": _slow_share,
    "pd_beats_rr": _pd_beats_rr,
    "pd_ahead_of_smg": _pd_ahead_of_smg,
    "hit_vs_oracle": _hit_vs_oracle,
    "ahead_of_sglang": _ahead_of_sglang,
    "kv_beats_rr": _kv_beats_rr,
    "mooncake_ttft": _mooncake_ttft,
    "no_reuse": _no_reuse,
    "default_is_best": _default_is_best,
    "ahead_of_peers": _ahead_of_peers,
    "speed": _speed,
}
