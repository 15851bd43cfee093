"""``python -m bench.sim`` (``kvroute bench sim``): the simulator's command line.

Runs the scenarios (all by default) with their contenders, prints one line per run,
writes ``report.json``, ``report.md`` and the PNG plots into ``--out``, and exits 1 when
something that must always hold does not (a lost request, a hit rate above the oracle's)
or, with ``--quick``, when the default (kv_cost) does not beat round_robin on the shared-prefix
workload. Goals that are missed are reported, not turned into an exit status: they are
findings to act on.
"""

from __future__ import annotations

import argparse
import shlex
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.sim import fleet_changes
from bench.sim import scale as scale_mode
from bench.sim.contenders import DEFAULT, KVROUTE, PEERS
from bench.sim.report import write_reports
from bench.sim.runner import ScenarioResult, run_scenario
from bench.sim.scenarios import DEFAULT_SHAREGPT, DEFAULT_TRACE, SCENARIOS, Inputs, quick


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvroute bench sim",
        description="Discrete-event simulation of kvroute's strategies, the peers' "
        "algorithms and the oracle on modelled engines, in virtual time.",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="small scenarios, kvroute's round_robin and kv_aware only (CI)",
    )
    parser.add_argument(
        "--scenario",
        action="append",
        choices=sorted(SCENARIOS),
        help="run only these scenarios (repeatable; default all)",
    )
    parser.add_argument(
        "--policy",
        action="append",
        metavar="SPEC",
        help="contenders (repeatable): a kvroute strategy with optional "
        f":field=value,... ({', '.join(KVROUTE)}) or one of {', '.join(PEERS)}",
    )
    parser.add_argument("--replicas", type=int, help="override every scenario's fleet size")
    parser.add_argument("--routers", type=int, help="router instances behind round-robin")
    parser.add_argument("--requests", type=int, help="request count where a scenario has one")
    parser.add_argument(
        "--residency-delay-ms", type=float, help="engine event -> router map delay (default 50)"
    )
    parser.add_argument(
        "--load-period-ms", type=float, help="engine load sample period (default 500)"
    )
    parser.add_argument(
        "--trace",
        type=Path,
        default=DEFAULT_TRACE,
        help="Mooncake hash-id trace (JSONL; not in the repository: "
        "FAST25-release/traces/conversation_trace.jsonl of github.com/kvcache-ai/Mooncake); "
        "its scenarios are skipped when absent",
    )
    parser.add_argument(
        "--compression",
        type=float,
        default=3.0,
        help="Mooncake trace time compression (arrival times divided by it; default 3)",
    )
    parser.add_argument(
        "--data",
        type=Path,
        default=DEFAULT_SHAREGPT,
        help="ShareGPT turn lengths (JSONL); synthetic when absent",
    )
    parser.add_argument(
        "--scale",
        action="store_true",
        help="also run the scale mode (decision time and map memory)",
    )
    parser.add_argument("--scale-only", action="store_true", help="run only the scale mode")
    parser.add_argument(
        "--fleet-changes",
        action="store_true",
        help="run the fleet-change scenarios instead (scale-out, rolling restart, drain; "
        "warm-up off / on / smg's warm-up share); then --scenario, --seeds and --out are "
        "theirs (see bench/sim/fleet_changes.py)",
    )
    parser.add_argument(
        "--out", type=Path, default=Path("bench/results/latest"), help="results folder"
    )
    parser.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    parser.add_argument("--seed", type=int, default=1)
    return parser


def _overrides(args: argparse.Namespace) -> dict[str, Any]:
    overrides: dict[str, Any] = {}
    if args.replicas:
        overrides["replicas"] = args.replicas
    if args.routers:
        overrides["router_instances"] = args.routers
    if args.residency_delay_ms is not None:
        overrides["residency_delay_s"] = args.residency_delay_ms / 1000
    if args.load_period_ms is not None:
        overrides["load_period_s"] = args.load_period_ms / 1000
    return overrides


def run(args: argparse.Namespace) -> list[ScenarioResult]:
    inputs = Inputs(
        quick=args.quick,
        trace=args.trace,
        data=args.data,
        requests=args.requests,
        seed=args.seed,
        compression=args.compression,
    )
    names = args.scenario or [name for name, s in SCENARIOS.items() if s.in_default_run]
    if args.quick and not args.scenario:
        names = ["shared_prefix", "no_reuse"]
    results = []
    for name in names:
        scenario = quick(SCENARIOS[name]) if args.quick else SCENARIOS[name]
        results.append(
            run_scenario(
                scenario,
                inputs,
                policies=args.policy,
                overrides=_overrides(args),
                progress=lambda line: print(line, flush=True),
            )
        )
    return results


def failures(results: Sequence[ScenarioResult], *, quick_mode: bool) -> list[str]:
    """What must hold and does not."""
    musts = {"no lost requests", "oracle is an upper bound"}
    if quick_mode:
        musts.add(f"{DEFAULT} beats round_robin on hit rate and mean TTFT")
    return [
        f"{r.name}: {g.goal}: {g.detail}"
        for r in results
        for g in r.goals
        if g.goal in musts and g.met is False
    ]


def main(argv: Sequence[str] | None = None) -> int:
    given = list(sys.argv[1:] if argv is None else argv)
    if "--fleet-changes" in given:  # its own scenarios and options
        given.remove("--fleet-changes")
        return fleet_changes.main(given)
    args = build_parser().parse_args(argv)
    command = "kvroute bench sim " + shlex.join(list(argv if argv is not None else sys.argv[1:]))
    started = time.perf_counter()
    try:
        results = [] if args.scale_only else run(args)
    except ValueError as exc:  # a bad policy spec or field
        print(f"kvroute bench sim: {exc}", file=sys.stderr)
        return 2
    scale = scale_mode.run(quick=args.quick) if args.scale or args.scale_only else None
    written = write_reports(args.out, command.strip(), results, scale, plots=not args.no_plots)
    for result in results:
        for goal in result.goals:
            print(f"{result.name}: {goal.verdict}: {goal.goal} ({goal.detail})")
    if scale is not None:
        for row in scale.goals:
            print(f"scale: {row['verdict']}: {row['goal']} ({row['detail']})")
    print(f"reports: {', '.join(str(p) for p in written)} [{time.perf_counter() - started:.1f} s]")
    broken = failures(results, quick_mode=args.quick)
    for line in broken:
        print(f"FAILED: {line}", file=sys.stderr)
    return 1 if broken else 0


if __name__ == "__main__":
    raise SystemExit(main())
