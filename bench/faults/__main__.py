"""``python -m bench.faults [nats hung slow]`` (``kvroute bench faults``): faults of the fleet
under steady load on ``kvroute up``'s fleet, each run's figures beside issue 46's
targets. ``nats``: ``nats-server`` killed -9 for each ``--outages`` length (0 failed
requests, no replica down; a new prefix routed by its KV events within 2 s of NATS's
return). ``nats-cp``: the control plane's own link to NATS cut (silent, as a partition)
for each ``--cuts`` length while the sidecars keep theirs; the same targets. ``hung``:
one engine SIGSTOPped for each ``--stops`` length, under streamed then whole
(non-streamed) requests (0 failed; nothing started 2 s after the stop takes over 3 s; the
engine serves again within 2 s of SIGCONT). ``hung-pd`` (not run unless named): the same
on ``kvroute up --pd 2:2``'s fleet, a prefill then a decode engine stopped, over each of
``--protocols`` (the same targets; "again" is the proxy holding no replica out).
``slow`` (not run unless named): one engine ``--slowdown`` times slower than its peers
(0 failed; its share of the requests proportional to its speed, at most twice that).
Loopback only; every run stops by itself.

Options: ``--outages 5,10,30,120``, ``--cuts 5,10,30`` and ``--stops 10`` (seconds),
``--answers streamed,whole`` (the hung faults' loads), ``--protocols vllm,sglang`` and
``--halves prefill,decode`` (hung-pd's), ``--rate 10`` (requests/s, open loop),
``--slowdown 10``, ``--replicas 3``, ``--out DIR`` (a JSON of each fault's runs). Exit
status 1 when a target is missed.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import sys
import tempfile
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

from bench.faults.hung_engine import BACK_TARGET_S, HungConfig, HungResult, run_hung
from bench.faults.hung_pd import PdHungConfig, PdHungResult, run_hung_pd
from bench.faults.nats_outage import EVENTS_BACK_TARGET_S, OutageConfig, OutageResult, run_outage
from bench.faults.slow_replica import TOLERANCE, SlowConfig, SlowResult, run_slow

T = TypeVar("T")


def _seconds(value: float | None) -> str:
    return "never" if value is None else f"{value:.2f} s"


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1e3:.0f} ms"


def nats_row(r: OutageResult) -> str:
    what = "NATS down" if r.cut == "server" else "control plane cut from NATS"
    return (
        f"{what} {r.outage_s:>5.0f} s   failed {r.failed:>4} / {r.sent:<5} (target 0)   "
        f"replicas stale {r.stale_seen}, down {r.down_seen} (target 0)   "
        f"routed by events again {_seconds(r.events_back_s):>7} after its return "
        f"(target <= {EVENTS_BACK_TARGET_S:.0f} s)   TTFT p99 while down "
        f"{_ms(r.ttft_p99_during_s):>7}   {'ok' if r.met else 'MISSED'}"
    )


def hung_row(r: HungResult, again: str = "serving") -> str:
    answers = "streamed" if r.stream else "whole   "
    return (
        f"engine stopped {r.stop_s:>4.0f} s, {answers}   "
        f"failed {r.failed:>4} / {r.sent:<5} (target 0)   "
        f"over 3 s among the {r.settled} started 2 s after the stop: {r.slow_after_settled} "
        f"(target 0)   {again} again {_seconds(r.back_s):>7} after SIGCONT "
        f"(target <= {BACK_TARGET_S:.0f} s)   TTFT p99 while stopped "
        f"{_ms(r.ttft_p99_during_s):>7}   {'ok' if r.met else 'MISSED'}"
    )


def hung_pd_row(r: PdHungResult) -> str:
    return f"P/D {r.protocol:<6} {r.half:<7} " + hung_row(r, "routable")


def slow_row(r: SlowResult) -> str:
    shares = "  ".join(f"{k} {v}" for k, v in sorted(r.by_replica.items()))
    share = "-" if r.slow_share is None else f"{r.slow_share:.1%}"
    return (
        f"one engine {r.slowdown:.0f}x slower   failed {r.failed:>4} / {r.sent:<5} (target 0)   "
        f"its share {share} (proportional {r.proportional:.1%}, target <= {TOLERANCE:.0f}x)   "
        f"answers {shares}   TTFT p99 {_ms(r.ttft_p99_s)}   {'ok' if r.met else 'MISSED'}"
    )


def _in_a_run_dir(run: Callable[[Path], Awaitable[T]]) -> T:
    with tempfile.TemporaryDirectory(prefix="kvroute-faults-") as run_dir:
        return asyncio.run(_awaited(run(Path(run_dir))))


async def _awaited(work: Awaitable[T]) -> T:
    return await work


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.faults")
    parser.add_argument(
        "faults",
        nargs="*",
        default=["nats", "nats-cp", "hung"],
        help="nats, nats-cp, hung, hung-pd, slow",
    )
    parser.add_argument("--outages", default="5,10,30,120")
    parser.add_argument("--cuts", default="5,10,30")
    parser.add_argument("--stops", default="10")
    parser.add_argument("--answers", default="streamed,whole")
    parser.add_argument("--protocols", default="vllm,sglang")
    parser.add_argument("--halves", default="prefill,decode")
    parser.add_argument("--slowdown", type=float, default=10.0)
    parser.add_argument("--rate", type=float, default=10.0)
    parser.add_argument("--replicas", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    unknown = set(args.faults) - {"nats", "nats-cp", "hung", "hung-pd", "slow"}
    if unknown:
        parser.error(
            f"unknown fault(s) {sorted(unknown)}; choose from nats, nats-cp, hung, hung-pd, slow"
        )
    answers = args.answers.split(",")
    if set(answers) - {"streamed", "whole"}:
        parser.error(f"--answers {args.answers!r}: choose from streamed, whole")
    met = True
    report: dict[str, Any] = {"rate": args.rate, "replicas": args.replicas}
    for fault, cut, lengths, key in (
        ("nats", "server", args.outages, "nats_outage"),
        ("nats-cp", "controlplane", args.cuts, "controlplane_cut_from_nats"),
    ):
        if fault not in args.faults:
            continue
        runs: list[dict[str, Any]] = []
        for outage_s in (float(s) for s in lengths.split(",")):
            config = OutageConfig(
                outage_s=outage_s, rate=args.rate, replicas=args.replicas, cut=cut
            )
            result = _in_a_run_dir(functools.partial(run_outage, config))
            print(nats_row(result), flush=True)
            runs.append(result.summary())
            met = met and result.met
        report[key] = runs
    loads = [(float(s), a == "streamed") for s in args.stops.split(",") for a in answers]
    if "hung" in args.faults:
        runs = []
        for stop_s, stream in loads:
            hung = HungConfig(stop_s=stop_s, rate=args.rate, replicas=args.replicas, stream=stream)
            result_h = _in_a_run_dir(functools.partial(run_hung, hung))
            print(hung_row(result_h), flush=True)
            runs.append(result_h.summary())
            met = met and result_h.met
        report["hung_engine"] = runs
    if "hung-pd" in args.faults:
        runs = []
        for protocol in args.protocols.split(","):
            for half in args.halves.split(","):
                for stop_s, stream in loads:
                    pd = PdHungConfig(
                        stop_s=stop_s, rate=args.rate, stream=stream, half=half, protocol=protocol
                    )
                    result_pd = _in_a_run_dir(functools.partial(run_hung_pd, pd))
                    print(hung_pd_row(result_pd), flush=True)
                    runs.append(result_pd.summary())
                    met = met and result_pd.met
        report["hung_pd_engine"] = runs
    if "slow" in args.faults:
        slow = SlowConfig(slowdown=args.slowdown, rate=args.rate, replicas=args.replicas)
        result_s = _in_a_run_dir(functools.partial(run_slow, slow))
        print(slow_row(result_s), flush=True)
        report["slow_replica"] = result_s.summary()
        met = met and result_s.met
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "faults.json").write_text(json.dumps(report, indent=2) + "\n")
    return 0 if met else 1


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
