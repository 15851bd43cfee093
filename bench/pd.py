"""``kvroute bench pd`` (and ``kvroute bench e2e --pd``): disaggregated prefill/decode
through real processes.

One ``kvroute up`` fleet of time-scaled ``kvroute-sim`` engines with ``--pd P:D`` roles
(their sidecars, NATS, etcd, the control plane, the proxy) serves the demo's grouped
workload (groups sharing a long system prompt) with the prefill replica picked by
``kv_cost`` (the default) and by ``round_robin``; the decode replica by kvroute's decode
choice (load, KV headroom, residency) in both. With ``--peers`` the peer routers that run
a P/D mode against the simulator serve the same requests on the same engines (caches
emptied between contenders): smg 1.13 (``--pd-disaggregation``, SGLang's bootstrap
protocol) and vllm-router 0.1.17 (``--vllm-pd-disaggregation``, vLLM's
``kv_transfer_params``), each with its default ``cache_aware``; a peer whose P/D mode does
not speak the engines' protocol is reported as not run, with the reason. A colocated fleet
of the same number of engines under ``kv_cost`` runs the same requests beside them.

Measured outside the routers: the prefill engines' own prefix-cache counters (hit rate on
the prefill side; every engine's for the colocated fleet), and by this client's clock the
time to first token, the inter-token latency (each answer's mean gap between tokens after
its first), output tokens per second and failed requests.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

from bench.e2e.peers import SMG, VLLM_ROUTER, Peer, PeerUnavailable
from kvroute.demo import AdminClient, DemoWorkload, EngineWatch, PhaseResult, run_phase
from kvroute.servers import free_port
from kvroute.supervisor import ChildFailed, ChildSpec, Supervisor
from kvroute.up import SIM_MODEL, LocalFleet, UpOptions

PEER_POLICY = "cache_aware"  # each peer's default


@dataclass(frozen=True)
class PdPeer:
    """A peer router's P/D mode: the engines' protocol it speaks, and why not the other."""

    peer: Peer
    protocol: str  # "vllm" or "sglang": the sims' --event-format it runs against
    cannot: str  # why it cannot run against the other protocol's sims

    def argv(self, port: int, prefills: list[str], decodes: list[str]) -> list[str]:
        argv = [str(self.peer.executable())]
        if self.peer.subcommand:
            argv.append(self.peer.subcommand)
        argv += ["--host", "127.0.0.1", "--port", str(port)]
        if self.protocol == "sglang":  # the sim's bootstrap server is its HTTP port
            argv.append("--pd-disaggregation")
            for url in prefills:
                argv += ["--prefill", url, url.rsplit(":", 1)[1]]
        else:
            argv.append("--vllm-pd-disaggregation")
            for url in prefills:
                argv += ["--prefill", url]
        for url in decodes:
            argv += ["--decode", url]
        argv += ["--policy", PEER_POLICY, "--prometheus-host", "127.0.0.1"]
        argv += ["--prometheus-port", str(free_port()), "--log-level", self.peer.log_level]
        return [*argv, *self.peer.extra]


PD_PEERS = (
    PdPeer(
        SMG,
        "sglang",
        "smg 1.13's HTTP PD router drives SGLang's bootstrap protocol whatever --backend "
        "says: against vLLM engines the decode replica is sent no kv_transfer_params and "
        "computes the whole prompt again (measured: its cached tokens 0 on a new prompt), "
        "so nothing is disaggregated",
    ),
    PdPeer(
        VLLM_ROUTER,
        "vllm",
        "vllm-router 0.1.17's P/D mode is vLLM's only (--vllm-pd-disaggregation, "
        "kv_transfer_params); it has no SGLang bootstrap mode",
    ),
)


async def measure(
    options: UpOptions,
    strategies: Sequence[str],
    workload: DemoWorkload,
    peers: Sequence[PdPeer] = (),
) -> list[dict[str, Any]]:
    """Each strategy's phase on one fleet started with ``options``, then each peer's on
    the same engines; caches emptied between."""
    rows = []
    fleet = LocalFleet(options, say=lambda _: None)  # in a run folder of its own
    started = await fleet.start()
    try:
        timeout = aiohttp.ClientTimeout(total=600)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            admin = AdminClient(session, started.admin_urls[0], started.admin_token)
            watch = EngineWatch(session, started.engines)
            split = options.pd[0] if options.pd else len(started.engines)
            counted = started.engines[:split]
            for strategy in strategies:
                await admin.set_strategy(strategy)
                await watch.reset_caches()
                result = await _phase(
                    session, watch, started.proxy_urls[0], strategy, workload, counted
                )
                rows.append(_row(_fleet_name(options), "kvroute", result))
            for peer in peers:
                rows.append(
                    await _peer_phase(session, watch, peer, started.engines, split, workload)
                )
    finally:
        await fleet.aclose()
    return rows


async def _peer_phase(
    session: aiohttp.ClientSession,
    watch: EngineWatch,
    pd_peer: PdPeer,
    engines: list[str],
    split: int,
    workload: DemoWorkload,
) -> dict[str, Any]:
    """The peer's P/D mode in front of the same engines (prefill first, then decode)."""
    fleet = f"P/D {split}:{len(engines) - split}"
    name = f"{pd_peer.peer.name} {pd_peer.peer.version}"
    supervisor = Supervisor(Path(tempfile.mkdtemp(prefix="kvroute-bench-pd-")))
    try:
        await asyncio.to_thread(pd_peer.peer.ensure_installed)
        port = free_port()
        argv = pd_peer.argv(port, engines[:split], engines[split:])
        spec = ChildSpec(
            f"{pd_peer.peer.name}-pd",
            argv,
            env={"HF_HUB_OFFLINE": "1"},
            ready_url=f"http://127.0.0.1:{port}/health",
        )
        await supervisor.start(spec)
        url = f"http://127.0.0.1:{port}"
        await _wait_answering(session, url)
        await watch.reset_caches()
        result = await _phase(session, watch, url, PEER_POLICY, workload, engines[:split])
        return _row(fleet, name, result)
    except (PeerUnavailable, ChildFailed) as exc:
        return {"fleet": fleet, "router": name, "strategy": PEER_POLICY, "not_run": str(exc)}
    finally:
        await supervisor.stop_all()


async def _wait_answering(session: aiohttp.ClientSession, url: str) -> None:
    """Until the router answers a streamed chat through both halves (a P/D router may
    list its workers before it can pair them)."""
    body = {"model": SIM_MODEL, "messages": [{"role": "user", "content": "ping"}],
            "max_tokens": 2}  # fmt: skip
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            async with session.post(f"{url}/v1/chat/completions", json=body) as response:
                await response.read()
                if response.status == 200:
                    return
        except (aiohttp.ClientError, TimeoutError):
            pass
        await asyncio.sleep(0.2)  # polling a router until it routes, bounded
    raise PeerUnavailable(f"{url} did not answer a chat within 60 s")


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


def _fleet_name(options: UpOptions) -> str:
    pd = options.pd
    return f"P/D {pd[0]}:{pd[1]}" if pd else f"colocated {options.replicas}"


def _mean(values: Sequence[float]) -> float | None:
    return round(sum(values) / len(values), 4) if values else None


def _quantile(values: Sequence[float], q: float) -> float | None:
    ordered = sorted(values)
    return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))], 4) if ordered else None


def _row(fleet: str, router: str, result: PhaseResult) -> dict[str, Any]:
    done = len(result.ttft_s)
    itls = [a.itl_s for a in result.answers if a.itl_s is not None]
    tokens = sum(a.completion_tokens for a in result.answers)
    return {
        "fleet": fleet,
        "router": router,
        "strategy": result.strategy,
        "requests": done,
        "errors": result.errors,
        "hit_rate": round(result.engine_hit_rate, 4),
        "ttft_mean_s": _mean(result.ttft_s),
        "ttft_p90_s": _quantile(result.ttft_s, 0.9),
        "itl_mean_s": _mean(itls),
        "itl_p90_s": _quantile(itls, 0.9),
        "requests_per_s": round(done / result.wall_s, 2) if result.wall_s else None,
        "output_tokens_per_s": round(tokens / result.wall_s, 1) if result.wall_s else None,
    }


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1e3:.1f} ms"


def markdown(rows: list[dict[str, Any]], workload: DemoWorkload, args: argparse.Namespace) -> str:
    lines = [
        f"# P/D ({args.event_format}): {workload.groups} groups x {workload.prompts_per_group} "
        f"prompts, ~{workload.system_tokens}-token shared system prompts, "
        f"{workload.max_tokens} tokens out, concurrency {workload.concurrency}, sims at "
        f"--time-scale {args.time_scale}; load average {args.load}",
        "",
        "hit rate: the prefill engines' own prefix-cache hits / queries (every engine's, "
        "colocated); TTFT, ITL (each answer's mean gap between tokens after the first) and "
        "throughput by the client's clock",
        "",
        "| fleet | router | prefill pick | requests | errors | hit rate | TTFT mean | TTFT p90 "
        "| ITL mean | ITL p90 | req/s | output tok/s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "not_run" in r:
            lines.append(
                f"| {r['fleet']} | {r['router']} | {r['strategy']} | not run: {r['not_run']} "
                "| | | | | | | | |"
            )
            continue
        lines.append(
            f"| {r['fleet']} | {r['router']} | {r['strategy']} | {r['requests']} | "
            f"{r['errors']} | {r['hit_rate']:.1%} | {_ms(r['ttft_mean_s'])} | "
            f"{_ms(r['ttft_p90_s'])} | {_ms(r['itl_mean_s'])} | {_ms(r['itl_p90_s'])} | "
            f"{r['requests_per_s']} | {r['output_tokens_per_s']} |"
        )
    return "\n".join(lines) + "\n"


def build_parser(prog: str = "kvroute bench pd") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0])
    parser.add_argument("--pd", default="2:2", help="prefill:decode sims (2:2)")
    parser.add_argument("--num-blocks", type=int, default=768, help="KV blocks per sim (768)")
    parser.add_argument("--time-scale", type=float, default=0.2, help="sim time scale (0.2)")
    parser.add_argument("--event-format", choices=("vllm", "sglang"), default="vllm",
                        help="the sims' engine: its P/D protocol too (vllm)")  # fmt: skip
    parser.add_argument("--groups", type=int, default=8)
    parser.add_argument("--prompts-per-group", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=32, help="tokens per answer (32)")
    parser.add_argument("--peers", action="store_true",
                        help="also the peers' P/D modes that speak the protocol")  # fmt: skip
    parser.add_argument("--out", type=Path, help="write pd[-sglang].json and .md here")
    return parser


def _workload(args: argparse.Namespace) -> DemoWorkload:
    return DemoWorkload(
        groups=args.groups, prompts_per_group=args.prompts_per_group, max_tokens=args.max_tokens
    )


async def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    prefill, decode = (int(n) for n in args.pd.split(":"))
    workload = _workload(args)
    common = {"num_blocks": args.num_blocks, "time_scale": args.time_scale,
              "tokenizer": "builtin", "debug_headers": False,
              "event_format": args.event_format}  # fmt: skip
    pd = UpOptions(replicas=prefill + decode, pd=(prefill, decode), port=free_port(), **common)
    peers = [p for p in PD_PEERS if p.protocol == args.event_format] if args.peers else []
    rows = await measure(pd, ("kv_cost", "round_robin"), workload, peers)
    if args.peers:
        fleet = _fleet_name(pd)
        for other in PD_PEERS:
            if other.protocol != args.event_format:
                name = f"{other.peer.name} {other.peer.version}"
                rows.append({"fleet": fleet, "router": name, "strategy": PEER_POLICY,
                             "not_run": other.cannot})  # fmt: skip
    colocated = UpOptions(replicas=prefill + decode, port=free_port(), **common)
    rows += await measure(colocated, ("kv_cost",), workload)
    return rows


def write(rows: list[dict[str, Any]], args: argparse.Namespace) -> str:
    text = markdown(rows, _workload(args), args)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        name = "pd" if args.event_format == "vllm" else f"pd-{args.event_format}"
        (args.out / f"{name}.json").write_text(json.dumps(rows, indent=2) + "\n")
        (args.out / f"{name}.md").write_text(text)
    return text


def main(argv: Sequence[str] | None = None, prog: str = "kvroute bench pd") -> int:
    args = build_parser(prog).parse_args(argv)
    args.load = f"{os.getloadavg()[0]:.1f}"
    rows = asyncio.run(run(args))
    args.load += f" before, {os.getloadavg()[0]:.1f} after"
    print(write(rows, args))
    lost = [r for r in rows if r.get("errors")]
    return 1 if lost else 0


E2E_ARGV = ("--peers", "--time-scale", "1", "--groups", "16", "--prompts-per-group", "8")


def e2e(out: Path) -> int:
    """``kvroute bench e2e --pd``: both protocols with the peers, into ``out``; in real
    time (a miss costs its modelled prefill, as in ``bench e2e``) and with more shared
    prefixes than the prefill replicas can hold, so the prefill pick decides what stays
    cached."""
    status = 0
    for protocol in ("vllm", "sglang"):
        argv = [*E2E_ARGV, "--event-format", protocol, "--out", str(out)]
        status |= main(argv, prog="kvroute bench e2e --pd")
    return status


if __name__ == "__main__":
    sys.exit(main())
