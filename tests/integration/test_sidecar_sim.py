"""Done-when tests: the sidecar with real NATS and a real ``kvroute-sim`` in each event
format. The oracle is the sim's own cache (``/sim/state``), turned into router keys
independently of the sidecar (``PromptBook``)."""

from __future__ import annotations

import asyncio
import os
import random
import signal
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest

from kvcore.keys import block_keys
from kvcore.pb import events_pb2
from kvroute.servers import NatsServer, free_port
from tests.integration.controlplane_harness import server_certificate
from tests.integration.sidecar_harness import (
    PromptBook,
    SimProcess,
    Watcher,
    running_sidecar,
    sidecar_settings,
    wait_until,
)

pytestmark = pytest.mark.integration

FORMATS = [("vllm", 16), ("vllm-0.23", 16), ("sglang", 1)]


def engine_kind(event_format: str) -> str:
    return "sglang" if event_format == "sglang" else "vllm"


def settings_for(sim: SimProcess, nats_url: str, watcher: Watcher, **extra: object):  # type: ignore[no-untyped-def]
    return sidecar_settings(
        engine_url=sim.http_url,
        engine_kind=engine_kind(sim.event_format),
        kv_events_endpoint=sim.events,
        replay_endpoint=sim.replay,
        nats_url=nats_url,
        replica_id=watcher.replica,
        **extra,
    )


def prompt(rng: random.Random, prefix: list[int], blocks: int) -> list[int]:
    """``prefix`` plus random tokens, ending 3 tokens into a block: the one output token
    (``max_tokens=1``) never completes a block, so only prompt blocks get cached."""
    tail = [rng.randrange(100, 5000) for _ in range(blocks * 16 + 3)]
    return prefix + tail


async def converged(sim: SimProcess, book: PromptBook, watcher: Watcher) -> set[int]:
    """Wait until the published state equals the engine's cache; return it."""
    expected: set[int] = set()

    async def refresh() -> None:
        nonlocal expected
        expected = book.router_keys(await sim.cached_hashes())

    async with asyncio.timeout(30):
        while True:
            await refresh()
            if watcher.mirror.gpu_keys() == expected:
                return expected
            await asyncio.sleep(0.05)


@pytest.fixture
async def sim(request: pytest.FixtureRequest) -> AsyncIterator[SimProcess]:
    event_format, block_size, num_blocks, *extra = request.param
    process = await SimProcess(event_format, block_size, num_blocks, extra=tuple(*extra)).start()
    yield process
    await process.stop()


@pytest.mark.parametrize(
    "sim", [(f, b, 4096) for f, b in FORMATS], indirect=True, ids=[f for f, _ in FORMATS]
)
async def test_published_keys_equal_kvcore_keys_for_the_same_prompt(
    nats_server: NatsServer, watcher: Watcher, sim: SimProcess
) -> None:
    rng = random.Random(sim.event_format)
    book = PromptBook(sim.event_format, sim.block_size)
    system = [rng.randrange(100, 5000) for _ in range(48)]
    async with running_sidecar(settings_for(sim, nats_server.url, watcher)):
        first = book.add(prompt(rng, system, 3))
        await sim.complete(first)
        await sim.complete(book.add(prompt(rng, system, 5)))
        salted = book.add(prompt(rng, [], 2), "tenant-a")
        await sim.complete(salted, "tenant-a")
        held = await converged(sim, book, watcher)
        assert set(block_keys(first, model="m")) <= held
        assert set(block_keys(salted, model="m", namespace="tenant-a")) <= held
        assert not set(block_keys(salted, model="m")) & held  # tenants never share keys
        assert watcher.mirror.gaps == 0


@pytest.mark.parametrize(
    "sim", [(f, b, 24 * 16 // b) for f, b in FORMATS], indirect=True, ids=[f for f, _ in FORMATS]
)
async def test_eviction_in_the_engine_shows_up_as_removal(
    nats_server: NatsServer, watcher: Watcher, sim: SimProcess
) -> None:
    rng = random.Random(7)
    book = PromptBook(sim.event_format, sim.block_size)
    async with running_sidecar(settings_for(sim, nats_server.url, watcher)) as service:
        first = book.add(prompt(rng, [], 8))
        await sim.complete(first)
        await converged(sim, book, watcher)
        assert set(block_keys(first, model="m")) <= watcher.mirror.gpu_keys()
        for _ in range(4):  # 4 x 8 blocks through a 24-block pool
            await sim.complete(book.add(prompt(rng, [], 8)))
        held = await converged(sim, book, watcher)
        assert not set(block_keys(first, model="m")) & held
        assert service.pipeline.stats.events_received.get("removed", 0) > 0


@pytest.mark.parametrize(
    "sim", [("vllm", 16, 4096), ("sglang", 1, 4096)], indirect=True, ids=["vllm", "sglang"]
)
async def test_a_paused_publisher_is_recovered_through_replay(
    nats_server: NatsServer, watcher: Watcher, sim: SimProcess
) -> None:
    rng = random.Random(8)
    book = PromptBook(sim.event_format, sim.block_size)
    async with running_sidecar(settings_for(sim, nats_server.url, watcher)) as service:
        await sim.complete(book.add(prompt(rng, [], 2)))
        await converged(sim, book, watcher)
        assert service.source is not None
        stats = service.source.stats
        replayed = stats.replayed_frames
        await sim.fault(pause_events=True)
        for _ in range(3):
            await sim.complete(book.add(prompt(rng, [], 3)))
        await sim.fault(pause_events=False)
        await sim.complete(book.add(prompt(rng, [], 1)))
        await converged(sim, book, watcher)
        # the paused batches came through the replay socket: asked for on the gap the
        # next live batch shows, or earlier by a probe (the engine's first contact, or a
        # quiet stream), whichever the timing gave
        assert stats.replayed_frames - replayed >= 3
        assert stats.frames_lost == 0 and not service.pipeline.state_incomplete


@pytest.mark.parametrize("sim", [("vllm", 16, 4096)], indirect=True, ids=["vllm"])
async def test_a_gap_replay_cannot_cover_is_reported_and_nothing_is_mis_keyed(
    nats_server: NatsServer, watcher: Watcher, sim: SimProcess
) -> None:
    rng = random.Random(9)
    book = PromptBook(sim.event_format, sim.block_size)
    # no probe while events are paused: one would replay the paused batches before they
    # are dropped (idle probes off; the first contact's probe answered before the pause)
    settings = settings_for(sim, nats_server.url, watcher, restart_probe_s=0)
    async with running_sidecar(settings) as service:
        base = book.add(prompt(rng, [], 2))
        await sim.complete(base)
        await converged(sim, book, watcher)
        stats = service.source.stats if service.source else None
        await wait_until(  # the start's catch-up and the first contact's probe
            lambda: (
                service.engine_status.up
                and stats is not None
                and stats.replays_ok + stats.replays_partial + stats.replays_failed >= 2
            )
        )
        await sim.fault(pause_events=True)
        longer = book.add(base[:32] + [rng.randrange(100, 5000) for _ in range(35)])
        await sim.complete(longer)  # extends base's chain: its events are lost
        await sim.fault(drop_replay=True)
        await sim.fault(pause_events=False)
        await sim.complete(book.add(longer[:64] + [7] * 19))  # child of a lost block
        await wait_until(lambda: any(a.state_incomplete for a in watcher.announces))
        assert service.source is not None and service.source.stats.frames_lost >= 1
        assert service.pipeline.mapper_stats.unknown_parents >= 1
        expected = book.router_keys(await sim.cached_hashes())
        assert watcher.mirror.gpu_keys() < expected  # keys missing, none wrong


@pytest.mark.parametrize(
    "sim", [(f, b, 4096) for f, b in FORMATS], indirect=True, ids=[f for f, _ in FORMATS]
)
async def test_engine_restart_replaces_the_published_state(
    nats_server: NatsServer, watcher: Watcher, sim: SimProcess
) -> None:
    rng = random.Random(10)
    book = PromptBook(sim.event_format, sim.block_size)
    async with running_sidecar(settings_for(sim, nats_server.url, watcher)) as service:
        await sim.complete(book.add(prompt(rng, [], 4)))
        await converged(sim, book, watcher)
        epoch = watcher.mirror.epoch
        await sim.fault(restart=True)
        await sim.complete(book.add(prompt(rng, [], 2)))
        await wait_until(lambda: watcher.mirror.epoch > epoch)
        await converged(sim, book, watcher)
        assert service.source is not None and service.source.stats.restarts == 1


@pytest.mark.parametrize("replay", [True, False], ids=["replay", "no-replay"])
async def test_an_engine_process_restart_with_no_new_events_empties_the_state(
    nats_server: NatsServer, watcher: Watcher, replay: bool
) -> None:
    """Found through replay (the probe when the engine is reachable again), or, the
    engine back without its replay socket, by its counters gone back: its first batch,
    the other news of a restart, may never come when no request reaches it."""
    ports = (free_port(), free_port(), free_port())
    sim = await SimProcess("vllm", ports=ports).start()
    book = PromptBook("vllm", 16)
    try:
        async with running_sidecar(settings_for(sim, nats_server.url, watcher)) as service:
            await sim.complete(book.add(prompt(random.Random(11), [], 4)))
            await converged(sim, book, watcher)
            status = service.engine_status  # a scrape saw the request in the counters
            await wait_until(
                lambda: status.load is not None and status.load.prefix_cache_queries > 0
            )
            epoch = watcher.mirror.epoch
            await sim.stop()
            sim.extra = () if replay else ("--replay-endpoint", "")
            await sim.start()  # same ports, empty cache, seq from 0, nothing published
            await wait_until(lambda: watcher.mirror.epoch > epoch)
            assert service.source is not None and service.source.stats.restarts == 1
            assert watcher.mirror.gpu_keys() == set() == await sim.cached_hashes()
    finally:
        await sim.stop()


@pytest.mark.parametrize(
    "sim", [("vllm", 16, 64), ("sglang", 1, 1024)], indirect=True, ids=["vllm", "sglang"]
)
async def test_a_restarted_sidecar_rebuilds_and_resyncs(
    nats_server: NatsServer, watcher: Watcher, sim: SimProcess
) -> None:
    rng = random.Random(12)
    book = PromptBook(sim.event_format, sim.block_size)
    settings = settings_for(sim, nats_server.url, watcher)
    async with running_sidecar(settings):
        for _ in range(3):
            await sim.complete(book.add(prompt(rng, [], 4)))
        await converged(sim, book, watcher)
    epoch = watcher.mirror.epoch
    for _ in range(4):  # while no sidecar runs; evicts some of the above
        await sim.complete(book.add(prompt(rng, [], 5)))
    async with running_sidecar(settings) as service:
        await wait_until(lambda: watcher.mirror.epoch > epoch)
        await converged(sim, book, watcher)
        watcher.mirror.keys.add(("GPU", 42))  # a stale belief the resync must erase
        done = watcher.mirror.snapshots_done
        reply = await watcher.resync(snapshot_id=5)
        assert reply.accepted and reply.epoch == service.outbox.epoch
        await wait_until(lambda: watcher.mirror.snapshots_done > done)
        await converged(sim, book, watcher)
        assert watcher.mirror.gaps == 0


def kill_nats(server: NatsServer) -> None:
    proc = server._proc  # the fixture class has no kill(); stop() would be a clean exit
    assert proc is not None
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    server.stop()


@pytest.mark.parametrize("sim", [("vllm-0.23", 16, 4096)], indirect=True, ids=["vllm-0.23"])
async def test_nats_killed_and_restarted_ends_with_the_engines_state(sim: SimProcess) -> None:
    nats_server = NatsServer().start()
    watcher = Watcher(nats_server.url)
    await watcher.start()
    rng = random.Random(13)
    book = PromptBook(sim.event_format, sim.block_size)
    try:
        settings = settings_for(sim, nats_server.url, watcher, max_buffer_events=3)
        async with running_sidecar(settings) as service:
            await sim.complete(book.add(prompt(rng, [], 3)))
            await converged(sim, book, watcher)
            kill_nats(nats_server)
            await wait_until(lambda: not service.link.connected)
            for _ in range(6):
                await sim.complete(book.add(prompt(rng, [], 2)))
            await wait_until(lambda: service.outbox.stats.events_dropped > 0)
            nats_server.workdir.mkdir(exist_ok=True)  # stop() removed it; same port again
            nats_server.start()
            await converged(sim, book, watcher)
    finally:
        await watcher.stop()
        nats_server.stop()


async def test_the_kvroute_sidecar_process_serves_health_and_publishes(
    nats_server: NatsServer, watcher: Watcher
) -> None:
    sim = await SimProcess("vllm").start()
    port = free_port()
    env = os.environ | {"KVROUTE_NATS_URL": nats_server.url}
    proc = await asyncio.create_subprocess_exec(
        str(Path(sys.executable).parent / "kvroute-sidecar"),
        "--engine-url",
        sim.http_url,
        "--engine-kind",
        "vllm",
        "--kv-events-endpoint",
        sim.events,
        "--replay-endpoint",
        sim.replay,
        "--replica-id",
        watcher.replica,
        "--model",
        "m",
        "--port",
        str(port),
        env=env,
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
    )
    book = PromptBook("vllm", 16)
    try:
        async with aiohttp.ClientSession() as session:
            async with asyncio.timeout(30):
                while True:
                    try:
                        async with session.get(f"http://127.0.0.1:{port}/healthz") as r:
                            if r.status == 200:
                                break
                    except aiohttp.ClientError:
                        pass
                    await asyncio.sleep(0.05)
            await sim.complete(book.add(prompt(random.Random(14), [], 3)))
            await converged(sim, book, watcher)
            async with session.get(f"http://127.0.0.1:{port}/metrics") as r:
                assert "kvroute_sidecar_router_keys 3.0" in await r.text()
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(proc.wait(), 30) == 0
        assert proc.stderr is not None
        last = (await proc.stderr.read()).decode().strip().splitlines()[-1]
        assert '"msg": "sidecar stopped"' in last
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
        await sim.stop()


@pytest.mark.parametrize(
    "sim", [("vllm", 16, 4096), ("sglang", 1, 4096)], indirect=True, ids=["vllm", "sglang"]
)
async def test_endpoints_are_discovered_from_the_engine(
    nats_server: NatsServer, watcher: Watcher, sim: SimProcess
) -> None:
    settings = sidecar_settings(
        engine_url=sim.http_url,
        engine_kind=engine_kind(sim.event_format),
        nats_url=nats_server.url,
        replica_id=watcher.replica,
    )
    book = PromptBook(sim.event_format, sim.block_size)
    async with running_sidecar(settings) as service:
        assert service.source is not None
        assert (service.source.config.endpoint, service.source.config.replay_endpoint) == (
            sim.events,
            sim.replay,
        )
        await wait_until(lambda: any(a.capacity_blocks for a in watcher.announces))
        announce = watcher.announces[-1]
        assert (announce.capacity_blocks, announce.engine_block_size) == (4096, sim.block_size)
        await sim.complete(book.add(prompt(random.Random(15), [], 3)))
        await converged(sim, book, watcher)


@pytest.mark.parametrize("sim", [("vllm", 16, 4096)], indirect=True, ids=["vllm"])
async def test_a_silent_engine_restart_is_found_by_the_idle_probe(
    nats_server: NatsServer, watcher: Watcher, sim: SimProcess
) -> None:
    """The engine restarts (cache emptied, seq from 0) without ever being unreachable and
    then publishes nothing: the idle probe finds it and the published state empties."""
    book = PromptBook(sim.event_format, sim.block_size)
    settings = settings_for(sim, nats_server.url, watcher, restart_probe_s=0.3)
    async with running_sidecar(settings) as service:
        await sim.complete(book.add(prompt(random.Random(16), [], 3)))
        await converged(sim, book, watcher)
        epoch = watcher.mirror.epoch
        await sim.fault(restart=True)
        await wait_until(lambda: watcher.mirror.epoch > epoch)
        assert watcher.mirror.gpu_keys() == set() == await sim.cached_hashes()
        assert service.source is not None and service.source.stats.restarts == 1


async def test_a_sidecar_started_before_its_engine_and_nats_catches_up(
    watcher_port_nats: NatsServer,
) -> None:
    """Pod start order is not guaranteed: the sidecar comes up first, then the engine,
    then NATS; nothing that happened in between is lost."""
    nats_server = watcher_port_nats
    ports = (free_port(), free_port(), free_port())
    replica = f"early{random.randrange(1 << 30)}"
    settings = sidecar_settings(
        engine_url=f"http://127.0.0.1:{ports[0]}",
        kv_events_endpoint=f"tcp://127.0.0.1:{ports[1]}",
        replay_endpoint=f"tcp://127.0.0.1:{ports[2]}",
        nats_url=nats_server.url,
        replica_id=replica,
        restart_probe_s=0.3,
    )
    book = PromptBook("vllm", 16)
    async with running_sidecar(settings) as service:
        assert not service.ready
        sim = await SimProcess("vllm", ports=ports).start()
        try:
            await sim.complete(book.add(prompt(random.Random(17), [], 4)))
            await wait_until(lambda: service.pipeline.mapper.router_keys == 4)
            nats_server.start()
            watcher = Watcher(nats_server.url, replica=replica)
            await watcher.start()
            try:
                await wait_until(lambda: service.link.connected)
                reply = await watcher.resync(snapshot_id=3)  # as a control plane that
                assert reply.accepted  # starts after the sidecar asks for its state
                await converged(sim, book, watcher)
                await wait_until(lambda: service.ready)
            finally:
                await watcher.stop()
        finally:
            await sim.stop()


@pytest.fixture
def watcher_port_nats() -> AsyncIterator[NatsServer]:
    """A NATS server with its port chosen but not started yet."""
    server = NatsServer()
    yield server  # type: ignore[misc]
    server.stop()


async def test_an_https_engine_is_scraped_over_tls_trusting_only_the_given_ca(
    nats_server: NatsServer, watcher: Watcher, tmp_path: Path
) -> None:
    """An engine serving HTTPS (``--ssl-keyfile``/``--ssl-certfile``): with
    ``--engine-tls-ca`` the sidecar reads its load over TLS and announces the https://
    URL proxies will call; with the system's roots alone the test CA's certificate is
    refused, and the sidecar says the engine is down rather than read it in plain HTTP."""
    ca, cert, key = server_certificate(tmp_path, "127.0.0.1", "localhost")
    ca_path = tmp_path / "ca.pem"
    ca.cert_pem.write_to_path(str(ca_path))
    sim = await SimProcess("vllm", extra=(f"--ssl-keyfile={key}", f"--ssl-certfile={cert}")).start()
    try:
        assert sim.http_url.startswith("https://127.0.0.1:")
        async with running_sidecar(settings_for(sim, nats_server.url, watcher)):
            await wait_until(lambda: len(watcher.loads) >= 3)
            assert not any(load.engine_up for load in watcher.loads)
        watcher.loads.clear()
        trusting = settings_for(sim, nats_server.url, watcher, engine_tls_ca=ca_path)
        async with running_sidecar(trusting) as service:
            await wait_until(lambda: any(load.engine_up for load in watcher.loads))
            assert service.engine_status.load is not None
            assert service.engine_status.load.capacity_blocks == sim.num_blocks
            await wait_until(lambda: bool(watcher.announces))
            assert watcher.announces[-1].base_url == sim.http_url
    finally:
        await sim.stop()


@pytest.mark.parametrize("sim", [("vllm", 16, 4096)], indirect=True, ids=["vllm"])
async def test_the_announced_url_is_the_advertised_host_with_the_engines_port(
    nats_server: NatsServer, watcher: Watcher, sim: SimProcess
) -> None:
    """As in a pod: the sidecar reads the engine on loopback and announces it to the
    control plane (and so to every proxy) at the pod's address."""
    port = sim.http_url.rsplit(":", 1)[1]
    settings = settings_for(sim, nats_server.url, watcher, advertise_host="10.20.30.40")
    async with running_sidecar(settings) as service:
        await wait_until(lambda: bool(watcher.announces) and service.engine_status.up)
        assert watcher.announces[-1].base_url == f"http://10.20.30.40:{port}"


@pytest.mark.parametrize(
    "sim",
    [("sglang", 1, 4096, ("--disaggregation-mode", "prefill"))],
    indirect=True,
    ids=["sglang-prefill"],
)
async def test_an_sglang_prefill_server_is_announced_as_prefill_with_its_bootstrap_port(
    nats_server: NatsServer, watcher: Watcher, sim: SimProcess
) -> None:
    async with running_sidecar(settings_for(sim, nats_server.url, watcher)):
        await wait_until(lambda: any(a.role for a in watcher.announces))
        announce = watcher.announces[-1]
        assert announce.role == events_pb2.REPLICA_ROLE_PREFILL
        assert announce.bootstrap_port == int(sim.http_url.rsplit(":", 1)[1])


@pytest.mark.parametrize("sim", [("vllm", 16, 4096)], indirect=True, ids=["vllm"])
async def test_the_role_flag_names_a_vllm_decode_replica(
    nats_server: NatsServer, watcher: Watcher, sim: SimProcess
) -> None:
    """vLLM does not tell its ``kv_role`` over HTTP: the sidecar's flag says it."""
    async with running_sidecar(settings_for(sim, nats_server.url, watcher, role="decode")):
        await wait_until(lambda: bool(watcher.announces))
        assert watcher.announces[-1].role == events_pb2.REPLICA_ROLE_DECODE


@pytest.mark.parametrize(
    "sim",
    [("sglang", 1, 4096, ("--disaggregation-mode", "decode"))],
    indirect=True,
    ids=["sglang-decode"],
)
async def test_an_sglang_decode_server_that_publishes_nothing_stays_up_on_its_load_reports(
    nats_server: NatsServer, watcher: Watcher, sim: SimProcess
) -> None:
    """SGLang's decode server keeps no radix cache by default, so it publishes no KV
    event, ever: the sidecar still announces it as a decode replica, stays ready, keeps
    one epoch (its idle probes of the replay socket find no restart) and reports its
    load, which is what the proxy picks a decode replica by."""
    settings = settings_for(sim, nats_server.url, watcher, restart_probe_s=0.2)
    async with running_sidecar(settings) as service:
        await wait_until(lambda: any(a.role for a in watcher.announces))
        assert watcher.announces[-1].role == events_pb2.REPLICA_ROLE_DECODE
        epoch = service.epoch
        await sim.fault(hold_steps=True)
        request = asyncio.create_task(sim.complete(list(range(100, 400))))
        # the request is queued behind the held steps: the load report counts it
        await wait_until(lambda: bool(watcher.loads) and watcher.loads[-1].waiting == 1)
        await sim.fault(hold_steps=False)
        await request
        seen = len(watcher.loads)
        await wait_until(lambda: len(watcher.loads) >= seen + 5)  # > 2 idle probe periods
        assert watcher.loads[-1].engine_up and watcher.loads[-1].running == 0
        assert service.ready and service.epoch == epoch
        assert {load.epoch for load in watcher.loads[seen:]} == {epoch}
        assert watcher.mirror.gpu_keys() == set() and await sim.cached_hashes() == set()


@pytest.mark.parametrize(
    "sim", [("vllm", 16, 4096), ("sglang", 1, 4096)], indirect=True, ids=["vllm", "sglang"]
)
async def test_load_reports_carry_the_engines_own_prefill_timing(
    sim: SimProcess, nats_server: NatsServer, watcher: Watcher
) -> None:
    """Three 67-token prompts, the second sharing the first's 48 leading tokens: the
    engine times three prefills (vLLM when each finishes, SGLang at its first token),
    computing 67 + 19 + 67 tokens (the 48 cached excluded), and its load reports
    carry the running totals for the proxies to difference."""
    book = PromptBook(sim.event_format, sim.block_size)
    rng = random.Random(21)
    first = prompt(rng, [], 4)
    async with running_sidecar(settings_for(sim, nats_server.url, watcher)):
        for tokens in (first, [*first[:48], *prompt(rng, [], 1)], prompt(rng, [], 4)):
            await sim.complete(book.add(tokens))
        await wait_until(lambda: bool(watcher.loads) and watcher.loads[-1].prefill_requests == 3)
        last = watcher.loads[-1]
        assert last.prefill_computed_tokens == 67 + 19 + 67
        assert last.prefill_seconds >= 0 and last.queue_seconds >= 0
