"""How fast the sidecar turns engine KV events into router events on NATS.

``python -m bench.sidecar_throughput [throughput latency cost]`` (all by default) starts a
real ``nats-server`` on loopback and prints each figure beside its target:

1. **throughput** -- vLLM 0.33 batches (each: 4 ``BlockStored`` of 4 blocks chained onto
   earlier requests' blocks, and 4 one-block ``BlockRemoved``: 20 block events) pushed
   through the sidecar's own code path, decode -> key mapper -> outbox -> NATS publish,
   in one asyncio loop on one core (target >= 50,000 block events/s);
2. **latency** -- the whole ``SidecarService`` (ZMQ SUB, pipeline, coalescing flusher,
   NATS) fed by a ZMQ PUB on another thread at 10,000 block events/s for ``--seconds``;
   the service's own receive-to-publish samples (oldest frame of each NATS batch, so
   the 1 ms coalescing deadline is included) give the p50/p99 (target p99 <= 5 ms);
3. **cost** -- the same whole service fed batches shaped like ``bench.proxy``'s replicas'
   (each: one ``BlockStored`` of 2 blocks chained onto one of 8 shared system prefixes,
   and one one-block ``BlockRemoved``) at 1,000 batches/s for ``--seconds``: the CPU time
   of the service's event-loop thread per engine batch (receive, decode, key, publish;
   the publisher's thread not counted), reported without a target. At one engine batch
   per request (an engine batches a step's events, so under load it is fewer),
   microseconds per batch read as milliseconds per 1,000 requests.

Loopback only; bounded by ``--batches`` and ``--seconds``; stops by itself.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import random
import statistics
import time
from collections.abc import Iterator
from dataclasses import dataclass

import nats
import zmq

import kvruntime.loop
from kvcore import subjects
from kvcore.engine_events import BlockRemoved, BlockStored, EngineEvent
from kvroute.servers import NatsServer, free_port
from kvruntime.gc_tuning import tune_gc
from sidecar.adapters import adapter_for
from sidecar.adapters.encoders import encode_batch
from sidecar.outbox import Outbox, OutboxConfig
from sidecar.pipeline import Pipeline
from sidecar.service import SidecarService
from sidecar.settings import SidecarSettings
from sidecar.zmq_source import Frame

TARGET_EVENTS_PER_S = 50_000
TARGET_P99_MS = 5.0
LATENCY_RATE = 10_000  # block events per second
COST_RATE = 1_000  # engine batches per second, part 3
SYSTEM_PREFIXES = 8
PARTS = ("throughput", "latency", "cost")
BLOCKS_PER_STORE = 4
STORES_PER_BATCH = 4
REMOVALS_PER_BATCH = 4
BLOCK_EVENTS_PER_BATCH = STORES_PER_BATCH * BLOCKS_PER_STORE + REMOVALS_PER_BATCH


@dataclass
class _Chain:
    last_hash: int | None = None


def workload(batches: int, seed: int = 0) -> Iterator[list[EngineEvent]]:
    """Engine batches: stores extend live chains (or start new ones), old blocks evicted."""
    rng = random.Random(seed)
    chains = [_Chain() for _ in range(64)]
    stored: list[int] = []
    for _ in range(batches):
        events: list[EngineEvent] = []
        for _ in range(STORES_PER_BATCH):
            chain = rng.choice(chains)
            if rng.random() < 0.1:
                chain.last_hash = None
            hashes = tuple(rng.getrandbits(64) for _ in range(BLOCKS_PER_STORE))
            tokens = tuple(rng.randrange(32_000) for _ in range(16 * BLOCKS_PER_STORE))
            events.append(BlockStored(hashes, chain.last_hash, tokens, 16))
            chain.last_hash = hashes[-1]
            stored.extend(hashes)
        tails = {chain.last_hash for chain in chains}
        for _ in range(REMOVALS_PER_BATCH):  # an older block no request is extending
            victim = stored.pop(rng.randrange(len(stored) // 2))
            while victim in tails:
                stored.append(victim)
                victim = stored.pop(rng.randrange(len(stored) // 2))
            events.append(BlockRemoved((victim,)))
        yield events


def request_batches(batches: int, seed: int = 2) -> Iterator[list[EngineEvent]]:
    """One request's events per batch: 2 new blocks after one of 8 shared 2-block system
    prefixes (stored first), and the eviction of an older request's block."""
    rng = random.Random(seed)
    prefixes: list[int] = []
    first: list[EngineEvent] = []
    for _ in range(SYSTEM_PREFIXES):
        hashes = (rng.getrandbits(64), rng.getrandbits(64))
        first.append(BlockStored(hashes, None, tuple(rng.randrange(32_000) for _ in range(32)), 16))
        prefixes.append(hashes[-1])
    older: list[int] = []
    for index in range(batches):
        hashes = (rng.getrandbits(64), rng.getrandbits(64))
        tokens = tuple(rng.randrange(32_000) for _ in range(32))
        events = [*first] if index == 0 else []
        events.append(BlockStored(hashes, rng.choice(prefixes), tokens, 16))
        if len(older) > 64:
            events.append(BlockRemoved((older.pop(0),)))
        older.append(hashes[-1])
        yield events


async def throughput(nats_url: str, batches: int) -> tuple[float, int]:
    payloads = [encode_batch(events, "vllm-0.33") for events in workload(batches)]
    nc = await nats.connect(nats_url)
    outbox = Outbox(OutboxConfig(replica_id="bench", pool="default"), epoch=1)
    pipeline = Pipeline(
        adapter=adapter_for("vllm"),
        model="m",
        router_block_size=16,
        outbox=outbox,
        new_epoch=lambda: 2,
    )
    subject = subjects.events_subject("default", "bench")
    start = time.perf_counter()
    for seq, payload in enumerate(payloads):
        pipeline.handle_frame(Frame(b"", seq, payload, 0))
        if outbox.depth >= 512 or seq == len(payloads) - 1:
            while (batch := outbox.take_batch()) is not None:
                await nc.publish(subject, batch.payload)
    await nc.flush()
    elapsed = time.perf_counter() - start
    await nc.close()
    assert outbox.stats.events_dropped == 0 and not pipeline.state_incomplete
    return batches * BLOCK_EVENTS_PER_BATCH / elapsed, outbox.stats.batches_published


def _paced_publisher(endpoint: str, payloads: list[bytes], rate_batches: float) -> None:
    """A ZMQ PUB on its own thread (the engine's side), paced to ``rate_batches``/s."""
    ctx = zmq.Context()
    pub = ctx.socket(zmq.XPUB)
    pub.bind(endpoint)
    pub.recv()  # the sidecar's subscription
    start = time.perf_counter()
    for seq, payload in enumerate(payloads):
        delay = start + seq / rate_batches - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        pub.send_multipart([b"", seq.to_bytes(8, "big"), payload])
    pub.close(linger=1000)
    ctx.term()


async def latency(nats_url: str, seconds: float) -> list[float]:
    rate_batches = LATENCY_RATE / BLOCK_EVENTS_PER_BATCH
    count = int(rate_batches * seconds)
    payloads = [encode_batch(events, "vllm-0.33") for events in workload(count, seed=1)]
    service, _ = await paced_service(nats_url, payloads, rate_batches)
    return list(service.pipeline.stats.latency.recent)


async def cost(nats_url: str, seconds: float) -> tuple[float, int]:
    """Event-loop thread CPU seconds per engine batch, and the NATS batches published."""
    count = int(COST_RATE * seconds)
    payloads = [encode_batch(events, "vllm-0.33") for events in request_batches(count)]
    service, cpu_s = await paced_service(nats_url, payloads, COST_RATE)
    assert service.outbox.stats.events_dropped == 0 and not service.pipeline.state_incomplete
    return cpu_s / count, service.outbox.stats.batches_published


async def paced_service(
    nats_url: str, payloads: list[bytes], rate_batches: float
) -> tuple[SidecarService, float]:
    """A whole service fed ``payloads`` by a paced ZMQ PUB, until all are published; the
    CPU time this (the event loop's) thread spent meanwhile."""
    count = len(payloads)
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    settings = SidecarSettings(
        replica_id="bench",
        model="m",
        nats_url=nats_url,
        kv_events_endpoint=endpoint,
        kv_events_bind=False,
        engine_url=f"http://127.0.0.1:{free_port()}",
        port=0,
        load_interval_s=1.0,
    )
    service = SidecarService(settings)
    stop = asyncio.Event()
    runner = asyncio.create_task(service.run(stop))
    started = time.thread_time()
    await asyncio.to_thread(_paced_publisher, endpoint, payloads, rate_batches)
    async with asyncio.timeout(10):  # every frame read and every event published
        while True:
            source = service.source
            if source is not None and source.expected >= count and not service.outbox.depth:
                break
            await asyncio.sleep(0.01)
    cpu_s = time.thread_time() - started
    stop.set()
    await runner
    return service, cpu_s


def p(samples: list[float], q: float) -> float:
    return statistics.quantiles(samples, n=1000)[int(q * 1000) - 1] * 1000


async def run(batches: int, seconds: float, parts: list[str]) -> None:
    with NatsServer() as server:
        if "throughput" in parts:
            rate, nbatches = await throughput(server.url, batches)
            verdict = "ok" if rate >= TARGET_EVENTS_PER_S else "MISSED"
            print(
                f"throughput: {rate:,.0f} block events/s decoded+translated+published "
                f"({batches} engine batches -> {nbatches} NATS batches)  "
                f"target >= {TARGET_EVENTS_PER_S:,}  [{verdict}]"
            )
        if "latency" in parts:
            samples = await latency(server.url, seconds)
            p50, p99 = p(samples, 0.5), p(samples, 0.99)
            verdict = "ok" if p99 <= TARGET_P99_MS else "MISSED"
            print(
                f"latency at {LATENCY_RATE:,} block events/s: receive->publish p50 {p50:.2f} "
                f"ms, p99 {p99:.2f} ms over {len(samples)} NATS batches  "
                f"target p99 <= {TARGET_P99_MS} ms  [{verdict}]"
            )
        if "cost" in parts:
            per_batch, nbatches = await cost(server.url, seconds)
            print(
                f"cost at {COST_RATE:,} request-sized batches/s: {per_batch * 1e6:.0f} us of "
                f"the service's CPU per engine batch (= ms per 1,000 requests; {nbatches} "
                "NATS batches)  (reported)"
            )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, default=5000, help="engine batches, part 1")
    parser.add_argument("--seconds", type=float, default=3.0, help="duration of parts 2, 3")
    parser.add_argument("parts", nargs="*", default=list(PARTS), help=f"of {list(PARTS)}")
    args = parser.parse_args(argv)
    if unknown := set(args.parts) - set(PARTS):
        parser.error(f"unknown part(s) {sorted(unknown)}; choose from {list(PARTS)}")
    tune_gc()  # as kvroute-sidecar does
    logging.basicConfig(level=logging.ERROR)
    kvruntime.loop.run(run(args.batches, args.seconds, args.parts))


if __name__ == "__main__":
    main()
