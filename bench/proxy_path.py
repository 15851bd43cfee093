"""What kvroute-proxy's own code costs per request, with no sockets and no other process.

``python -m bench.proxy_path [--requests N] [--strategy S]`` builds one worker's
``ProxyService`` (static mode, two replicas; with ``--strategy kv_aware``, a proxy of a
fleet as ``kvroute up`` runs it, debug headers on, its routing state one control-plane
snapshot of two healthy replicas and its control-plane reporter counting), serves it
with its ``HttpServer`` on an in-memory transport and lets its ``ConnectionPool`` reach
in-memory replicas, then sends short non-streaming completions through the whole real
path: request parsing, routing, the upstream request and response parsing, the relay,
metrics and the response. A replica answers with a fixed vLLM-shaped body at once.
Printed: CPU time per request, the fastest of 10 batches and their median (on a machine
shared with other work the fastest batch is the least disturbed one). No system call is
made, so this is the proxy's Python work alone; what the kernel adds per hop is the same
for any Python proxy (``bench.proxy --floors``). ``--profile`` prints where the time goes
(cProfile, CPU time).
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

from dataplane.http_client import ConnectionPool, _Connection
from dataplane.http_server import HttpServer
from dataplane.service import ProxyService
from dataplane.settings import ProxySettings
from kvcore.pb import events_pb2, routing_pb2

MODEL = "kvroute/sim-model"
ANSWER = json.dumps({
    "id": "cmpl-1", "object": "text_completion", "created": 1, "model": MODEL,
    "choices": [{"index": 0, "text": " hi", "logprobs": None, "finish_reason": "length"}],
    "usage": {"prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6,
              "prompt_tokens_details": {"cached_tokens": 0}},
}).encode()  # fmt: skip
REPLY = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s" % (
    len(ANSWER),
    ANSWER,
)
BATCHES = 10
STRATEGIES = ["round_robin", "least_load", "prefix_hash", "kv_aware"]


class _Transport:
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
    to every request with ``REPLY`` (on the next turn of the loop, as a socket would)."""

    async def _connect(self, host: str, port: int) -> _Connection:
        connection = _Connection()
        loop = asyncio.get_running_loop()
        connection.connection_made(
            _Transport(lambda _: loop.call_soon(connection.data_received, REPLY))  # type: ignore[arg-type]
        )
        connection.peer = (host, port)
        return connection


REPLICAS = ["http://10.0.0.1:8000", "http://10.0.0.2:8000"]


def _service(strategy: str) -> ProxyService:
    """A static proxy, or (``kv_aware``) one of a fleet: its state one snapshot, never
    started (no control plane to reach)."""
    if strategy != "kv_aware":
        static = {"static_replicas": REPLICAS, "static_strategy": strategy}
        service = ProxyService(ProxySettings.model_validate({**static, "log_level": "WARNING"}))
        for endpoint in service.fleet.endpoints():
            service.fleet.set_served_names(endpoint.ordinal, [MODEL])
        return service
    settings = {"controlplane": ["127.0.0.1:1"], "debug_headers": True, "log_level": "WARNING"}
    service = ProxyService(ProxySettings.model_validate(settings))
    service.fleet.apply(_snapshot())
    return service


def _snapshot() -> routing_pb2.StateUpdate:
    """Two healthy idle replicas serving ``MODEL``; the ``default`` workload kv_aware."""
    config = routing_pb2.RoutingConfig(
        revision=1,
        workloads=[routing_pb2.Workload(name="default", policy_json='{"strategy": "kv_aware"}')],
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


async def measure(requests: int, strategy: str, profile: bool, warmup: int = 500) -> list[float]:
    service = _service(strategy)
    settings = service.settings
    await asyncio.to_thread(service.router.tokenizers.load, settings.tokenizer)
    service.upstream.pool = _MemoryReplicas(2.0, 60.0)
    server = HttpServer(service.app, max_body_bytes=settings.max_body_bytes)
    answered: list[asyncio.Future[bytes]] = []  # the one request in flight

    def on_response(data: bytes) -> None:
        if answered and not answered[0].done():
            answered[0].set_result(data)

    client = server.protocol()
    client.connection_made(_Transport(on_response))  # type: ignore[arg-type]
    loop = asyncio.get_running_loop()

    async def one(i: int) -> None:
        body = json.dumps({"model": MODEL, "prompt": f"Hello number {i % 50}", "max_tokens": 1})
        answered.append(loop.create_future())
        client.data_received(
            b"POST /v1/completions HTTP/1.1\r\nhost: proxy\r\ncontent-type: application/json"
            b"\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body.encode())
        )
        reply = await answered[0]
        answered.clear()
        if not reply.startswith(b"HTTP/1.1 200"):
            raise SystemExit(f"the proxy answered {reply[:200]!r}")

    for i in range(warmup):  # tokenizer caches, connections, metric children
        await one(i)
    gc.collect()
    per_batch = max(1, requests // BATCHES)
    samples = []
    for _ in range(BATCHES):
        started = time.thread_time()
        for i in range(per_batch):
            await one(i)
        samples.append((time.thread_time() - started) / per_batch * 1e6)
    if profile:
        profiler = cProfile.Profile(time.thread_time)
        profiler.enable()
        for i in range(per_batch):
            await one(i)
        profiler.disable()
        pstats.Stats(profiler).sort_stats("tottime").print_stats(30)
    service.reporter = None  # no control plane to deliver its last report to
    await service.aclose()
    return samples


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=10_000)
    parser.add_argument("--strategy", default="round_robin", choices=STRATEGIES)
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args(argv)
    samples = uvloop.run(measure(args.requests, args.strategy, args.profile))
    mode = "a fleet's" if args.strategy == "kv_aware" else "static"
    print(f"kvroute-proxy request path in process, {mode} {args.strategy}, short completion")
    print(f"  CPU per request, fastest of {BATCHES} batches  {min(samples):8.1f} us")
    print(f"  CPU per request, median batch            {statistics.median(samples):8.1f} us")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
