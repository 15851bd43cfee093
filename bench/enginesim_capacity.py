"""Capacity of one ``kvroute-sim --instant`` process, so it is never a benchmark's bottleneck.

``python -m bench.enginesim_capacity`` starts one simulator on free loopback ports and
measures, printing each figure beside its target:

1. short non-streaming completions per second (32-token prompts, 8 output tokens) from
   ``--concurrency`` keep-alive connections for ``--duration`` seconds (target >=
   2,000/s), with the simulator's CPU share; the client is raw asyncio HTTP/1.1 because
   aiohttp's client saturates a core before the simulator does on a 2-core machine;
2. ``--streams`` streaming completions held open at once (target >= 500), each reading
   ``--stream-tokens`` SSE chunks to the end.

Loopback only; it stops by itself after the bounded duration and request counts.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from collections.abc import Coroutine
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import aiohttp

SIM = Path(sys.executable).parent / "kvroute-sim"
T = TypeVar("T")
TARGET_RPS = 2000
TARGET_STREAMS = 500


@dataclass
class Throughput:
    requests: int
    errors: int
    seconds: float
    server_cpu: float | None = None  # fraction of one core the simulator used

    @property
    def rps(self) -> float:
        return self.requests / self.seconds


@dataclass
class StreamResult:
    completed: int
    peak_open: int
    chunks: int
    seconds: float


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU time of process ``pid`` (Linux ``/proc``; None elsewhere)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def start_sim(max_num_seqs: int, num_blocks: int = 65536) -> tuple[subprocess.Popen[bytes], str]:
    args = [
        str(SIM), "--instant", "--port=0", "--kv-events-endpoint=tcp://127.0.0.1:0",
        "--replay-endpoint=tcp://127.0.0.1:0", f"--max-num-seqs={max_num_seqs}",
        f"--num-blocks={num_blocks}",
    ]  # fmt: skip
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    assert proc.stdout is not None
    line = proc.stdout.readline().decode()  # the ready line, or EOF if it failed
    if not line.startswith("kvroute-sim ready"):
        proc.kill()
        raise SystemExit(f"kvroute-sim did not start: {line!r}")
    url = line.split("http=", 1)[1].split()[0]
    return proc, url


async def throughput(url: str, concurrency: int, duration: float, cap: int) -> Throughput:
    """Keep-alive HTTP/1.1 over raw asyncio streams: a lean client, so that on a small
    machine the figure measures the simulator rather than the client."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    done = errors = 0
    deadline = time.perf_counter() + duration

    async def worker(wid: int) -> None:
        nonlocal done, errors
        reader, writer = await asyncio.open_connection(host, int(port))
        i = 0
        try:
            while time.perf_counter() < deadline and done + errors < cap:
                body = json.dumps({"prompt": [wid, i % 1000, *range(100, 130)], "max_tokens": 8})
                writer.write(_request(host, "/v1/completions", body.encode()))
                status, answer = await _read_response(reader)
                ok = status == 200 and b'"completion_tokens":8' in answer
                done, errors = done + ok, errors + (not ok)
                i += 1
        finally:
            writer.close()

    started = time.perf_counter()
    await asyncio.gather(*(worker(w) for w in range(concurrency)))
    return Throughput(done, errors, time.perf_counter() - started)


def _request(host: str, path: str, body: bytes) -> bytes:
    head = (
        f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body


async def _read_response(reader: asyncio.StreamReader) -> tuple[int, bytes]:
    head = await reader.readuntil(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    length = 0
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            length = int(line.split(b":", 1)[1])
    return status, await reader.readexactly(length)


async def streams(url: str, count: int, tokens: int) -> StreamResult:
    open_now = peak = completed = chunks = 0
    all_open = asyncio.Event()
    connector = aiohttp.TCPConnector(limit=count + 10)
    timeout = aiohttp.ClientTimeout(total=120)

    async def one(session: aiohttp.ClientSession, i: int) -> None:
        nonlocal open_now, peak, completed, chunks
        body = {"prompt": [i, *range(40)], "max_tokens": tokens, "stream": True}
        async with session.post(url + "/v1/completions", json=body) as resp:
            open_now += 1
            peak = max(peak, open_now)
            if open_now == count:
                all_open.set()
            received = 0
            async for line in resp.content:
                if line.startswith(b"data: {"):
                    json.loads(line[6:])
                    received += 1
                    if received == 1:
                        await all_open.wait()  # hold every stream open until all are
            open_now -= 1
            chunks += received
            completed += received == tokens

    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        started = time.perf_counter()
        await asyncio.gather(*(one(session, i) for i in range(count)))
        return StreamResult(completed, peak, chunks, time.perf_counter() - started)


def report(t: Throughput, s: StreamResult, args: argparse.Namespace) -> None:
    print(f"kvroute-sim --instant capacity ({args.concurrency} clients, {args.duration:g} s)")
    verdict = "ok" if t.rps >= TARGET_RPS and not t.errors else "BELOW TARGET"
    cpu = "" if t.server_cpu is None else f", simulator at {t.server_cpu:.0%} of a core"
    print(
        f"  non-streaming: {t.rps:8.0f} req/s  (target >= {TARGET_RPS}) "
        f"[{t.requests} ok, {t.errors} errors{cpu}]  {verdict}"
    )
    verdict = "ok" if s.peak_open >= TARGET_STREAMS and s.completed == args.streams else "BELOW"
    print(
        f"  streams held open at once: {s.peak_open:5d}  (target >= {TARGET_STREAMS}) "
        f"[{s.completed}/{args.streams} complete, {s.chunks / s.seconds:,.0f} chunks/s]  {verdict}"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--duration", type=float, default=5.0)
    parser.add_argument("--max-requests", type=int, default=100_000)
    parser.add_argument("--streams", type=int, default=500)
    parser.add_argument("--stream-tokens", type=int, default=32)
    args = parser.parse_args(argv)
    proc, url = start_sim(max_num_seqs=max(1024, args.streams))
    try:
        cpu_before = cpu_seconds(proc.pid)
        t = _run(throughput(url, args.concurrency, args.duration, args.max_requests))
        cpu_after = cpu_seconds(proc.pid)
        if cpu_before is not None and cpu_after is not None:
            t.server_cpu = (cpu_after - cpu_before) / t.seconds
        s = _run(streams(url, args.streams, args.stream_tokens))
    finally:
        proc.terminate()
        proc.wait(timeout=10)
    report(t, s, args)
    return 0


def _run(coro: Coroutine[Any, Any, T]) -> T:
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency off Windows
        return asyncio.run(coro)
    return uvloop.run(coro)


if __name__ == "__main__":
    sys.exit(main())
