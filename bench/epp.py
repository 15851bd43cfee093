"""What kvroute-epp costs a gateway: its decision, as Envoy waits for it, and its streams.

``python -m bench.epp`` starts a local fleet (``kvroute up``'s: simulated engines, their
sidecars, a control plane) and a ``kvroute-epp`` process on its state, then drives the
picker over loopback gRPC the way Envoy does (request headers, then the body full-duplex
in pieces of at most 62,000 bytes), from this process:

1. decision: an 8k-token chat (a long system prompt every request shares, a new question
   each time) sent ``--requests`` times one at a time; the figure is the time from
   writing the body's last piece to reading the headers answer with the pick, p50 and p99
   (targets: 1 ms and 3 ms), the first (cold) request left out, with the picker's own
   routing time (its ``decision_seconds``, the proxy's metric) beside it;
2. streams: ``--streams`` requests held open at once (picked, their answers not yet
   begun), all answered, the picker's in-flight gauge counting every one of them;
3. added TTFT: streamed chats through a real Envoy asking the picker (deploy/envoy's
   example) and through Envoy alone balancing round robin, to the same engines (run with
   no modelled time, so only the routers' costs differ), at 1 and ``--concurrency``
   requests at once, with 8k-token and 220 KB prompts each unique (no cache to win): the
   figure is the picker's TTFT p50 minus Envoy's alone (no target is set for it), with
   kvroute's own proxy on the same state beside them.

It prints each figure beside its target and exits 1 when one is missed.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import statistics
import sys
import tempfile
import time
import urllib.request
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import aiohttp
import grpc
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ext_proc
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ext_proc_grpc

from dataplane.epp.messages import BODY_CHUNK_BYTES, FULL_DUPLEX
from kvcore.request import prompt_keys
from kvcore.tokenize import PrefixTokenCache, load_tokenizer
from kvroute.servers import free_port
from kvroute.up import LocalFleet, UpOptions

EPP = Path(sys.executable).parent / "kvroute-epp"
ENVOY = Path(sys.executable).parent / "envoy"
# some 8,000 tokens with the built-in tokenizer
SYSTEM = " ".join(
    f"clause {n} of the policy says the assistant answers with care" for n in range(666)
)


def chat_body(model: str, question: str) -> bytes:
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
    return json.dumps({"model": model, "messages": messages, "max_tokens": 8}).encode()


def headers_message() -> ext_proc.ProcessingRequest:
    pairs = [(":method", "POST"), (":path", "/v1/chat/completions"), (":authority", "gateway"),
             ("content-type", "application/json")]  # fmt: skip
    headers = base_pb2.HeaderMap(
        headers=[base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in pairs]
    )
    return ext_proc.ProcessingRequest(
        request_headers=ext_proc.HttpHeaders(headers=headers),
        protocol_config=ext_proc.ProtocolConfiguration(
            request_body_mode=FULL_DUPLEX, response_body_mode=FULL_DUPLEX
        ),
    )


def body_messages(body: bytes) -> list[ext_proc.ProcessingRequest]:
    pieces = [body[i : i + BODY_CHUNK_BYTES] for i in range(0, len(body), BODY_CHUNK_BYTES)]
    return [
        ext_proc.ProcessingRequest(
            request_body=ext_proc.HttpBody(body=piece, end_of_stream=i == len(pieces) - 1)
        )
        for i, piece in enumerate(pieces)
    ]


async def picked(stub: Any, body: bytes) -> tuple[Any, float]:
    """One stream: headers and body sent; the call (still open) and the seconds from the
    last body piece to the headers answer."""
    call = stub.Process()
    await call.write(headers_message())
    *first, last = body_messages(body)
    for message in first:
        await call.write(message)
    started = time.perf_counter()
    await call.write(last)
    answer = await call.read()
    elapsed = time.perf_counter() - started
    assert answer.WhichOneof("response") == "request_headers", answer
    return call, elapsed


async def decisions(stub: Any, model: str, count: int) -> list[float]:
    times = []
    for index in range(count + 1):
        call, elapsed = await picked(stub, chat_body(model, f"question number {index}?"))
        call.cancel()
        if index:  # the first one tokenizes the whole system prompt: cold
            times.append(elapsed)
    return times


async def held_streams(stub: Any, model: str, count: int, metrics: str) -> tuple[float, float]:
    """``count`` streams picked and held; the seconds to pick them all and the picker's
    in-flight gauge while they are held."""
    started = time.perf_counter()
    body = json.dumps({"model": model, "prompt": "a short prompt", "max_tokens": 1}).encode()
    headers = headers_message()
    headers.request_headers.headers.headers[1].raw_value = b"/v1/completions"
    calls = []

    async def one() -> None:
        call = stub.Process()
        calls.append(call)
        await call.write(headers)
        for message in body_messages(body):
            await call.write(message)
        answer = await call.read()
        assert answer.WhichOneof("response") == "request_headers"

    await asyncio.gather(*(one() for _ in range(count)))
    elapsed = time.perf_counter() - started
    in_flight = gauge(metrics, "kvroute_proxy_requests_in_flight")
    for call in calls:
        call.cancel()
    return elapsed, in_flight


def scrape(metrics: str) -> list[str]:
    with urllib.request.urlopen(metrics + "/metrics", timeout=10) as resp:
        return list(resp.read().decode().splitlines())


def gauge(metrics: str, name: str) -> float:
    for line in scrape(metrics):
        if line.startswith(name + " "):
            return float(line.split()[1])
    return float("nan")


def routing_median_ms(metrics: str) -> float:
    """The upper bound of the bucket holding the median of the picker's own routing time
    (``decision_seconds``: classify, render, tokenize, key), the proxy's figure."""
    buckets: dict[float, float] = {}
    for line in scrape(metrics):
        if line.startswith("kvroute_proxy_decision_seconds_bucket{"):
            bound = line.split('le="', 1)[1].split('"', 1)[0]
            le = float("inf") if bound == "+Inf" else float(bound)
            buckets[le] = buckets.get(le, 0.0) + float(line.rsplit(" ", 1)[1])
    total = buckets.get(float("inf"), 0.0)
    return next((le * 1000 for le in sorted(buckets) if buckets[le] >= total / 2), float("nan"))


async def first_event_s(session: aiohttp.ClientSession, url: str, body: bytes) -> float:
    """Seconds to a streamed answer's first ``data:`` event."""
    started = time.perf_counter()
    headers = {"content-type": "application/json"}
    async with session.post(url + "/v1/chat/completions", data=body, headers=headers) as resp:
        assert resp.status == 200, await resp.text()
        async for line in resp.content:
            if line.startswith(b"data:"):
                elapsed = time.perf_counter() - started
                break
        await resp.read()
    return elapsed


LONG_WORD = "abcdefghijklmnopqrstuvwxyz" * 2  # 7.6 bytes a token with the built-in tokenizer


def unique_chat(model: str, size: int, index: int) -> bytes:
    """A streamed chat of about ``size`` bytes that no other request begins like (long
    words: a 220 KB prompt stays within the simulated engines' 32,768 tokens)."""
    words = " ".join([LONG_WORD] * (size // (len(LONG_WORD) + 1)))
    messages = [{"role": "user", "content": f"request {index}: {words}"}]
    return json.dumps(
        {"model": model, "messages": messages, "max_tokens": 4, "stream": True}
    ).encode()


async def ttfts(url: str, model: str, size: int, concurrency: int, indices: range) -> list[float]:
    timeout = aiohttp.ClientTimeout(total=600)
    connector = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        gate = asyncio.Semaphore(concurrency)

        async def one(index: int) -> float:
            async with gate:
                return await first_event_s(session, url, unique_chat(model, size, index))

        return sorted(await asyncio.gather(*(one(i) for i in indices)))


async def added_ttft(
    engines: list[str], epp_grpc: str, proxy: str, model: str, args: argparse.Namespace
) -> None:
    if importlib.util.find_spec("yaml") is None or not ENVOY.exists():
        print("added TTFT: not run (Envoy and PyYAML come with kvroute[dev])")
        return
    from bench.envoy import EnvoyProcess  # PyYAML: only here

    with ExitStack() as stack:
        # (each waits for its Envoy's admin /ready, off the event loop)
        picking = await asyncio.to_thread(stack.enter_context, EnvoyProcess(epp_grpc, engines))
        alone = await asyncio.to_thread(stack.enter_context, EnvoyProcess(None, engines))
        sent = 0  # every request its own prompt: a second send of one would be a hit
        for size, label in ((60_800, "8k-token"), (220_000, "220 KB")):
            for concurrency in (1, args.concurrency):
                count = max(8, 2 * concurrency)
                epp = await ttfts(picking.url, model, size, concurrency, range(sent, sent + count))
                sent += count
                base = await ttfts(alone.url, model, size, concurrency, range(sent, sent + count))
                sent += count
                own = await ttfts(proxy, model, size, concurrency, range(sent, sent + count))
                sent += count
                p50, base_p50 = statistics.median(epp) * 1000, statistics.median(base) * 1000
                print(f"added TTFT, {label} prompts, {concurrency} at once ({count} each): "
                      f"{p50 - base_p50:+.1f} ms (p50s: Envoy asking the picker {p50:.1f} ms, "
                      f"Envoy alone {base_p50:.1f} ms, kvroute-proxy on the same state "
                      f"{statistics.median(own) * 1000:.1f} ms)")  # fmt: skip


async def start_epp(controlplane: str) -> tuple[asyncio.subprocess.Process, dict[str, str]]:
    proc = await asyncio.create_subprocess_exec(
        str(EPP), f"--controlplane={controlplane}", "--host=127.0.0.1", "--grpc-port=0",
        "--health-port=0", "--metrics-port=0", "--shutdown-grace-s=0",
        stdout=asyncio.subprocess.PIPE,
    )  # fmt: skip
    assert proc.stdout is not None
    async with asyncio.timeout(60):
        line = (await proc.stdout.readline()).decode()
    assert line.startswith("kvroute-epp ready"), line
    return proc, dict(part.split("=", 1) for part in line.split()[2:])


async def run(args: argparse.Namespace) -> int:
    with tempfile.TemporaryDirectory(prefix="kvroute-bench-epp-") as directory:
        fleet = LocalFleet(
            UpOptions(replicas=2, port=free_port(), data_dir=Path(directory), time_scale=0.0),
            say=lambda _: None,
        )
        started = await fleet.start()
        proc, ports = await start_epp(",".join(started.grpc_addresses))
        try:
            options = [("grpc.max_send_message_length", 64 * 1024 * 1024)]
            async with grpc.aio.insecure_channel(ports["grpc"], options=options) as channel:
                await channel.channel_ready()
                stub = ext_proc_grpc.ExternalProcessorStub(channel)
                status = await report(stub, started.models[0], ports["metrics"], args)
            if args.ttft:
                proxy = started.proxy_urls[0]
                await added_ttft(started.engines, ports["grpc"], proxy, started.models[0], args)
            return status
        finally:
            proc.terminate()
            await proc.wait()
            await fleet.aclose()


def prompt_tokens(body: bytes) -> int:
    """The chat's tokens as the fleet's built-in tokenizer counts them."""
    cache = PrefixTokenCache(load_tokenizer("builtin"))
    return prompt_keys(json.loads(body), cache, root=0, block_size=16, kind="chat").count


async def report(stub: Any, model: str, metrics: str, args: argparse.Namespace) -> int:
    tokens = prompt_tokens(chat_body(model, "x"))
    times = sorted(await decisions(stub, model, args.requests))
    p50 = statistics.median(times) * 1000
    p99 = times[min(len(times) - 1, round(0.99 * (len(times) - 1)))] * 1000
    missed = 0
    print(f"decision, last body piece -> headers answer, {args.requests} chats of ~{tokens} "
          f"tokens sharing a system prompt: p50 {p50:.3f} ms (target <= 1), "
          f"p99 {p99:.3f} ms (target <= 3)")  # fmt: skip
    missed += p50 > 1 or p99 > 3
    print(f"  of which the picker's routing (decision_seconds, as the proxy's): median <= "
          f"{routing_median_ms(metrics):.2f} ms")  # fmt: skip
    elapsed, in_flight = await held_streams(stub, model, args.streams, metrics)
    print(f"streams: {args.streams} picked and held in {elapsed:.2f} s; the picker's "
          f"in-flight gauge {in_flight:.0f} (target {args.streams})")  # fmt: skip
    missed += in_flight != args.streams
    return 1 if missed else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.epp", description=__doc__)
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--streams", type=int, default=1000)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--no-ttft", dest="ttft", action="store_false",
                        help="leave out the TTFT through Envoy")  # fmt: skip
    return asyncio.run(run(parser.parse_args(argv)))


if __name__ == "__main__":
    sys.exit(main())
