"""ZMQ source: in-order frames from a live engine stream, gaps replayed, restarts seen."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from sidecar.zmq_source import (
    EngineRestarted,
    Frame,
    FramesLost,
    HistoryReplay,
    SourceConfig,
    SourceItem,
    ZmqEventSource,
)
from tests.unit.sidecar.fake_engine import FakeEngine


class Reader:
    """Runs a source and collects what it yields."""

    def __init__(self, source: ZmqEventSource) -> None:
        self.source = source
        self.items: asyncio.Queue[SourceItem] = asyncio.Queue()
        self._task = asyncio.create_task(self._run())

    async def _run(self) -> None:
        async for item in self.source.items():
            await self.items.put(item)

    async def take(self, n: int, deadline_s: float = 5.0) -> list[SourceItem]:
        async with asyncio.timeout(deadline_s):
            return [await self.items.get() for _ in range(n)]

    async def stop(self) -> None:
        self.source.close()
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)


@pytest.fixture
async def engine() -> AsyncIterator[FakeEngine]:
    async with FakeEngine() as fake:
        yield fake


def source_for(engine: FakeEngine, **overrides: object) -> ZmqEventSource:
    config = SourceConfig(
        endpoint=engine.endpoint,
        replay_endpoint=engine.replay_endpoint,
        replay_timeout_s=0.5,
        **overrides,  # type: ignore[arg-type]
    )
    return ZmqEventSource(config)


async def started(engine: FakeEngine, source: ZmqEventSource) -> Reader:
    reader = Reader(source)
    await engine.wait_subscribed()
    async with asyncio.timeout(5):
        await source.caught_up.wait()
    return reader


def seqs(items: list[SourceItem]) -> list[int]:
    return [item.seq for item in items if isinstance(item, Frame)]


async def test_live_frames_arrive_in_order(engine: FakeEngine) -> None:
    reader = await started(engine, source_for(engine))
    for i in range(5):
        await engine.publish(b"p%d" % i)
    items = await reader.take(5)
    assert [(i.seq, i.payload, i.topic) for i in items] == [  # type: ignore[union-attr]
        (n, b"p%d" % n, b"kv@test") for n in range(5)
    ]
    await reader.stop()


async def test_a_burst_queued_while_the_reader_is_busy_arrives_whole_and_in_order(
    engine: FakeEngine,
) -> None:
    source = source_for(engine)
    reader = await started(engine, source)
    for i in range(500):  # all queued before the reader runs again: read without waiting
        await engine.publish(b"b%d" % i)
    items = await reader.take(500)
    assert [(i.seq, i.payload) for i in items] == [(n, b"b%d" % n) for n in range(500)]  # type: ignore[union-attr]
    assert source.stats.gaps == 0 and source.stats.frames_received == 500
    await engine.publish(b"after a quiet spell")  # and waiting works again afterwards
    assert seqs(await reader.take(1)) == [500]
    await reader.stop()


@pytest.mark.parametrize("framing", ["old", "new"])
async def test_a_gap_is_filled_from_the_replay_socket(framing: str) -> None:
    async with FakeEngine(framing=framing) as engine:  # type: ignore[arg-type]
        source = source_for(engine)
        reader = await started(engine, source)
        await engine.publish(b"a")
        assert seqs(await reader.take(1)) == [0]
        engine.paused = True
        await engine.publish(b"b")
        await engine.publish(b"c")
        engine.paused = False
        await engine.publish(b"d")
        items = await reader.take(3)
        assert [(i.seq, i.payload) for i in items] == [  # type: ignore[union-attr]
            (1, b"b"),
            (2, b"c"),
            (3, b"d"),
        ]
        assert all(i.replayed for i in items)  # type: ignore[union-attr]
        assert source.stats.gaps == 1 and source.stats.replays_ok >= 1
        await engine.publish(b"e")
        assert seqs(await reader.take(1)) == [4]
        assert source.stats.duplicates == 1  # live "d" arrived after the replay had it
        await reader.stop()


async def test_a_sidecar_started_late_catches_up_from_seq_0(engine: FakeEngine) -> None:
    for i in range(3):
        await engine.publish(b"old%d" % i)
    reader = await started(engine, source_for(engine))
    assert seqs(await reader.take(3)) == [0, 1, 2]
    await engine.publish(b"new")
    assert seqs(await reader.take(1)) == [3]
    await reader.stop()


async def test_what_replay_no_longer_holds_is_reported_lost() -> None:
    async with FakeEngine(buffer_steps=2) as engine:
        source = source_for(engine)
        reader = await started(engine, source)
        await engine.publish(b"first")
        assert seqs(await reader.take(1)) == [0]
        engine.paused = True
        for i in range(5):
            await engine.publish(b"x%d" % i)
        engine.paused = False
        await engine.publish(b"x5")
        items = await reader.take(3)
        assert items[0] == FramesLost(1, 4)
        assert seqs(items) == [5, 6]
        assert source.stats.frames_lost == 4
        await reader.stop()


async def test_without_replay_a_gap_is_reported_lost() -> None:
    async with FakeEngine(replay=False) as engine:
        reader = await started(engine, source_for(engine))
        await engine.publish(b"a")
        engine.paused = True
        await engine.publish(b"b")
        engine.paused = False
        await engine.publish(b"c")
        items = await reader.take(3)
        assert seqs(items) == [0, 2] and items[1] == FramesLost(1, 1)
        await reader.stop()


async def test_seq_going_backwards_is_an_engine_restart(engine: FakeEngine) -> None:
    source = source_for(engine)
    reader = await started(engine, source)
    for i in range(3):
        await engine.publish(b"before%d" % i)
    await reader.take(3)
    engine.restart()
    await engine.publish(b"after0")
    items = await reader.take(2)
    assert items[0] == EngineRestarted(0)
    assert (items[1].seq, items[1].payload) == (0, b"after0")  # type: ignore[union-attr]
    await reader.stop()


async def test_restart_probe_detects_a_restart_that_published_nothing(
    engine: FakeEngine,
) -> None:
    source = source_for(engine)
    reader = await started(engine, source)
    await engine.publish(b"before")
    await reader.take(1)
    engine.restart()
    source.request_restart_probe()
    assert await reader.take(1) == [EngineRestarted(0)]
    await reader.stop()


async def test_a_restart_told_by_the_engines_counters_ends_the_old_stream_at_once() -> None:
    """No replay socket: the new process's seq 0 is the first news of the restart through
    the events, and it may be long in coming. Counters that went back between two scrapes
    say so first; the new process's batches then follow from seq 0."""
    async with FakeEngine(replay=False) as engine:
        source = source_for(engine)
        reader = await started(engine, source)
        for i in range(3):
            await engine.publish(b"before%d" % i)
        await reader.take(3)
        source.mark()  # a scrape found the old process
        engine.restart()
        source.restarted_since_mark()  # the next one found its counters gone back
        assert await reader.take(1) == [EngineRestarted(2)]
        await engine.publish(b"after0")
        (item,) = await reader.take(1)
        assert (item.seq, item.payload) == (0, b"after0")  # type: ignore[union-attr]
        assert source.stats.restarts == 1
        await reader.stop()


async def test_a_restart_the_stream_saw_first_is_not_ended_twice(engine: FakeEngine) -> None:
    """The new process published before the scrape that found its counters gone back:
    the stream saw the restart itself, and what the new process published stays."""
    source = source_for(engine)
    reader = await started(engine, source)
    for i in range(3):
        await engine.publish(b"before%d" % i)
    await reader.take(3)
    source.mark()
    engine.restart()
    await engine.publish(b"after0")
    assert (await reader.take(2))[0] == EngineRestarted(0)
    source.restarted_since_mark()
    await engine.publish(b"after1")
    assert seqs(await reader.take(1)) == [1]
    assert source.stats.restarts == 1
    await reader.stop()


async def test_restart_probe_on_the_same_engine_changes_nothing(engine: FakeEngine) -> None:
    source = source_for(engine)
    reader = await started(engine, source)
    await engine.publish(b"before")
    await reader.take(1)
    source.request_restart_probe()
    await engine.publish(b"next")
    assert seqs(await reader.take(1)) == [1]
    assert source.stats.restarts == 0
    await reader.stop()


async def test_history_replay_returns_everything_from_seq_0(engine: FakeEngine) -> None:
    source = source_for(engine)
    reader = await started(engine, source)
    for i in range(3):
        await engine.publish(b"h%d" % i)
    await reader.take(3)
    source.request_history()
    (history,) = await reader.take(1)
    assert isinstance(history, HistoryReplay)
    assert [f.seq for f in history.frames] == [0, 1, 2]
    await reader.stop()


@pytest.mark.parametrize(
    ("parts", "reason"),
    [([b"t", b"\x00" * 8], "bad_frame_count"), ([b"t", b"\x01", b"p"], "bad_seq")],
)
async def test_malformed_messages_are_counted_and_skipped(
    engine: FakeEngine, parts: list[bytes], reason: str
) -> None:
    source = source_for(engine)
    reader = await started(engine, source)
    await engine.send_raw(parts)
    await engine.publish(b"good")
    assert seqs(await reader.take(1)) == [0]
    assert source.stats.frames_rejected == {reason: 1}
    await reader.stop()


async def test_bind_mode_lets_the_engine_connect() -> None:
    import zmq
    import zmq.asyncio

    from kvroute.servers import free_port

    endpoint = f"tcp://127.0.0.1:{free_port()}"
    source = ZmqEventSource(SourceConfig(endpoint=endpoint, bind=True))
    source.open()
    ctx = zmq.asyncio.Context()
    pub = ctx.socket(zmq.XPUB)
    pub.connect(endpoint)
    reader = Reader(source)
    async with asyncio.timeout(5):
        await pub.recv()  # the sidecar's subscription
    await pub.send_multipart([b"", (0).to_bytes(8, "big"), b"x"])
    assert seqs(await reader.take(1)) == [0]
    await reader.stop()
    pub.close(linger=0)
    ctx.destroy(linger=0)


async def test_a_probe_before_any_batch_catches_up_what_was_missed(engine: FakeEngine) -> None:
    """Batches published while the SUB socket was still connecting are fetched by a probe."""
    source = source_for(engine)
    reader = await started(engine, source)
    engine.paused = True  # as if sent before the subscription took effect
    await engine.publish(b"early")
    engine.paused = False
    source.request_restart_probe()
    items = await reader.take(1)
    assert seqs(items) == [0] and source.stats.restarts == 0
    await reader.stop()
