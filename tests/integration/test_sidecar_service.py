"""The sidecar with real NATS and a fake engine (exact ZMQ protocol, frames from the
encoders): what it publishes equals what the engine holds, through every failure."""

from __future__ import annotations

import os
import random
import signal
import time
from collections.abc import AsyncIterator
from types import SimpleNamespace

import pytest
from aiohttp.test_utils import TestClient, TestServer

from kvcore.engine_events import EngineEvent
from kvroute.servers import NatsServer
from sidecar.adapters.encoders import encode_batch
from sidecar.observability import create_app
from tests.integration.sidecar_harness import (
    EngineHttpStub,
    Watcher,
    running_sidecar,
    sidecar_settings,
    wait_until,
)
from tests.unit.sidecar.fake_engine import FakeEngine
from tests.unit.sidecar.support import FakeCache

pytestmark = pytest.mark.integration


@pytest.fixture
async def engine() -> AsyncIterator[FakeEngine]:
    async with FakeEngine() as fake:
        yield fake


def settings_for(engine: FakeEngine, nats_url: str, watcher: Watcher, **extra: object):  # type: ignore[no-untyped-def]
    return sidecar_settings(
        kv_events_endpoint=engine.endpoint,
        replay_endpoint=engine.replay_endpoint,
        nats_url=nats_url,
        replica_id=watcher.replica,
        **extra,
    )


def prompts(rng: random.Random, n: int) -> list[list[int]]:
    system = [rng.randrange(30_000) for _ in range(40)]
    return [system + [rng.randrange(30_000) for _ in range(rng.randrange(100))] for _ in range(n)]


async def feed(engine: FakeEngine, events: list[EngineEvent], fmt: str = "vllm-0.23") -> None:
    if events:
        await engine.publish(encode_batch(events, fmt))


@pytest.mark.parametrize(
    ("fmt", "engine_bs"), [("vllm-0.23", 16), ("vllm-0.33", 16), ("sglang-0.5.23", 1)]
)
async def test_published_keys_are_the_proxys_keys_and_evictions_are_removals(
    nats_server: NatsServer, watcher: Watcher, fmt: str, engine_bs: int
) -> None:
    engine_kind = fmt.split("-")[0]
    async with (
        FakeEngine() as engine,
        running_sidecar(settings_for(engine, nats_server.url, watcher, engine_kind=engine_kind)),
    ):
        cache = FakeCache(engine_bs)
        for tokens in prompts(random.Random(fmt), 6):
            await feed(engine, list(cache.store(tokens)), fmt)
        await wait_until(lambda: watcher.mirror.gpu_keys() == cache.router_keys(16))
        assert watcher.mirror.gpu_keys()
        await feed(engine, list(cache.evict(40)), fmt)
        await wait_until(lambda: watcher.mirror.gpu_keys() == cache.router_keys(16))
        assert watcher.mirror.gaps == 0


async def test_a_paused_engine_publisher_is_recovered_by_replay(
    nats_server: NatsServer, watcher: Watcher, engine: FakeEngine
) -> None:
    async with running_sidecar(settings_for(engine, nats_server.url, watcher)) as service:
        cache = FakeCache(16)
        rng = random.Random(3)
        await feed(engine, list(cache.store(prompts(rng, 1)[0])))
        engine.paused = True
        for tokens in prompts(rng, 5):
            await feed(engine, list(cache.store(tokens)))
        engine.paused = False
        await feed(engine, list(cache.evict(3)))
        await wait_until(lambda: watcher.mirror.gpu_keys() == cache.router_keys(16))
        assert service.source is not None and service.source.stats.gaps == 1
        assert not service.pipeline.state_incomplete


async def test_a_gap_replay_cannot_cover_is_reported_and_nothing_is_mis_keyed(
    nats_server: NatsServer, watcher: Watcher
) -> None:
    async with (
        FakeEngine(buffer_steps=1) as engine,
        running_sidecar(settings_for(engine, nats_server.url, watcher)) as service,
    ):
        cache = FakeCache(16)
        rng = random.Random(4)
        base = prompts(rng, 1)[0]
        await feed(engine, list(cache.store(base)))
        engine.paused = True
        await feed(engine, list(cache.store(base + list(range(64)))))  # lost for good
        await feed(engine, list(cache.store(prompts(rng, 1)[0])))  # unrelated, lost too
        engine.paused = False
        await feed(engine, list(cache.store(base + list(range(64)) + list(range(5, 37)))))
        await wait_until(lambda: any(a.state_incomplete for a in watcher.announces))
        assert service.source is not None and service.source.stats.frames_lost == 2
        assert service.pipeline.mapper_stats.unknown_parents == 1  # its parent was lost
        assert watcher.mirror.gpu_keys() < cache.router_keys(16)  # missing, never wrong


async def test_engine_restart_opens_a_new_epoch_with_the_new_cache(
    nats_server: NatsServer, watcher: Watcher, engine: FakeEngine
) -> None:
    async with running_sidecar(settings_for(engine, nats_server.url, watcher)) as service:
        await feed(engine, list(FakeCache(16).store(list(range(64)))))
        await wait_until(lambda: len(watcher.mirror.gpu_keys()) == 4)
        first_epoch = watcher.mirror.epoch
        engine.restart()
        fresh = FakeCache(16)
        await feed(engine, list(fresh.store(list(range(500, 532)))))
        await wait_until(lambda: watcher.mirror.gpu_keys() == fresh.router_keys(16))
        assert watcher.mirror.epoch > first_epoch
        assert service.outbox.epoch == watcher.mirror.epoch


async def test_a_restarted_sidecar_rebuilds_from_replay_and_answers_resync(
    nats_server: NatsServer, watcher: Watcher, engine: FakeEngine
) -> None:
    cache = FakeCache(16)
    settings = settings_for(engine, nats_server.url, watcher)
    async with running_sidecar(settings):
        for tokens in prompts(random.Random(5), 4):
            await feed(engine, list(cache.store(tokens)))
        await wait_until(lambda: watcher.mirror.gpu_keys() == cache.router_keys(16))
    first_epoch = watcher.mirror.epoch
    await feed(engine, list(cache.evict(5)))  # while no sidecar runs
    async with running_sidecar(settings) as service:
        await wait_until(lambda: watcher.mirror.epoch > first_epoch)
        await wait_until(lambda: watcher.mirror.gpu_keys() == cache.router_keys(16))
        watcher.mirror.keys.add(("GPU", 12345))  # a control plane's stale belief
        done_before = watcher.mirror.snapshots_done
        reply = await watcher.resync(snapshot_id=77)
        assert reply.accepted and reply.epoch == service.outbox.epoch
        await wait_until(lambda: watcher.mirror.snapshots_done == done_before + 1)
        assert watcher.mirror.gpu_keys() == cache.router_keys(16)
        assert watcher.mirror.gaps == 0


async def test_a_resync_is_followed_by_an_announce_at_once(
    nats_server: NatsServer, watcher: Watcher, engine: FakeEngine
) -> None:
    """A control plane that restarted asks every replica it hears from for a resync; the
    announce that follows gives it the replica's base URL without waiting a period."""
    settings = settings_for(engine, nats_server.url, watcher, announce_interval_s=3600)
    async with running_sidecar(settings):
        await wait_until(lambda: bool(watcher.announces))
        asked_at = time.time()
        assert (await watcher.resync(snapshot_id=5)).accepted
        await wait_until(lambda: any(a.ts >= asked_at for a in watcher.announces))
        assert watcher.announces[-1].base_url == settings.engine_url


async def test_nats_killed_and_restarted_ends_with_the_engines_state(
    watcher_free_nats: NatsServer, engine: FakeEngine
) -> None:
    nats_server = watcher_free_nats
    watcher = Watcher(nats_server.url)
    await watcher.start()
    cache = FakeCache(16)
    rng = random.Random(6)
    settings = settings_for(engine, nats_server.url, watcher, max_buffer_events=5)
    async with running_sidecar(settings) as service:
        await feed(engine, list(cache.store(prompts(rng, 1)[0])))
        await wait_until(lambda: watcher.mirror.gpu_keys() == cache.router_keys(16))
        kill_nats(nats_server)
        await wait_until(lambda: not service.link.connected)
        for tokens in prompts(rng, 12):
            await feed(engine, list(cache.store(tokens)))
        await feed(engine, list(cache.evict(4)))
        await wait_until(lambda: service.outbox.stats.events_dropped > 0)
        nats_server.workdir.mkdir(exist_ok=True)  # stop() removed it; same port again
        nats_server.start()
        await wait_until(lambda: watcher.mirror.gpu_keys() == cache.router_keys(16), 15)
        assert watcher.mirror.snapshots_done >= 1
    await watcher.stop()


def kill_nats(server: NatsServer) -> None:
    """SIGKILL, as a crash would: no goodbye to the clients."""
    proc = server._proc  # the fixture class has no kill(); stop() would be a clean exit
    assert proc is not None
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    server.stop()


@pytest.fixture
def watcher_free_nats() -> AsyncIterator[NatsServer]:
    server = NatsServer().start()
    yield server  # type: ignore[misc]
    server.stop()


PING_S = 0.5  # the sidecar's NATS ping interval here: a silent link is dead within 1.5 s
NOTICED_S = 15.0  # a bound on a failure under load; nats-py's default pings took 6 min


async def test_a_nats_server_that_stops_answering_is_noticed_and_the_state_republished(
    watcher_free_nats: NatsServer, engine: FakeEngine
) -> None:
    """nats-server stopped (SIGSTOP: the connection stays open, nothing answers, what a
    partition looks like): the sidecar's pings go unanswered, it declares the link dead
    (its /readyz and metric say so) and reconnects once the server answers again, then
    publishes the state it kept meanwhile."""
    nats_server = watcher_free_nats
    watcher = Watcher(nats_server.url)
    await watcher.start()
    cache = FakeCache(16)
    rng = random.Random(46)
    settings = settings_for(engine, nats_server.url, watcher, nats_ping_interval_s=PING_S)
    proc = nats_server._proc  # the fixture class has no pause(); SIGSTOP it directly
    assert proc is not None
    async with running_sidecar(settings) as service:
        await feed(engine, list(cache.store(prompts(rng, 1)[0])))
        await wait_until(lambda: watcher.mirror.gpu_keys() == cache.router_keys(16))
        os.kill(proc.pid, signal.SIGSTOP)
        try:
            await wait_until(lambda: not service.link.connected, NOTICED_S)
            assert not service.ready
            for tokens in prompts(rng, 3):  # while it cannot publish: kept, not lost
                await feed(engine, list(cache.store(tokens)))
        finally:
            os.kill(proc.pid, signal.SIGCONT)
        await wait_until(lambda: service.link.connected)
        await wait_until(lambda: watcher.mirror.gpu_keys() == cache.router_keys(16))
    await watcher.stop()


async def test_announce_load_health_and_metrics(
    nats_server: NatsServer, watcher: Watcher, engine: FakeEngine
) -> None:
    http = EngineHttpStub()
    await http.start()
    settings = settings_for(engine, nats_server.url, watcher, engine_url=http.url)
    async with running_sidecar(settings) as service:
        await wait_until(lambda: bool(watcher.loads) and watcher.loads[-1].engine_up)
        load = watcher.loads[-1]
        assert (load.running, load.waiting, load.kv_usage) == (3, 2, 0.25)
        assert (load.prefix_cache_queries, load.prefix_cache_hits) == (1000, 400)
        await wait_until(lambda: bool(watcher.announces))
        announce = watcher.announces[-1]
        assert (announce.model, announce.block_size, announce.sidecar_epoch) == (
            "m",
            16,
            service.epoch,
        )
        app = create_app(service)
        async with TestClient(TestServer(app)) as client:
            await wait_until(lambda: service.ready)
            health = await client.get("/healthz")
            assert health.status == 200 and (await health.json())["ready"]
            await feed(engine, list(FakeCache(16).store(list(range(48)))))
            await wait_until(lambda: len(watcher.mirror.gpu_keys()) == 3)
            text = await (await client.get("/metrics")).text()
            assert "kvroute_sidecar_events_published_total 1.0" in text
            assert 'kvroute_sidecar_events_received_total{type="stored"} 1.0' in text
            assert "kvroute_sidecar_router_keys 3.0" in text
            assert "kvroute_sidecar_publish_latency_seconds_count 1.0" in text
            http.up = False
            await wait_until(lambda: not service.ready)
            assert (await client.get("/healthz")).status == 503
            await wait_until(lambda: bool(watcher.loads) and not watcher.loads[-1].engine_up)
    await http.stop()


async def test_shutdown_flushes_what_was_received(
    nats_server: NatsServer, watcher: Watcher, engine: FakeEngine
) -> None:
    cache = FakeCache(16)
    settings = settings_for(engine, nats_server.url, watcher, batch_delay_ms=500)
    async with running_sidecar(settings) as service:
        await wait_until(lambda: service.link.connected)
        await feed(engine, list(cache.store(list(range(160)))))  # goes out at once
        await wait_until(lambda: watcher.mirror.gpu_keys() == cache.router_keys(16))
        await feed(engine, list(cache.store(list(range(1000, 1160)))))
        await wait_until(lambda: service.outbox.depth > 0)  # waiting on the 500 ms deadline
    await wait_until(lambda: watcher.mirror.gpu_keys() == cache.router_keys(16))
    assert len(watcher.mirror.gpu_keys()) == 20


async def test_a_corrupted_store_is_repaired_from_the_engines_history(
    nats_server: NatsServer, watcher: Watcher, engine: FakeEngine
) -> None:
    """A store arrives corrupted on the live socket (undecodable): the sidecar withdraws
    the keys (the frame might have held removals) and rebuilds from the replay buffer,
    which holds the frame intact; the store's child is then keyed from its parent."""
    async with running_sidecar(settings_for(engine, nats_server.url, watcher)) as service:
        cache = FakeCache(16)
        await feed(engine, list(cache.store(list(range(64)))))
        parent_store = encode_batch(list(cache.store(list(range(96)))), "vllm-0.23")
        await engine.publish(parent_store, on_the_wire=b"\xc1garbage")
        await feed(engine, list(cache.store(list(range(160)))))
        await wait_until(lambda: service.pipeline.stats.rebuilds == 1)
        await wait_until(lambda: watcher.mirror.gpu_keys() == cache.router_keys(16))
        assert service.pipeline.stats.frames_undecodable == {"malformed_msgpack": 1}
        assert service.pipeline.mapper_stats.withdrawals == 1
        assert not service.pipeline.state_incomplete
        await wait_until(lambda: not watcher.announces[-1].state_incomplete)


async def test_fuzzed_live_stream_never_stops_the_sidecar_nor_leaves_a_wrong_key(
    nats_server: NatsServer, watcher: Watcher, engine: FakeEngine
) -> None:
    """Random and mutated payloads (each with its own seq), wrong frame counts and bad
    seq frames on the live socket, between the good batches of a real workload. A payload
    that cannot be read may have held removals, so keys are withdrawn (missing, never
    wrong); once the engine clears its cache, the good frames are translated exactly."""
    rng = random.Random(99)
    cache = FakeCache(16)
    async with running_sidecar(settings_for(engine, nats_server.url, watcher)) as service:
        bad = 0
        for tokens in prompts(rng, 60):
            events = list(cache.store(tokens)) + list(cache.evict(rng.randrange(3)))
            good = encode_batch(events, "vllm-0.33")
            for _ in range(10):
                kind = rng.randrange(4)
                if kind == 0:
                    await engine.publish(rng.randbytes(rng.randrange(40)))
                elif kind == 1:
                    await engine.publish(good[: rng.randrange(len(good))])
                elif kind == 2:
                    await engine.send_raw([b"kv", rng.randbytes(rng.choice([0, 3, 9]))])
                else:
                    await engine.send_raw([b"kv", b"\x00" * 7, good])
                bad += 1
            await engine.publish(good)
        await feed(engine, [cache.clear()], "vllm-0.33")
        for tokens in prompts(rng, 5):
            await feed(engine, list(cache.store(tokens)), "vllm-0.33")
        await wait_until(lambda: watcher.mirror.gpu_keys() == cache.router_keys(16))
        source = service.source
        assert source is not None and bad == 600
        sent = bad + 60 + 1 + 5  # a replayed history may deliver the last ones first
        await wait_until(lambda: source.stats.frames_received == sent)
        skipped = (
            sum(source.stats.frames_rejected.values())
            + sum(service.pipeline.stats.frames_undecodable.values())
            + sum(service.pipeline.stats.events_rejected.values())
        )
        assert skipped >= bad and service.pipeline.mapper_stats.withdrawals >= 1
        assert source.stats.gaps == 0 and not service.pipeline.state_incomplete


async def test_data_parallel_ranks_are_one_replica(
    nats_server: NatsServer, watcher: Watcher
) -> None:
    """Two engine streams (DP ranks) given as comma-separated endpoints: the replica holds
    the union of their caches; one rank restarting takes only its own blocks away."""
    async with FakeEngine() as rank0, FakeEngine() as rank1:
        settings = sidecar_settings(
            kv_events_endpoint=f"{rank0.endpoint},{rank1.endpoint}",
            replay_endpoint=f"{rank0.replay_endpoint},{rank1.replay_endpoint}",
            nats_url=nats_server.url,
            replica_id=watcher.replica,
        )
        async with running_sidecar(settings) as service:
            await wait_until(lambda: all(s.caught_up.is_set() for s in service.sources))
            cache0, cache1 = FakeCache(16), FakeCache(16)
            shared = list(range(64))
            await feed(rank0, list(cache0.store(shared)))
            await feed(rank1, list(cache1.store(shared)))
            await feed(rank1, list(cache1.store(list(range(900, 964)))))
            both = cache0.router_keys(16) | cache1.router_keys(16)
            await wait_until(lambda: watcher.mirror.gpu_keys() == both)
            epoch = watcher.mirror.epoch
            rank1.restart()
            fresh1 = FakeCache(16)
            await feed(rank1, list(fresh1.store(list(range(3000, 3032)))))
            after = cache0.router_keys(16) | fresh1.router_keys(16)
            await wait_until(lambda: watcher.mirror.gpu_keys() == after)
            assert watcher.mirror.epoch == epoch and watcher.mirror.gaps == 0


async def test_a_bug_on_one_frame_is_counted_and_the_sidecar_carries_on(
    nats_server: NatsServer, watcher: Watcher, engine: FakeEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A (simulated, one-off) sidecar bug on one frame: counted, the state flagged and
    rebuilt from the engine's replay, and the frames after it translated as ever."""
    cache = FakeCache(16)
    first = encode_batch(list(cache.store(list(range(64)))), "vllm-0.23")
    async with running_sidecar(settings_for(engine, nats_server.url, watcher)) as service:
        real_decode = service.pipeline.adapter.decode
        failures = iter([RuntimeError("a bug")])

        def buggy_once(payload: bytes):  # type: ignore[no-untyped-def]
            if payload == first and (failure := next(failures, None)) is not None:
                raise failure
            return real_decode(payload)

        monkeypatch.setattr(service.pipeline, "adapter", SimpleNamespace(decode=buggy_once))
        await engine.publish(first)
        await feed(engine, list(cache.store(list(range(96)))))
        await wait_until(lambda: watcher.mirror.gpu_keys() == cache.router_keys(16))
        assert service.pipeline.stats.internal_errors == 1
        assert service.pipeline.stats.rebuilds == 1 and not service.pipeline.state_incomplete


async def test_sglang_unchained_era_is_refused_in_the_announce(
    nats_server: NatsServer, watcher: Watcher, engine: FakeEngine
) -> None:
    """SGLang 0.4.8-0.5.5 page hashes are not chained: nothing is keyed, and the announce
    says so (state incomplete, and why in a label) rather than leaving routers guessing."""
    settings = settings_for(engine, nats_server.url, watcher, engine_kind="sglang")
    async with running_sidecar(settings) as service:
        await feed(engine, list(FakeCache(1).store(list(range(40)))), "sglang-0.5.5")
        await wait_until(lambda: service.pipeline.refusal is not None)
        await wait_until(lambda: bool(watcher.announces) and watcher.announces[-1].state_incomplete)
        reason = watcher.announces[-1].labels["kvroute.io/keys-refused"]
        assert "SGLang 0.4.8-0.5.5" in reason and "0.5.10" in reason
        assert watcher.mirror.gpu_keys() == set()


async def test_a_stopping_sidecar_announces_its_replica_draining_first(
    nats_server: NatsServer, watcher: Watcher, engine: FakeEngine
) -> None:
    """A pod's termination (SIGTERM) drains the replica: proxies send it nothing new."""
    settings = settings_for(engine, nats_server.url, watcher, drain_s=0.2)
    async with running_sidecar(settings):
        await wait_until(lambda: bool(watcher.announces))
        assert not watcher.announces[-1].draining
    await wait_until(lambda: watcher.announces[-1].draining)
