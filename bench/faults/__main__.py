"""``python -m bench.faults`` (``kvroute bench faults``): NATS killed -9 under steady load
for each outage length, each run's figures beside issue 46's targets (0 failed requests;
a new prefix routed by its KV events within 2 s of NATS's return). Loopback only; every
run stops by itself.

Options: ``--outages 5,10,30,120`` (seconds), ``--rate 10`` (requests/s, open loop),
``--replicas 3``, ``--out DIR`` (a JSON of the runs). Exit status 1 when a target is missed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
from pathlib import Path

from bench.faults.nats_outage import EVENTS_BACK_TARGET_S, OutageConfig, OutageResult, run_outage


def row(result: OutageResult) -> str:
    back = result.events_back_s
    p99 = result.ttft_p99_during_s
    return (
        f"NATS down {result.outage_s:>5.0f} s   failed {result.failed:>4} / {result.sent:<5} "
        f"(target 0)   routed by events again {'never' if back is None else f'{back:.2f} s':>7} "
        f"after its return (target <= {EVENTS_BACK_TARGET_S:.0f} s)   TTFT p99 while down "
        f"{'-' if p99 is None else f'{p99 * 1e3:.0f} ms':>7}   {'ok' if result.met else 'MISSED'}"
    )


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.faults")
    parser.add_argument("--outages", default="5,10,30,120")
    parser.add_argument("--rate", type=float, default=10.0)
    parser.add_argument("--replicas", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    results = []
    for outage_s in (float(s) for s in args.outages.split(",")):
        config = OutageConfig(outage_s=outage_s, rate=args.rate, replicas=args.replicas)
        with tempfile.TemporaryDirectory(prefix="kvroute-faults-") as run_dir:
            result = asyncio.run(run_outage(config, Path(run_dir)))
        print(row(result), flush=True)
        results.append(result)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        runs = {
            "rate": args.rate,
            "replicas": args.replicas,
            "runs": [r.summary() for r in results],
        }
        (args.out / "nats_outage.json").write_text(json.dumps(runs, indent=2) + "\n")
    return 0 if all(r.met for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
