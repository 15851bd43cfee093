"""``python -m bench.e2e [--quick] [--out DIR]``, also ``kvroute bench e2e``.

``--quick`` runs kvroute's own round_robin and kv_aware on a smaller workload, no peers
(what CI runs); the full run adds kvroute's other strategies, four proxies behind an L4
balancer, and the peer routers. Exit status 1 when a request was lost.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import tempfile
from collections.abc import Sequence
from pathlib import Path

from rich.console import Console
from rich.markdown import Markdown

from bench.e2e import report
from bench.e2e.harness import ContenderResult, E2EBench, E2EConfig
from kvroute.demo import DemoWorkload

QUICK = E2EConfig(
    replicas=2,
    num_blocks=640,
    workload=DemoWorkload(groups=8, prompts_per_group=8, concurrency=4),
    scaled_instances=1,
    kvroute_policies=("round_robin", "kv_aware"),
    peers=(),
    pinned_reference=False,
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvroute bench e2e", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="kvroute only, small (CI)")
    parser.add_argument("--no-peers", action="store_true", help="leave the peer routers out")
    parser.add_argument("--out", type=Path, default=Path("bench-results/e2e"))
    return parser


async def run(config: E2EConfig, console: Console) -> list[ContenderResult]:
    with tempfile.TemporaryDirectory(prefix="kvroute-bench-e2e-") as tmp:
        bench = E2EBench(config, Path(tmp), console)
        try:
            await bench.start()
            return await bench.run()
        finally:
            await bench.aclose()


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    config = QUICK if args.quick else E2EConfig()
    if args.no_peers:
        config = dataclasses.replace(config, peers=())
    console = Console()
    results = asyncio.run(run(config, console))
    report.write(config, results, args.out)
    console.print(Markdown((args.out / "e2e.md").read_text()))
    console.print(f"report written to {args.out}")
    expected = len(config.workload.requests("m"))
    lost = [
        r.name for r in results if r.phase and (r.phase.errors or len(r.phase.ttft_s) != expected)
    ]
    return 1 if lost else 0


if __name__ == "__main__":
    raise SystemExit(main())
