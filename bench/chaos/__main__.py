"""``python -m bench.chaos`` (``kvroute bench chaos``): faults in turn under steady load on
``kvroute up``'s fleet (six engines, two proxies behind a balancer, HA control plane),
then a soak; each fault's figures beside its target (see ``run.py``, ``soak.py``).
Loopback only; every run stops by itself.

Options: ``--faults leader,nats,...`` (default: all; ``--list`` names them), ``--rate 10``
(requests/s), ``--replicas 6``, ``--hold 10`` and ``--partition 60`` (seconds),
``--soak 1200`` (seconds; 0: none), ``--soak-rate 7``, ``--out DIR`` (chaos.json,
chaos.md, plots). Exit status 1 when a target is missed.
"""

from __future__ import annotations

import argparse
import asyncio
import shlex
import sys
import tempfile
from pathlib import Path

from bench.chaos.faults import FAULTS
from bench.chaos.report import fault_row, markdown, write
from bench.chaos.run import ChaosConfig, SoakConfig, run_chaos


def _faults(text: str) -> tuple[str, ...]:
    names = tuple(n.strip() for n in text.split(",") if n.strip())
    unknown = [n for n in names if n not in FAULTS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"unknown fault(s) {unknown}; choose from {list(FAULTS)}")
    return names


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.chaos")
    parser.add_argument("--faults", type=_faults, default=tuple(FAULTS))
    parser.add_argument("--list", action="store_true", help="name the faults and stop")
    parser.add_argument("--rate", type=float, default=10.0)
    parser.add_argument("--replicas", type=int, default=6)
    parser.add_argument("--hold", type=float, default=10.0)
    parser.add_argument("--partition", type=float, default=60.0)
    parser.add_argument("--after", type=float, default=10.0)
    parser.add_argument("--soak", type=float, default=1200.0, help="seconds; 0: no soak")
    parser.add_argument("--soak-rate", type=float, default=7.0)
    parser.add_argument("--soak-warmup", type=float, default=60.0)
    parser.add_argument("--out", type=Path, default=None)
    return parser.parse_args(argv)


def main(argv: list[str]) -> int:
    args = parse(argv)
    if args.list:
        for name, (_, what) in FAULTS.items():
            print(f"{name:<18} {what}")
        return 0
    config = ChaosConfig(
        faults=args.faults,
        replicas=args.replicas,
        rate=args.rate,
        hold_s=args.hold,
        partition_s=args.partition,
        after_s=args.after,
    )
    soak = None
    if args.soak > 0:
        soak = SoakConfig(duration_s=args.soak, rate=args.soak_rate, warmup_s=args.soak_warmup)
    with tempfile.TemporaryDirectory(prefix="kvroute-chaos-") as run_dir:
        result = asyncio.run(run_chaos(config, Path(run_dir), soak))
    command = shlex.join(["python", "-m", "bench.chaos", *argv])
    for row in (fault_row(r) for r in result.faults):
        print(row, flush=True)
    if args.out is not None:
        write(args.out, config, result, command)
    else:
        print(markdown(config, result, command))
    met = all(all(r.met.values()) for r in result.faults)
    if result.soak is not None:
        met = met and all(result.soak.met.values())
    return 0 if met else 1


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
