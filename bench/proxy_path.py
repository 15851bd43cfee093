"""What kvroute-proxy's own code costs per request, with no sockets and no other process.

``python -m bench.proxy_path [--requests N] [--strategy S] [--prompt P]`` builds one
worker's ``ProxyService`` (static mode, two replicas; with ``--strategy kv_aware``, a
proxy of a fleet as ``kvroute up`` runs it, debug headers on unless
``--no-debug-headers`` (as bench.proxy runs it), its routing state one control-plane
snapshot of two healthy replicas and its control-plane reporter counting), serves it
with its ``HttpServer`` on an in-memory transport and lets its ``ConnectionPool`` reach
in-memory replicas, then sends short non-streaming completions through the whole real
path: request parsing, routing, the upstream request and response parsing, the relay,
metrics and the response. A replica answers with a fixed vLLM-shaped body at once.

``--prompt hello`` (the default) sends ``Hello number N``: shorter than a KV block, so
kv_aware has no block key to look up. ``--prompt shared`` sends bench.proxy's
throughput prompts (``short_prompt``: one of 8 shared system lines and a question of
its own, about 45 tokens) for 32 clients, and the control plane's routing state (a
delta after the snapshot) shows every whole block of them resident on both replicas,
as after bench.proxy's warm-up: kv_aware takes its keyed path (block keys, leading
runs, scoring, the prediction of cached tokens, the speculative record), and the
replicas report 32 cached tokens, as an engine would.

``--concurrency N`` (default 1) times the CPU per request with N clients sending at
once, each on its own keep-alive connection, so that about N requests are in flight at
the proxy, as in bench.proxy's throughput runs (32): the proxy's per-replica state then
changes between two routing decisions (its in-flight counts), which one client at a
time never shows.
Printed: CPU time per request, the fastest of 10 batches and their median (on a machine
shared with other work the fastest batch is the least disturbed one). No system call is
made, so this is the proxy's Python work alone; what the kernel adds per hop is the same
for any Python proxy (``bench.proxy --floors``). ``--profile`` prints where the time goes
(cProfile, CPU time).

Then the critical path, in wall time per request (p50 and p90 over a second pass of the
same requests, stamped by the in-memory transports): *in*, from the request's bytes
handed to the server to the upstream write; *out*, from the replica's answer handed to
the client connection to the write to the client; *after*, from that write to the end of
the handler (work the client does not wait for, but the next request on a busy worker
does). In + out is what a client waits for beyond the two hops.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import gc
import json
import pstats
import statistics
import time
from typing import Any

import uvloop

from bench.proxy import short_prompt
from dataplane.service import ProxyService
from dataplane.settings import ProxySettings
from dataplane.transport.client import ConnectionPool, _Connection
from dataplane.transport.server import HttpServer, Request, Response
from kvcore.keys import root_key
from kvcore.pb import events_pb2, routing_pb2
from kvcore.request import prompt_keys
from kvcore.tokenize import PrefixTokenCache, load_tokenizer
from kvruntime.gc_tuning import tune_gc

MODEL = "kvroute/sim-model"
CLIENTS = 32  # --prompt shared: bench.proxy's concurrency (one system line per client)
QUESTIONS = 100  # --prompt shared: questions per client (bench.proxy's period)
SPECULATIVE_TTL_S = 2.0  # the snapshot's kv_aware workload's (the default)


def _reply(prompt_tokens: int, cached_tokens: int) -> bytes:
    answer = json.dumps({
        "id": "cmpl-1", "object": "text_completion", "created": 1, "model": MODEL,
        "choices": [{"index": 0, "text": " hi", "logprobs": None, "finish_reason": "length"}],
        "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": 1,
                  "total_tokens": prompt_tokens + 1,
                  "prompt_tokens_details": {"cached_tokens": cached_tokens}},
    }).encode()  # fmt: skip
    return b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s" % (
        len(answer),
        answer,
    )


def hello_prompt(i: int) -> str:
    return f"Hello number {i % 50}"


def shared_prompt(i: int) -> str:
    """bench.proxy's throughput prompt of client ``i % CLIENTS``, its ``i // CLIENTS``-th."""
    return short_prompt(i % CLIENTS, (i // CLIENTS) % QUESTIONS)


PROMPTS = {  # --prompt: (the i-th request's prompt, what a replica answers to every one)
    "hello": (hello_prompt, _reply(5, 0)),
    "shared": (shared_prompt, _reply(45, 32)),
}
BATCHES = 10
SPLIT = {  # part of the path: (from stamp, to stamp); see the module docstring
    "in": ("sent", "upstream"),
    "out": ("reply", "answered"),
    "after": ("answered", "ended"),
}
STRATEGIES = ["round_robin", "least_load", "prefix_hash", "kv_aware"]


class MemoryTransport:
    """What the protocols write to; ``on_write`` gets every write."""

    def __init__(self, on_write: Any) -> None:
        self.on_write = on_write

    def write(self, data: bytes) -> None:
        self.on_write(data)

    def close(self) -> None:
        pass

    def is_closing(self) -> bool:
        return False

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return default

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass


class _MemoryReplicas(ConnectionPool):
    """The proxy's client, its connections answered in memory by a replica that replies
    to every request with ``reply`` (on the next turn of the loop, as a socket would);
    with ``stamps``, the times of the upstream write and of the reply's arrival in it."""

    def __init__(self, reply: bytes, stamps: dict[str, float] | None = None) -> None:
        super().__init__(2.0, 60.0)
        self.reply = reply
        self.stamps = stamps

    async def _connect(self, host: str, port: int) -> _Connection:
        connection = _Connection()
        loop = asyncio.get_running_loop()
        stamps, answer = self.stamps, self.reply

        def reply() -> None:
            if stamps is not None:
                stamps["reply"] = time.perf_counter()
            connection.data_received(answer)

        def on_write(_: bytes) -> None:
            if stamps is not None:
                stamps["upstream"] = time.perf_counter()
            loop.call_soon(reply)

        connection.connection_made(MemoryTransport(on_write))  # type: ignore[arg-type]
        connection.peer = (host, port)
        return connection


REPLICAS = ["http://10.0.0.1:8000", "http://10.0.0.2:8000"]


def _service(strategy: str, debug_headers: bool = True) -> ProxyService:
    """A static proxy, or (``kv_aware``) one of a fleet: its state one snapshot, never
    started (no control plane to reach); its debug headers on unless ``debug_headers`` is
    False (bench.proxy runs kv_aware's proxy without them)."""
    if strategy != "kv_aware":
        static = {"static_replicas": REPLICAS, "static_strategy": strategy}
        service = ProxyService(ProxySettings.model_validate({**static, "log_level": "WARNING"}))
        for endpoint in service.fleet.replicas.endpoints():
            service.fleet.set_served_names(endpoint.ordinal, [MODEL])
        return service
    settings = {
        "controlplane": ["127.0.0.1:1"],
        "debug_headers": debug_headers,
        "log_level": "WARNING",
    }
    service = ProxyService(ProxySettings.model_validate(settings))
    service.fleet.apply(_snapshot())
    return service


def _snapshot() -> routing_pb2.StateUpdate:
    """Two healthy idle replicas serving ``MODEL``; the ``default`` workload kv_aware."""
    policy = {"strategy": "kv_aware", "speculative_ttl_s": SPECULATIVE_TTL_S}
    config = routing_pb2.RoutingConfig(
        revision=1,
        workloads=[routing_pb2.Workload(name="default", policy_json=json.dumps(policy))],
        models=[routing_pb2.Model(name=MODEL, tokenizer="builtin", block_size=16)],
    )
    replicas = [
        routing_pb2.Replica(
            ordinal=i, replica_id=f"r{i}", pool="default", base_url=url, model=MODEL,
            status=routing_pb2.REPLICA_STATUS_HEALTHY, capacity_seqs=1024,
            load=events_pb2.LoadReport(ts=time.time()),
        )
        for i, url in enumerate(REPLICAS)
    ]  # fmt: skip
    chunk = routing_pb2.SnapshotChunk(
        chunk_index=0, last_chunk=True, config=config, replicas=replicas
    )
    return routing_pb2.StateUpdate(epoch=1, version=1, snapshot=chunk)


def _shared_residency() -> routing_pb2.StateUpdate:
    """The delta after ``_snapshot`` that shows every whole block of every
    ``shared_prompt`` resident on both replicas (keyed as the proxy keys them: the
    registry's builtin tokenizer, block size 16, no tenant); file I/O: off the loop."""
    cache = PrefixTokenCache(load_tokenizer("builtin"))
    root = root_key(model=MODEL, namespace="")
    keys: set[int] = set()
    for i in range(CLIENTS * QUESTIONS):
        body = {"prompt": shared_prompt(i)}
        keys.update(prompt_keys(body, cache, root=root, block_size=16, kind="completion").keys)
    residency = [
        routing_pb2.ResidencyChange(ordinal=i, added=sorted(keys)) for i in range(len(REPLICAS))
    ]
    return routing_pb2.StateUpdate(epoch=1, version=2, delta=routing_pb2.Delta(residency=residency))


class _Client:
    """One keep-alive connection to the proxy, sending one request at a time."""

    def __init__(self, server: HttpServer, stamps: dict[str, float] | None) -> None:
        self.stamps = stamps
        self._answer: asyncio.Future[bytes] | None = None  # the request in flight
        self._protocol = server.protocol()
        self._protocol.connection_made(MemoryTransport(self._on_response))  # type: ignore[arg-type]

    def _on_response(self, data: bytes) -> None:
        if self.stamps is not None:
            self.stamps["answered"] = time.perf_counter()
        if self._answer is not None and not self._answer.done():
            self._answer.set_result(data)

    async def send(self, request: bytes) -> bytes:
        """``request``'s bytes to the proxy; its answer's."""
        answer: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()
        self._answer = answer
        if self.stamps is not None:
            self.stamps["sent"] = time.perf_counter()
        self._protocol.data_received(request)
        reply = await answer
        self._answer = None
        if not reply.startswith(b"HTTP/1.1 200"):
            raise SystemExit(f"the proxy answered {reply[:200]!r}")
        return reply


class _Path:
    """One worker's proxy served in memory, and ``concurrency`` clients sending it short
    completions, each on its own connection."""

    def __init__(
        self,
        strategy: str,
        stamps: dict[str, float] | None = None,
        debug_headers: bool = True,
        prompt: str = "hello",
        concurrency: int = 1,
    ) -> None:
        self.service = _service(strategy, debug_headers)
        self._prompt, reply = PROMPTS[prompt]
        self._shared = prompt == "shared" and strategy == "kv_aware"
        self.service.upstream.pool = _MemoryReplicas(reply, stamps)
        self.stamps = stamps
        handler: Any = self.service.app if stamps is None else self._stamped
        server = HttpServer(handler, max_body_bytes=self.service.settings.max_body_bytes)
        self._clients = [_Client(server, stamps) for _ in range(concurrency)]

    async def warm(self, requests: int) -> None:
        """``requests`` requests (tokenizer caches, connections, metric children) and, on
        the keyed path, more until the first speculative records have expired: each
        request then also expires one, as on a proxy that has run for a while."""
        until = time.monotonic() + (SPECULATIVE_TTL_S + 0.5 if self._shared else 0.0)
        sent, step = 0, max(1, min(100, requests), len(self._clients))
        while sent < requests or time.monotonic() < until:
            await self.many(sent, step)
            sent += step
        gc.collect()

    async def start(self) -> None:
        tokenizer = self.service.settings.tokenizer
        await asyncio.to_thread(self.service.router.tokenizers.load, tokenizer)
        if self._shared:  # what the fleet's sidecars announced after bench.proxy's warm-up
            self.service.fleet.apply(await asyncio.to_thread(_shared_residency))

    async def _stamped(self, request: Request, response: Response) -> None:
        assert self.stamps is not None
        await self.service.app(request, response)
        self.stamps["ended"] = time.perf_counter()

    def _request(self, i: int) -> bytes:
        body = json.dumps({"model": MODEL, "prompt": self._prompt(i), "max_tokens": 1})
        return (
            b"POST /v1/completions HTTP/1.1\r\nhost: proxy\r\ncontent-type: application/json"
            b"\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body.encode())
        )

    async def one(self, i: int) -> bytes:
        """Send the ``i``-th request on the first connection and wait for the proxy's
        answer (its bytes)."""
        return await self._clients[0].send(self._request(i))

    async def many(self, first: int, count: int) -> None:
        """Requests ``first`` to ``first + count - 1``, every client sending its share
        one after another (so about ``concurrency`` are in flight at the proxy)."""
        if len(self._clients) == 1:
            for i in range(first, first + count):
                await self.one(i)
            return
        step = len(self._clients)

        async def client(number: int) -> None:
            for i in range(first + number, first + count, step):
                await self._clients[number].send(self._request(i))

        await asyncio.gather(*(client(number) for number in range(step)))

    async def aclose(self) -> None:
        self.service.reporter = None  # no control plane to deliver its last report to
        await self.service.aclose()


async def measure(
    requests: int,
    strategy: str,
    profile: bool,
    warmup: int = 500,
    debug_headers: bool = True,
    prompt: str = "hello",
    concurrency: int = 1,
) -> list[float]:
    """CPU microseconds per request of each of ``BATCHES`` batches."""
    path = _Path(strategy, debug_headers=debug_headers, prompt=prompt, concurrency=concurrency)
    await path.start()
    await path.warm(warmup)
    per_batch = max(1, requests // BATCHES)
    samples = []
    for _ in range(BATCHES):
        started = time.thread_time()
        await path.many(0, per_batch)
        samples.append((time.thread_time() - started) / per_batch * 1e6)
    if profile:
        profiler = cProfile.Profile(time.thread_time)
        profiler.enable()
        await path.many(0, per_batch)
        profiler.disable()
        pstats.Stats(profiler).sort_stats("tottime").print_stats(30)
    await path.aclose()
    return samples


async def measure_split(
    requests: int,
    strategy: str,
    warmup: int = 500,
    debug_headers: bool = True,
    prompt: str = "hello",
) -> dict[str, list[float]]:
    """Wall microseconds per request of each part of the path (``SPLIT``), request by
    request."""
    stamps: dict[str, float] = {}
    path = _Path(strategy, stamps, debug_headers, prompt)
    await path.start()
    await path.warm(warmup)
    parts: dict[str, list[float]] = {name: [] for name in SPLIT}
    for i in range(requests):
        stamps.clear()
        await path.one(i)
        for name, (begin, end) in SPLIT.items():
            parts[name].append((stamps[end] - stamps[begin]) * 1e6)
    await path.aclose()
    return parts


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


_SPLIT_NAMES = {
    "in": "request in -> upstream write",
    "out": "reply in -> client write",
    "after": "client write -> handler end",
    "in + out": "what the client waits",
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=10_000)
    parser.add_argument("--strategy", default="round_robin", choices=STRATEGIES)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument(
        "--prompt",
        default="hello",
        choices=list(PROMPTS),
        help="hello: 'Hello number N' (no whole KV block); shared: bench.proxy's throughput "
        "prompts, their blocks resident on both replicas (kv_aware's keyed path)",
    )
    parser.add_argument(
        "--concurrency",
        type=int,
        default=1,
        help="clients sending at once, each on its own connection (bench.proxy's "
        "throughput runs use 32); the wall-time split is always measured with one",
    )
    parser.add_argument(
        "--no-debug-headers",
        dest="debug_headers",
        action="store_false",
        help="kv_aware's proxy without the x-kvroute-* headers, as bench.proxy runs it",
    )
    args = parser.parse_args(argv)
    tune_gc()  # as kvroute-proxy's workers run
    options = {"debug_headers": args.debug_headers, "prompt": args.prompt}
    samples = uvloop.run(
        measure(args.requests, args.strategy, args.profile, concurrency=args.concurrency, **options)
    )
    parts = uvloop.run(measure_split(args.requests, args.strategy, **options))
    mode = "a fleet's" if args.strategy == "kv_aware" else "static"
    if args.strategy == "kv_aware" and not args.debug_headers:
        mode += " (no debug headers)"
    prompt = "shared-prefix" if args.prompt == "shared" else "short"
    print(f"kvroute-proxy request path in process, {mode} {args.strategy}, {prompt} completion")
    if args.concurrency > 1:
        print(f"  CPU per request with {args.concurrency} clients sending at once:")
    print(f"  CPU per request, fastest of {BATCHES} batches  {min(samples):8.1f} us")
    print(f"  CPU per request, median batch            {statistics.median(samples):8.1f} us")
    if args.concurrency > 1:
        print("  (the wall-time split below: one client)")
    print(f"  wall time per request over {args.requests} requests     p50        p90")
    parts["in + out"] = [a + b for a, b in zip(parts["in"], parts["out"], strict=True)]
    for name, values in parts.items():
        p50, p90 = _percentile(values, 0.5), _percentile(values, 0.9)
        print(f"  {name + ' (' + _SPLIT_NAMES[name] + ')':38s} {p50:8.1f} us {p90:7.1f} us")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
