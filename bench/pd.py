"""``kvroute bench pd``: disaggregated prefill/decode through real processes.

One ``kvroute up`` fleet of time-scaled ``kvroute-sim`` engines with ``--pd P:D`` roles
(their sidecars, NATS, etcd, the control plane, the proxy) serves the demo's grouped
workload (groups sharing a long system prompt) twice: with the prefill replica picked
by ``kv_cost`` (the default) and by ``round_robin``; the decode replica is the least
loaded in both. A colocated fleet of the same number of engines under ``kv_cost`` runs
the same requests beside them. Measured outside the router: the prefill engines' own
prefix-cache counters (hit rate on the prefill side; every engine's for the colocated
fleet), this client's TTFT and wall time, and failed requests.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import aiohttp

from kvroute.demo import AdminClient, DemoWorkload, EngineWatch, PhaseResult, run_phase
from kvroute.servers import free_port
from kvroute.up import SIM_MODEL, LocalFleet, UpOptions


async def measure(
    options: UpOptions, strategies: Sequence[str], workload: DemoWorkload
) -> list[dict[str, Any]]:
    """Each strategy's phase on one fleet started with ``options``, caches emptied between."""
    rows = []
    fleet = LocalFleet(options, say=lambda _: None)  # in a run folder of its own
    started = await fleet.start()
    try:
        timeout = aiohttp.ClientTimeout(total=600)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            admin = AdminClient(session, started.admin_urls[0], started.admin_token)
            watch = EngineWatch(session, started.engines)
            counted = started.engines[: options.pd[0]] if options.pd else started.engines
            for strategy in strategies:
                await admin.set_strategy(strategy)
                await watch.reset_caches()
                result = await _phase(
                    session, watch, started.proxy_urls[0], strategy, workload, counted
                )
                rows.append(_row(options, result))
    finally:
        await fleet.aclose()
    return rows


async def _phase(
    session: aiohttp.ClientSession,
    watch: EngineWatch,
    proxy: str,
    strategy: str,
    workload: DemoWorkload,
    counted: list[str],
) -> PhaseResult:
    result = PhaseResult(strategy)
    before = await watch.scrape()
    started = time.perf_counter()
    await run_phase(session, proxy, workload.requests(SIM_MODEL), result,
                    workload.concurrency, lambda: None)  # fmt: skip
    result.wall_s = time.perf_counter() - started
    after = await watch.scrape()
    for engine in counted:
        was, now = before[engine], after[engine]
        result.engine_queries += now.prefix_cache_queries - was.prefix_cache_queries
        result.engine_hits += now.prefix_cache_hits - was.prefix_cache_hits
    return result


def _row(options: UpOptions, result: PhaseResult) -> dict[str, Any]:
    pd = options.pd
    fleet = f"P/D {pd[0]}:{pd[1]}" if pd else f"colocated {options.replicas}"
    done = len(result.ttft_s)
    return {
        "fleet": fleet,
        "strategy": result.strategy,
        "requests": done,
        "errors": result.errors,
        "hit_rate": round(result.engine_hit_rate, 4),
        "ttft_mean_s": round(sum(result.ttft_s) / done, 4) if done else None,
        "ttft_p90_s": round(result.ttft(0.9), 4),
        "requests_per_s": round(done / result.wall_s, 2) if result.wall_s else None,
    }


def markdown(rows: list[dict[str, Any]], workload: DemoWorkload, args: argparse.Namespace) -> str:
    lines = [
        f"# P/D ({args.event_format}): {workload.groups} groups x {workload.prompts_per_group} "
        f"prompts, ~{workload.system_tokens}-token shared system prompts, concurrency "
        f"{workload.concurrency}, sims at --time-scale {args.time_scale}",
        "",
        "hit rate: the prefill engines' own prefix-cache hits / queries (every engine's, "
        "colocated)",
        "",
        "| fleet | prefill pick | requests | errors | hit rate | TTFT mean | TTFT p90 | req/s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['fleet']} | {r['strategy']} | {r['requests']} | {r['errors']} | "
            f"{r['hit_rate']:.1%} | {r['ttft_mean_s']} s | {r['ttft_p90_s']} s | "
            f"{r['requests_per_s']} |"
        )
    return "\n".join(lines) + "\n"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvroute bench pd", description=__doc__.splitlines()[0])
    parser.add_argument("--pd", default="2:2", help="prefill:decode sims (2:2)")
    parser.add_argument("--num-blocks", type=int, default=768, help="KV blocks per sim (768)")
    parser.add_argument("--time-scale", type=float, default=0.2, help="sim time scale (0.2)")
    parser.add_argument("--event-format", choices=("vllm", "sglang"), default="vllm",
                        help="the sims' engine: its P/D protocol too (vllm)")  # fmt: skip
    parser.add_argument("--groups", type=int, default=8)
    parser.add_argument("--prompts-per-group", type=int, default=8)
    parser.add_argument("--out", type=Path, help="write pd.json and pd.md here")
    return parser


async def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    prefill, decode = (int(n) for n in args.pd.split(":"))
    workload = DemoWorkload(groups=args.groups, prompts_per_group=args.prompts_per_group)
    common = {"num_blocks": args.num_blocks, "time_scale": args.time_scale,
              "tokenizer": "builtin", "debug_headers": False,
              "event_format": args.event_format}  # fmt: skip
    pd = UpOptions(replicas=prefill + decode, pd=(prefill, decode), port=free_port(), **common)
    rows = await measure(pd, ("kv_cost", "round_robin"), workload)
    colocated = UpOptions(replicas=prefill + decode, port=free_port(), **common)
    rows += await measure(colocated, ("kv_cost",), workload)
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    rows = asyncio.run(run(args))
    workload = DemoWorkload(groups=args.groups, prompts_per_group=args.prompts_per_group)
    text = markdown(rows, workload, args)
    print(text)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        name = "pd" if args.event_format == "vllm" else f"pd-{args.event_format}"
        (args.out / f"{name}.json").write_text(json.dumps(rows, indent=2) + "\n")
        (args.out / f"{name}.md").write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
