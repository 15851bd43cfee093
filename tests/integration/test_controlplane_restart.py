"""Restart the whole control plane beside real sidecars and simulated engines.

Real processes all the way: ``kvroute-sim`` engines, a ``kvroute-sidecar`` beside each,
``kvroute-controlplane``. While the control plane is down the engines keep caching and
evicting; after the restart and the resync, the residency a proxy receives equals what
the engines cache, key for key. The oracle is independent of the sidecar and the control
plane: the engines' cached block hashes mapped back to router keys (``PromptBook``).
"""

from __future__ import annotations

import asyncio
import contextlib
import random

from bench.controlplane.mirror import StateMirror, watch
from kvroute.servers import EtcdServer, NatsServer
from tests.integration.controlplane_harness import ControlPlaneProcess, SidecarProcess
from tests.integration.sidecar_harness import PromptBook, SimProcess

REPLICAS = ("rs-a", "rs-b")


def sidecar_args(sim: SimProcess, replica: str, nats_url: str) -> list[str]:
    return [
        "--engine-url", sim.http_url, "--kv-events-endpoint", sim.events,
        "--replay-endpoint", sim.replay, "--nats-url", nats_url,
        "--replica-id", replica, "--pool", "rs", "--model", "m",
    ]  # fmt: skip


async def send_prompts(sims: list[SimProcess], books: list[PromptBook], rng: random.Random) -> None:
    for sim, book in zip(sims, books, strict=True):
        for _ in range(12):
            shared = [7] * 16 * rng.randrange(0, 4)  # some prefixes shared within a replica
            tokens = shared + [rng.randrange(1, 30_000) for _ in range(16 * rng.randrange(2, 9))]
            await sim.complete(book.add(tokens))


async def converged(
    mirror: StateMirror, sims: list[SimProcess], books: list[PromptBook], deadline_s: float = 60
) -> dict[str, set[int]]:
    """Wait until the proxy's view equals the engines' caches; return the expected keys
    (the deadline bounds a failure: on a loaded machine a restart and resync take 20 s)."""
    async with asyncio.timeout(deadline_s):
        while True:
            expected = {
                replica: book.router_keys(await sim.cached_hashes())
                for replica, sim, book in zip(REPLICAS, sims, books, strict=True)
            }
            if all(mirror.keys_of(r) == keys for r, keys in expected.items()):
                return expected
            await asyncio.sleep(0.05)


async def test_after_a_restart_and_resync_the_residency_equals_the_engines_caches(
    nats_server: NatsServer, etcd_server: EtcdServer
) -> None:
    rng = random.Random(11)
    args = [
        "--nats-url", nats_server.url, "--etcd-endpoints", etcd_server.endpoint,
        "--etcd-prefix", "/restart/", "--pools", "rs", "--instance-id", "cp-r",
    ]  # fmt: skip
    starting = asyncio.create_task(ControlPlaneProcess(args).start())
    sims = list(
        await asyncio.gather(*(SimProcess("vllm", num_blocks=128).start() for _ in REPLICAS))
    )
    books = [PromptBook(sim.event_format, sim.block_size) for sim in sims]
    sidecars = [
        await SidecarProcess(sidecar_args(sim, replica, nats_server.url)).start()
        for sim, replica in zip(sims, REPLICAS, strict=True)
    ]
    first: ControlPlaneProcess | None = None
    second: ControlPlaneProcess | None = None
    watchers: list[asyncio.Task[None]] = []
    try:
        first = await starting
        before = StateMirror()
        watchers.append(asyncio.create_task(watch(first.grpc, before)))
        await send_prompts(sims, books, rng)
        expected = await converged(before, sims, books)
        assert all(expected.values())

        first.kill()
        await first.stop()
        await send_prompts(sims, books, rng)  # cached and evicted while nobody listens
        second = await ControlPlaneProcess(args).start()
        after = StateMirror()
        watchers.append(asyncio.create_task(watch(second.grpc, after)))
        expected_after = await converged(after, sims, books)
        assert expected_after != expected  # the engines really changed meanwhile
    finally:
        if first is None:
            with contextlib.suppress(Exception):
                first = await starting
        for task in watchers:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        for process in (second, first):
            if process is not None:
                await process.stop()
        for sidecar in sidecars:
            await sidecar.stop()
        for sim in sims:
            await sim.stop()
