"""``python -m bench.e2e [--quick] [--proxies 1,2,4,8] [--out DIR]``, also ``kvroute bench e2e``.

``--quick`` runs kvroute's own round_robin and kv_aware on a smaller workload, no peers
(what CI runs); the full run adds kvroute's other strategies, four proxies behind an L4
balancer, and the peer routers. ``--proxies`` runs the many-proxies curve instead
(``proxies.md``): that many kvroute proxies, and smg instances with and without their
mesh, behind the balancer, on a multi-turn chat workload and the shared-prefix one.
``--pd`` runs disaggregated prefill/decode instead (:mod:`bench.pd`: kvroute beside
smg's and vllm-router's P/D modes, on vLLM and SGLang sims).
Exit status 1 when a request was lost.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import tempfile
from collections.abc import Sequence
from pathlib import Path

from rich.console import Console
from rich.markdown import Markdown

from bench.e2e import curve, report
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
    parser.add_argument("--proxies", type=_counts, default=(),
                        help="the many-proxies curve at these router counts: 1,2,4,8")  # fmt: skip
    parser.add_argument("--pd", action="store_true",
                        help="P/D instead: kvroute beside the peers' P/D modes, both "
                        "protocols (bench.pd)")  # fmt: skip
    parser.add_argument("--out", type=Path, default=Path("bench-results/e2e"))
    return parser


def _counts(text: str) -> tuple[int, ...]:
    try:
        counts = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a list of counts: {text!r}") from None
    if not counts or min(counts) < 1:
        raise argparse.ArgumentTypeError(f"router counts must be >= 1: {text!r}")
    return tuple(sorted(set(counts)))


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
    if args.pd:
        from bench import pd  # only this mode needs it

        return pd.e2e(args.out)
    config = QUICK if args.quick else E2EConfig()
    if args.no_peers:
        config = dataclasses.replace(config, peers=())
    if args.proxies:
        config = dataclasses.replace(config, proxies=args.proxies)
    console = Console()
    load = _load_average()
    results = asyncio.run(run(config, console))
    if config.proxies:
        curve.write(config, results, args.out, f"{load}; after the run {_load_average()}.")
        shown = args.out / "proxies.md"
    else:
        report.write(config, results, args.out)
        shown = args.out / "e2e.md"
    console.print(Markdown(shown.read_text()))
    console.print(f"report written to {args.out}")
    lost = [
        r.name
        for r in results
        if r.phase
        and (r.phase.errors or len(r.phase.ttft_s) != config.expected_requests(r.contender))
    ]
    return 1 if lost else 0


def _load_average() -> str:
    """The machine's 1-minute load average, as a report states its conditions."""
    return f"load average {os.getloadavg()[0]:.2f} over {os.cpu_count()} CPUs"


if __name__ == "__main__":
    raise SystemExit(main())
