"""What kvroute-proxy costs: added latency, throughput, and the routing decision itself.

``python -m bench.proxy`` starts two ``kvroute-sim --instant`` replicas and one
``kvroute-proxy`` (static mode, ``--static-strategy`` round_robin, one worker) on loopback
and prints each figure beside its target:

1. added latency: one client sends short non-streaming completions one at a time, in
   turn to a replica directly and through each router; the figure is the router's p50
   minus the direct p50 (target <= 0.3 ms);
2. throughput: ``--concurrency`` keep-alive clients for ``--duration`` seconds through each
   router (and directly, the replicas' ceiling), with the router's CPU share;
3. the routing decision in-process (classify + render + tokenize + key + score) for an
   8,192-token chat prompt whose first 90% was seen before, 64 replicas, ``kv_aware``:
   p50 <= 1 ms and p99 <= 3 ms with the built-in tokenizer; with an HF byte-level BPE,
   p50 at most 0.3 ms above that tokenizer's own encode of the new 10%. The decision's
   CPU time (thread time) is printed beside its wall time: on a machine shared with other
   work the wall time includes waiting for a core, the CPU time does not.

``--floors`` adds two bare pass-through proxies (``bench.passthrough``: uvicorn with an
aiohttp client, and with a raw asyncio client) to show what the stack alone costs.
Other routers (sglang-router, vllm-router, ...) plug in with ``--router NAME=URL``: start
them in front of the replicas this benchmark prints (or pass ``--replicas URL,URL`` to use
replicas started elsewhere) and they are measured with the same load, side by side.
Loopback only; every phase is bounded by its duration or request count.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.enginesim_capacity import _read_response, _request, _run, cpu_seconds, start_sim
from bench.micro.model_files import write_tiny_model
from bench.micro.report import Figure
from bench.micro.tokenize_bench import _chat, _text_of, _words
from dataplane.fleet_state import FleetState
from dataplane.openai_request import parse_inference
from dataplane.routing import Defaults, Router
from kvcore.pb import events_pb2, routing_pb2
from kvcore.tokenize import BuiltinTokenizer, HFTokenizer, Tokenizer

PROXY = Path(sys.executable).parent / "kvroute-proxy"
MODEL = "kvroute/sim-model"
ADDED_LATENCY_MS = 0.3
DECISION_P50_MS, DECISION_P99_MS, HF_OVER_TAIL_MS = 1.0, 3.0, 0.3
PROMPT_TOKENS, SEEN = 8192, 0.9
REPLICAS = 64


@dataclass
class Target:
    name: str
    url: str
    pid: int | None = None  # a process whose CPU share is reported
    samples: list[float] = field(default_factory=list)


# -- end to end -------------------------------------------------------------------------


def start_proxy(replicas: list[str], strategy: str) -> tuple[subprocess.Popen[bytes], str]:
    args = [str(PROXY), "--port=0", f"--static-replicas={','.join(replicas)}",
            f"--static-strategy={strategy}", "--log-level=WARNING"]  # fmt: skip
    return _start(args, "kvroute-proxy ready")


def start_passthrough(replica: str, client: str) -> tuple[subprocess.Popen[bytes], str]:
    """``bench.passthrough``: the stack with no routing (the floor of a Python proxy)."""
    return _start([sys.executable, "-m", "bench.passthrough", replica, "0", client], "passthrough")


def _start(args: list[str], ready: str) -> tuple[subprocess.Popen[bytes], str]:
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    assert proc.stdout is not None
    line = proc.stdout.readline().decode()
    if not line.startswith(ready):
        proc.kill()
        raise SystemExit(f"{args[0]} did not start: {line!r}")
    return proc, line.split("http=", 1)[1].split()[0]


class Connection:
    """One keep-alive HTTP/1.1 connection over raw asyncio streams (a lean client)."""

    def __init__(self, url: str) -> None:
        self.host, port = url.removeprefix("http://").rsplit(":", 1)
        self.port = int(port)

    async def open(self) -> Connection:
        self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
        return self

    async def post(self, body: dict[str, Any]) -> int:
        self.writer.write(_request(self.host, "/v1/completions", json.dumps(body).encode()))
        status, _ = await _read_response(self.reader)
        return status

    def close(self) -> None:
        self.writer.close()


async def latencies(targets: list[Target], rounds: int) -> None:
    """Each round sends one request to each target in turn, so drift hits all alike."""
    connections = [await Connection(t.url).open() for t in targets]
    try:
        for i in range(rounds + 100):
            body = {"model": MODEL, "prompt": f"Hello number {i % 50}", "max_tokens": 1}
            for target, connection in zip(targets, connections, strict=True):
                start = time.perf_counter()
                status = await connection.post(body)
                elapsed = time.perf_counter() - start
                if status != 200:
                    raise SystemExit(f"{target.name} answered {status}")
                if i >= 100:  # warm-up
                    target.samples.append(elapsed * 1000)
    finally:
        for connection in connections:
            connection.close()


async def throughput(url: str, concurrency: int, duration: float) -> tuple[float, int]:
    done = errors = 0
    deadline = time.perf_counter() + duration

    async def worker(wid: int) -> None:
        nonlocal done, errors
        connection = await Connection(url).open()
        i = 0
        try:
            while time.perf_counter() < deadline:
                body = {"model": MODEL, "prompt": f"client {wid} asks {i % 100}", "max_tokens": 8}
                ok = await connection.post(body) == 200
                done, errors = done + ok, errors + (not ok)
                i += 1
        finally:
            connection.close()

    started = time.perf_counter()
    await asyncio.gather(*(worker(w) for w in range(concurrency)))
    return done / (time.perf_counter() - started), errors


def end_to_end(args: argparse.Namespace, targets: list[Target]) -> list[Figure]:
    _run(latencies(targets, args.rounds))
    direct = statistics.median(targets[0].samples)
    figures = [Figure("one client, short prompt: direct to a replica (p50)", direct, "ms")]
    for target in targets[1:]:
        added = statistics.median(target.samples) - direct
        target_ms = ADDED_LATENCY_MS if target.name == "kvroute" else None
        figures.append(Figure(f"added latency, {target.name} (p50)", added, "ms", target_ms))
    for target in targets:
        before = cpu_seconds(target.pid) if target.pid else None
        started = time.perf_counter()
        rps, errors = _run(throughput(target.url, args.concurrency, args.duration))
        label = f"throughput at concurrency {args.concurrency}, {target.name}"
        if before is not None and target.pid:
            share = ((cpu_seconds(target.pid) or 0) - before) / (time.perf_counter() - started)
            label += f" ({share:.0%} of a core)"
        figures.append(Figure(label + (f" [{errors} errors]" if errors else ""), rps, "req/s"))
    return figures


# -- the routing decision in process ---------------------------------------------------


def _fleet(spec: str, block_size: int) -> FleetState:
    config = routing_pb2.RoutingConfig(
        revision=1,
        workloads=[routing_pb2.Workload(name="default", policy_json='{"strategy": "kv_aware"}')],
        models=[routing_pb2.Model(name=MODEL, tokenizer=spec, block_size=block_size)],
    )
    replicas = [
        routing_pb2.Replica(
            ordinal=i,
            replica_id=f"r{i}",
            pool="default",
            base_url=f"http://10.0.0.{i}:8000",
            model=MODEL,
            status=routing_pb2.REPLICA_STATUS_HEALTHY,
            capacity_seqs=256,
            load=events_pb2.LoadReport(running=i % 7, waiting=i % 3, kv_usage=0.3, ts=time.time()),
        )
        for i in range(REPLICAS)
    ]
    chunk = routing_pb2.SnapshotChunk(
        chunk_index=0, last_chunk=True, config=config, replicas=replicas
    )
    fleet = FleetState(max_age_s=3600)
    fleet.apply(routing_pb2.StateUpdate(epoch=1, version=1, snapshot=chunk))
    return fleet


def _hold(fleet: FleetState, ordinal: int, keys: list[int]) -> None:
    change = routing_pb2.ResidencyChange(ordinal=ordinal, added=keys)
    delta = routing_pb2.Delta(residency=[change])
    fleet.apply(routing_pb2.StateUpdate(epoch=1, version=2, delta=delta))


def decision(tokenizer: Tokenizer, spec: str, label: str) -> list[Figure]:
    rng = random.Random(11)
    words = _words()
    system = _text_of(tokenizer, int(PROMPT_TOKENS * SEEN), rng, words)
    tail = int(PROMPT_TOKENS * (1 - SEEN))
    questions = [_text_of(tokenizer, tail, rng, words) for _ in range(80)]
    fleet = _fleet(spec, 16)
    router = Router(fleet, Defaults(), random.Random(3))
    bodies = [
        json.dumps({"model": MODEL, "messages": _chat(system, q)}).encode() for q in questions
    ]

    def decide(raw: bytes) -> Callable[[], Any]:
        request = parse_inference(raw, "chat")

        def run() -> Any:
            prepared = router.prepare(request, path="/v1/chat/completions", headers={},
                                      api_key=None, request_id="bench")  # fmt: skip
            return router.choose(prepared, now=time.monotonic()), prepared

        return run

    (chosen, _), prepared = decide(bodies[0])()  # warm: the 90% is now seen and cached
    _hold(fleet, 7, prepared.block_keys[: int(len(prepared.block_keys) * SEEN)])
    samples, cpu = [], []
    for raw in bodies[1:]:
        run = decide(raw)
        start, start_cpu = time.perf_counter(), time.thread_time()
        (chosen, _), _ = run()
        samples.append((time.perf_counter() - start) * 1000)
        cpu.append((time.thread_time() - start_cpu) * 1000)
        assert chosen.replica_id == "r7", chosen.summary()
    tail_encode = []
    for question in questions[1:]:
        start = time.perf_counter()
        tokenizer.encode(question, add_special_tokens=False)
        tail_encode.append((time.perf_counter() - start) * 1000)
    p50, p99 = statistics.median(samples), _p99(samples)
    name = f"routing decision, {prepared.prompt_tokens}-token chat 90% seen, 64 replicas, {label}"
    figures = [
        Figure(name + " (p50)", p50, "ms", DECISION_P50_MS),
        Figure("  its CPU time (p50; what a busy machine does not stretch)", _p50(cpu), "ms"),
        Figure(name + " (p99)", p99, "ms", DECISION_P99_MS),
    ]
    if label != "builtin":
        over = p50 - statistics.median(tail_encode)
        figures.append(
            Figure(
                f"  above {label}'s own encode of the new 10% (p50)", over, "ms", HF_OVER_TAIL_MS
            )
        )
    return figures


def _p50(samples: list[float]) -> float:
    return statistics.median(samples)


def _p99(samples: list[float]) -> float:
    return sorted(samples)[min(len(samples) - 1, int(len(samples) * 0.99))]


def decisions() -> list[Figure]:
    gc.set_threshold(50_000, 20, 100)  # as kvroute-proxy's workers run
    figures = decision(BuiltinTokenizer(), "builtin", "builtin")
    with tempfile.TemporaryDirectory() as scratch:
        corpus = [" ".join(_words()[i : i + 12]) for i in range(0, 3000, 12)]
        model = write_tiny_model(Path(scratch) / "bpe", vocab_size=8000, corpus=corpus)
        figures += decision(HFTokenizer(model), str(model), "HF byte-level BPE")
    return figures


# -- report -------------------------------------------------------------------------------


def print_figures(figures: list[Figure]) -> bool:
    missed = False
    for f in figures:
        target = "" if f.target is None else f"(target <= {f.target:g} {f.unit})"
        value = f"{f.value:,.0f}" if f.unit == "req/s" else f"{f.value:.3f}"
        print(f"  {f.name:<78} {value:>9} {f.unit:<5} {target:<22} {f.verdict}")
        missed |= f.verdict == "MISSED"
    return not missed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2000, help="latency rounds")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--duration", type=float, default=5.0, help="seconds per throughput run")
    parser.add_argument("--replicas", default="", help="use these replica URLs (comma-separated)")
    parser.add_argument("--router", action="append", default=[], help="NAME=URL, repeatable")
    parser.add_argument("--only", choices=["e2e", "decision"], default=None)
    parser.add_argument(
        "--floors", action="store_true",
        help="also measure bare pass-through proxies (bench.passthrough) on the same stack",
    )  # fmt: skip
    args = parser.parse_args(argv)
    figures: list[Figure] = []
    if args.only != "decision":
        figures += with_fleet(args)
    if args.only != "e2e":
        figures += decisions()
    print("kvroute-proxy benchmark")
    return 0 if print_figures(figures) else 1


def with_fleet(args: argparse.Namespace) -> list[Figure]:
    procs: list[subprocess.Popen[bytes]] = []
    try:
        urls = [u for u in args.replicas.split(",") if u]
        if not urls:
            for _ in range(2):
                proc, url = start_sim(max_num_seqs=1024)
                procs.append(proc)
                urls.append(url)
        print(f"replicas: {','.join(urls)}", flush=True)
        proxy, proxy_url = start_proxy(urls, "round_robin")
        procs.append(proxy)
        targets = [Target("direct", urls[0]), Target("kvroute", proxy_url, proxy.pid)]
        if args.floors:
            for client in ("aiohttp", "raw"):
                floor, floor_url = start_passthrough(urls[0], client)
                procs.append(floor)
                targets.append(Target(f"pass-through floor, {client} client", floor_url, floor.pid))
        for spec in args.router:
            name, _, url = spec.partition("=")
            targets.append(Target(name, url.rstrip("/")))
        return end_to_end(args, targets)
    finally:
        for proc in procs:
            proc.terminate()
            proc.wait(timeout=10)


if __name__ == "__main__":
    raise SystemExit(main())
