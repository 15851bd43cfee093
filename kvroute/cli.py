"""The ``kvroute`` command: run kvroute locally, benchmark it, explain a routing decision.

``kvroute bench NAME [ARGS...]`` runs one benchmark of ``BENCHMARKS`` (each a
``module:function`` taking its own argument list and returning an exit status), so that
a new benchmark is one line in that table.

``kvroute up`` runs a whole local fleet (NATS, etcd, simulated engines or your own, their
sidecars, the control plane and proxies) until Ctrl-C; ``--demo`` also drives a
shared-prefix workload through it, round-robin then kv_aware, and compares them.

``kvroute explain PROMPT --model M`` asks a control plane how a proxy would route that
prompt, and why (``explain.py``).
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import sys
from collections.abc import Sequence
from pathlib import Path

from enginesim.sim_model import SIM_MODEL_DIR
from kvcore.tokenize import BUILTIN
from kvroute import explain
from kvroute.extras import MissingExtra, require
from kvroute.up import Fleet, UpOptions, run

# name -> (module:function taking argv and returning an exit status, what it measures)
BENCHMARKS: dict[str, tuple[str, str]] = {
    "sim": ("bench.sim.__main__:main", "discrete-event simulation: strategies, peers, oracle"),
    "e2e": ("bench.e2e.__main__:main", "real processes, kvroute beside the peer routers"),
    "micro": ("bench.micro.__main__:main", "routing core micro benchmarks"),
    "proxy": ("bench.proxy:main", "the proxy's overhead, throughput and decision time"),
    "sidecar": ("bench.sidecar_throughput:main", "sidecar events/s and publish latency"),
    "enginesim": ("bench.enginesim_capacity:main", "one kvroute-sim's request capacity"),
    "epp": ("bench.epp:main", "kvroute-epp's pick latency and held streams, as Envoy drives it"),
    "pd": (
        "bench.pd:main",
        "disaggregated prefill/decode: kv_cost vs round-robin prefill, the peers, colocated",
    ),
    "controlplane": (
        "bench.controlplane.__main__:main",
        "control-plane ingest, memory, snapshot and publish-to-watcher latency",
    ),
    "faults": (
        "bench.faults.__main__:main",
        "NATS killed or cut from the control plane, a hung engine, a slow one, under load",
    ),
    "chaos": (
        "bench.chaos.__main__:main",
        "every fault in turn on kvroute up's HA fleet, then a soak: failures, convergence",
    ),
}
SIM_TOKENIZER = "sim"  # --tokenizer's name for enginesim's SIM_MODEL_DIR
DEMO_NUM_BLOCKS = 768  # 16 system prompts of ~125 blocks: 4 fit one replica, all fit 4


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be at least 1")
    return value


def _port(text: str) -> int:
    value = _positive_int(text)
    if value > 65535:
        raise argparse.ArgumentTypeError(f"{value} is not a TCP port (1-65535)")
    return value


def _scale(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"{value} must be 0 or more")
    return value


def _urls(text: str) -> tuple[str, ...]:
    urls = tuple(u.strip().rstrip("/") for u in text.split(",") if u.strip())
    bad = [u for u in urls if not u.startswith(("http://", "https://"))]
    if not urls or bad:
        raise argparse.ArgumentTypeError(f"expected http(s) URLs separated by commas, got {text!r}")
    return urls


def _add_up(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    up = commands.add_parser(
        "up",
        help="run a whole kvroute fleet locally (Ctrl-C stops it)",
        description="Start NATS, etcd, simulated engines (or --engines), their sidecars, "
        "the control plane and proxies on 127.0.0.1, print how to use them, serve until "
        "Ctrl-C. Exit status: 0 stopped, 1 a part died, 2 a problem to fix first.",
    )
    up.add_argument("--replicas", type=_positive_int, default=4, help="simulated engines (4)")
    up.add_argument(
        "--pd", type=_pd, metavar="P:D",
        help="disaggregated prefill/decode: P prefill and D decode sims (in place of --replicas)",
    )  # fmt: skip
    up.add_argument("--proxies", type=_positive_int, default=1, help="proxies (1)")
    up.add_argument("--ha", action="store_true", help="two control-plane instances")
    up.add_argument(
        "--event-format", choices=("vllm", "vllm-0.23", "sglang"), default="vllm",
        help="what the simulated engines speak (vllm)",
    )  # fmt: skip
    up.add_argument("--time-scale", type=_scale, default=1.0, help="sim seconds per real second")
    up.add_argument(
        "--tokenizer",
        help="'sim' (the simulated model's Hugging Face folder, which benchmark clients "
        "load too: the default), 'builtin' (the default with --demo or --engines) or a "
        "tokenizer folder",
    )
    up.add_argument("--port", type=_port, default=8000, help="first proxy's port (8000)")
    up.add_argument("--num-blocks", type=_positive_int, help="KV blocks per simulated engine")
    up.add_argument("--data-dir", type=Path, help="keep state here between runs")
    up.add_argument("--engines", type=_urls, help="run against these engines instead of sims")
    up.add_argument("--engine-kind", choices=("vllm", "sglang"), default="vllm")
    up.add_argument("--demo", action="store_true", help="compare round_robin and kv_aware live")
    up.add_argument("--demo-only", action="store_true", help="exit after the demo")
    up.add_argument(
        "--out", type=Path, default=Path("kvroute-demo"),
        help="where the demo writes its report and plot (./kvroute-demo)",
    )  # fmt: skip


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvroute", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    _add_up(commands)
    bench = commands.add_parser(
        "bench",
        help="benchmarks: " + ", ".join(BENCHMARKS),
        description="\n".join(f"{name}: {what}" for name, (_, what) in BENCHMARKS.items()),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    bench.add_argument("benchmark", choices=sorted(BENCHMARKS))
    bench.add_argument("args", nargs=argparse.REMAINDER, help="the benchmark's own options")
    explain.add_parser(commands)
    return parser


def up_options(args: argparse.Namespace) -> UpOptions:
    demo = args.demo or args.demo_only
    blocks = args.num_blocks or (DEMO_NUM_BLOCKS if demo else 8192)
    return UpOptions(
        replicas=len(args.engines) if args.engines else sum(args.pd or (args.replicas,)),
        proxies=args.proxies,
        ha=args.ha,
        event_format=args.event_format,
        time_scale=args.time_scale,
        tokenizer=_tokenizer(args.tokenizer, builtin=demo or bool(args.engines)),
        port=args.port,
        data_dir=args.data_dir,
        engines=args.engines or (),
        engine_kind=args.engine_kind,
        num_blocks=blocks,
        demo=demo,
        demo_only=args.demo_only,
        pd=args.pd,
    )


def _pd(value: str) -> tuple[int, int]:
    """``P:D``: how many prefill and decode sims, at least one of each."""
    prefill, sep, decode = value.partition(":")
    if not sep or not prefill.isdigit() or not decode.isdigit():
        raise argparse.ArgumentTypeError(f"{value!r} is not P:D (such as 2:2)")
    if int(prefill) < 1 or int(decode) < 1:
        raise argparse.ArgumentTypeError("--pd needs at least one prefill and one decode sim")
    return int(prefill), int(decode)


def _tokenizer(spec: str | None, *, builtin: bool) -> str:
    """What the simulators and proxies tokenize with: by default the simulated model's
    Hugging Face folder, so a client that loads it counts tokens as the engines do; the
    demo's prompts are sized in the built-in tokenizer's tokens, and engines kvroute did
    not start have their own tokenizers (the proxy's builtin is only its fallback)."""
    if spec is None:
        spec = BUILTIN if builtin else SIM_TOKENIZER
    return str(SIM_MODEL_DIR) if spec == SIM_TOKENIZER else spec


def run_benchmark(name: str, argv: list[str]) -> int:
    """Run benchmark ``name`` of ``BENCHMARKS`` with its own arguments."""
    module_name, _, function = BENCHMARKS[name][0].partition(":")
    entry = getattr(importlib.import_module(module_name), function)
    status = entry(argv)
    return int(status or 0)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "up":
            return run_up(args)
        if args.command == "bench":
            require("bench")
            return run_benchmark(args.benchmark, args.args)
    except MissingExtra as exc:
        print(f"kvroute {args.command}: {exc}", file=sys.stderr)
        return 2
    return explain.run(args)


def run_up(args: argparse.Namespace) -> int:
    """``kvroute up``, with the demo when asked (its packages checked before the fleet starts)."""
    options = up_options(args)
    if not options.demo:
        return asyncio.run(run(options, None))
    require("local")
    from kvroute.demo import DemoWorkload, run_demo

    out = args.out

    async def demo(fleet: Fleet) -> None:
        await run_demo(
            fleet.proxy_urls[0],
            fleet.admin_urls[0],
            fleet.admin_token,
            fleet.engines,
            fleet.models[0],
            out,
            DemoWorkload(),
        )

    return asyncio.run(run(options, demo))


if __name__ == "__main__":  # ``python -m kvroute.cli``, as the ``kvroute`` script
    sys.exit(main())
