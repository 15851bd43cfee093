"""Pipeline: frames in, router events out; bad frames never disturb the good ones."""

from __future__ import annotations

import random

import msgspec
import pytest

from kvcore.engine_events import EngineEvent
from kvcore.keys import block_keys
from sidecar.adapters import adapter_for
from sidecar.adapters.encoders import FORMATS, encode_batch
from sidecar.errors import FrameError
from sidecar.outbox import Outbox, OutboxConfig
from sidecar.pipeline import Pipeline
from sidecar.zmq_source import EngineRestarted, Frame, FramesLost, HistoryReplay
from tests.unit.sidecar.support import FakeCache, ResidencyMirror


def make_pipeline(engine: str = "vllm", block_size: int = 16) -> Pipeline:
    epochs = iter(range(2, 1000))
    return Pipeline(
        adapter=adapter_for(engine),
        model="m",
        router_block_size=block_size,
        outbox=Outbox(OutboxConfig(replica_id="r", pool="p"), epoch=1),
        new_epoch=lambda: next(epochs),
    )


def publish_all(pipeline: Pipeline, mirror: ResidencyMirror) -> None:
    while (batch := pipeline.outbox.take_batch()) is not None:
        mirror.apply(batch.payload)


def frame(seq: int, events: list[EngineEvent], fmt: str) -> Frame:
    return Frame(b"", seq, encode_batch(events, fmt), 0)


def workload(cache: FakeCache, rng: random.Random, steps: int) -> list[list[EngineEvent]]:
    """Random prompts sharing prefixes, some salted, with evictions in between."""
    prefixes = [[rng.randrange(1000) for _ in range(rng.randrange(0, 64))] for _ in range(4)]
    batches: list[list[EngineEvent]] = []
    for _ in range(steps):
        tokens = rng.choice(prefixes) + [rng.randrange(1000) for _ in range(rng.randrange(80))]
        events: list[EngineEvent] = list(cache.store(tokens, rng.choice(["", "", "tenant-a"])))
        if rng.random() < 0.3:
            events += cache.evict(rng.randrange(1, 6))
        batches.append(events)
    return batches


@pytest.mark.parametrize(
    ("fmt", "engine_bs", "router_bs"),
    [
        ("vllm-0.23", 16, 16),
        ("vllm-0.33", 16, 16),
        ("vllm-0.33-bytes", 32, 16),
        ("sglang-0.5.23", 1, 16),
        ("sglang-0.5.19", 4, 16),
    ],
)
def test_published_state_equals_the_engine_cache_in_router_keys(
    fmt: str, engine_bs: int, router_bs: int
) -> None:
    cache, rng = FakeCache(engine_bs), random.Random(fmt)
    pipeline, mirror = make_pipeline(FORMATS[fmt].engine, router_bs), ResidencyMirror()
    for seq, events in enumerate(workload(cache, rng, 60)):
        pipeline.handle(frame(seq, events, fmt))
        publish_all(pipeline, mirror)
    assert mirror.gpu_keys() == cache.router_keys(router_bs)
    assert mirror.gaps == 0 and not pipeline.state_incomplete
    assert pipeline.mapper.engine_blocks == len(cache.blocks)


def mutate(payload: bytes, rng: random.Random) -> bytes:
    data = bytearray(payload)
    for _ in range(rng.randrange(1, 6)):
        action = rng.randrange(3)
        if action == 0 and data:
            data[rng.randrange(len(data))] = rng.randrange(256)
        elif action == 1 and data:
            del data[rng.randrange(len(data)) :]
        else:
            data.insert(rng.randrange(len(data) + 1), rng.randrange(256))
    return bytes(data)


def garbage(rng: random.Random) -> bytes:
    choices = [
        lambda: rng.randbytes(rng.randrange(64)),
        lambda: msgspec.msgpack.encode([rng.random(), [["BlockStored", [rng.random()], None]]]),
        lambda: msgspec.msgpack.encode([1.0, [["BlockRemoved", {"x": 1}]], "rank"]),
        lambda: msgspec.msgpack.encode({"ts": "now", "events": None}),
        lambda: msgspec.msgpack.encode([1.0, [["BlockStored", [1], 2, [3], 1, None]] * 3, 0]),
    ]
    return rng.choice(choices)()


def bad_frames(payload: bytes, rng: random.Random, wanted: int) -> list[bytes]:
    """``wanted`` frames derived from ``payload`` or random that carry no valid event.

    A mutant that still decodes into valid events is, to any decoder, a different good
    frame (msgpack has no checksum), so it is not a bad frame and is not used.
    """
    adapter, found = adapter_for("vllm"), []
    while len(found) < wanted:
        candidate = mutate(payload, rng) if rng.random() < 0.6 else garbage(rng)
        try:
            batch = adapter.decode(candidate)
        except FrameError:
            found.append(candidate)
            continue
        if batch.rejected and not batch.events:
            found.append(candidate)
    return found


def test_fuzz_thousands_of_bad_frames_never_leave_a_wrong_key() -> None:
    """Bad frames never stop the pipeline nor leave published a key the engine dropped:
    one that may have held removals withdraws the keys. Once the engine's state is known
    again (it clears its cache), the good frames are translated exactly as without noise."""
    rng = random.Random(1234)
    cache = FakeCache(16)
    good = [encode_batch(events, "vllm-0.33") for events in workload(cache, rng, 150)]
    clean, noisy = make_pipeline(), make_pipeline()
    clean_mirror, noisy_mirror = ResidencyMirror(), ResidencyMirror()
    bad_count = 0
    for seq, payload in enumerate(good):
        clean.handle(Frame(b"", seq, payload, 0))
        for bad in bad_frames(payload, rng, 20):
            noisy.handle(Frame(b"", seq, bad, 0))
            bad_count += 1
        noisy.handle(Frame(b"", seq, payload, 0))
        publish_all(clean, clean_mirror)
        publish_all(noisy, noisy_mirror)
        assert noisy_mirror.gpu_keys() <= clean_mirror.gpu_keys()
    assert bad_count == 3000
    skipped = sum(noisy.stats.frames_undecodable.values()) + sum(
        noisy.stats.events_rejected.values()
    )
    assert skipped >= bad_count and noisy.state_incomplete
    assert clean_mirror.gpu_keys() == cache.router_keys(16)
    after = [[cache.clear()], *workload(cache, rng, 30)]
    for seq, events in enumerate(after, len(good)):
        for pipeline, mirror in ((clean, clean_mirror), (noisy, noisy_mirror)):
            pipeline.handle(frame(seq, events, "vllm-0.33"))
            publish_all(pipeline, mirror)
    assert noisy_mirror.gpu_keys() == clean_mirror.gpu_keys() == cache.router_keys(16)
    assert noisy.mapper.engine_blocks == len(cache.blocks) and not noisy.state_incomplete


def test_engine_restart_clears_state_and_opens_a_new_epoch() -> None:
    pipeline, mirror = make_pipeline(), ResidencyMirror()
    cache = FakeCache(16)
    pipeline.handle(frame(0, list(cache.store(list(range(64)))), "vllm-0.23"))
    publish_all(pipeline, mirror)
    assert pipeline.handle(EngineRestarted(0))
    assert pipeline.outbox.epoch == 2 and pipeline.mapper.router_keys == 0
    fresh = FakeCache(16)
    pipeline.handle(frame(0, list(fresh.store(list(range(100, 132)))), "vllm-0.23"))
    publish_all(pipeline, mirror)
    assert mirror.epoch == 2 and mirror.gpu_keys() == fresh.router_keys(16)


def test_lost_frames_mark_the_state_incomplete_until_the_cache_is_cleared() -> None:
    pipeline = make_pipeline()
    pipeline.handle(FramesLost(0, 4))
    assert pipeline.state_incomplete
    pipeline.handle(frame(5, [FakeCache(16).clear()], "vllm-0.23"))
    assert not pipeline.state_incomplete


def test_unknown_parent_marks_incomplete_and_history_rebuilds_exactly() -> None:
    cache = FakeCache(16)
    frames = [
        frame(i, list(cache.store(list(range(i * 7, i * 7 + 64)))), "vllm-0.23") for i in range(5)
    ]
    frames.append(frame(5, list(cache.store(list(range(0, 96)))), "vllm-0.23"))
    pipeline, mirror = make_pipeline(), ResidencyMirror()
    assert pipeline.handle(frames[-1])  # its parent was stored in a frame never seen
    assert pipeline.state_incomplete and pipeline.mapper_stats.unknown_parents == 1
    list(pipeline.rebuild_steps(HistoryReplay(tuple(frames))))
    assert not pipeline.state_incomplete and pipeline.outbox.needs_snapshot
    for batch in pipeline.outbox.snapshot(pipeline.mapper.held(), 0):
        mirror.apply(batch.payload)
    assert mirror.gpu_keys() == cache.router_keys(16)


def test_a_restarted_rank_of_several_loses_only_its_blocks_in_the_same_epoch() -> None:
    pipeline, mirror = make_pipeline(), ResidencyMirror()
    pipeline.ranks = 2
    rank0, rank1 = FakeCache(16), FakeCache(16)
    pipeline.handle(frame(0, list(rank0.store(list(range(64)))), "vllm-0.23"), rank=0)
    pipeline.handle(frame(0, list(rank1.store(list(range(500, 564)))), "vllm-0.23"), rank=1)
    pipeline.handle(FramesLost(1, 1), rank=1)
    publish_all(pipeline, mirror)
    assert mirror.gpu_keys() == rank0.router_keys(16)  # rank 1's keys withdrawn, not rank 0's
    assert pipeline.state_incomplete
    later = list(range(700, 732))
    pipeline.handle(frame(2, list(rank1.store(later)), "vllm-0.23"), rank=1)
    publish_all(pipeline, mirror)
    assert mirror.gpu_keys() == rank0.router_keys(16) | set(block_keys(later, model="m"))
    pipeline.handle(EngineRestarted(0), rank=1)
    publish_all(pipeline, mirror)
    assert mirror.gpu_keys() == rank0.router_keys(16)
    assert pipeline.outbox.epoch == 1 and not pipeline.state_incomplete


def test_a_long_history_rebuilds_in_steps_that_leave_the_loop_free_between_them() -> None:
    cache, rng = FakeCache(16), random.Random(7)
    frames = tuple(
        frame(seq, events, "vllm-0.33") for seq, events in enumerate(workload(cache, rng, 50))
    )
    pipeline, mirror = make_pipeline(), ResidencyMirror()
    steps = pipeline.rebuild_steps(HistoryReplay(frames), chunk=20)
    done = [next(steps)]
    assert pipeline.state_incomplete, "a half-rebuilt state must be flagged as such"
    done += list(steps)
    assert done == [20, 40]  # the last 10 frames finish without another pause
    assert not pipeline.state_incomplete and pipeline.outbox.needs_snapshot
    for batch in pipeline.outbox.snapshot(pipeline.mapper.held(), 0):
        mirror.apply(batch.payload)
    assert mirror.gpu_keys() == cache.router_keys(16)


def stored_then(pipeline: Pipeline, mirror: ResidencyMirror, cache: FakeCache) -> None:
    pipeline.handle(frame(0, list(cache.store(list(range(64)))), "vllm-0.23"))
    publish_all(pipeline, mirror)
    assert mirror.gpu_keys() == cache.router_keys(16) != set()


def test_a_lost_range_without_history_withdraws_the_ranks_keys() -> None:
    """The lost batches may have evicted anything: what was held must go, not linger."""
    pipeline, mirror, cache = make_pipeline(), ResidencyMirror(), FakeCache(16)
    stored_then(pipeline, mirror, cache)
    cache.evict(2)  # inside the lost range: the sidecar never sees these removals
    pipeline.handle(FramesLost(1, 3))
    publish_all(pipeline, mirror)
    assert pipeline.state_incomplete
    assert mirror.gpu_keys() == set() and pipeline.mapper.router_keys == 0


def test_after_a_loss_later_stores_are_keyed_again_from_what_arrives() -> None:
    pipeline, mirror, cache = make_pipeline(), ResidencyMirror(), FakeCache(16)
    stored_then(pipeline, mirror, cache)
    pipeline.handle(FramesLost(1, 3))
    longer = list(range(64)) + list(range(1000, 1032))  # extends a block stored before
    pipeline.handle(frame(4, list(cache.store(longer)), "vllm-0.23"))
    fresh = FakeCache(16)
    pipeline.handle(frame(5, list(fresh.store(list(range(500, 532)))), "vllm-0.23"))
    publish_all(pipeline, mirror)
    tail_keys = set(block_keys(longer, model="m")[4:])
    assert mirror.gpu_keys() == tail_keys | fresh.router_keys(16)
    assert pipeline.state_incomplete


def test_an_undecodable_frame_withdraws_and_marks_the_state_incomplete() -> None:
    pipeline, mirror, cache = make_pipeline(), ResidencyMirror(), FakeCache(16)
    stored_then(pipeline, mirror, cache)
    pipeline.handle(Frame(b"", 1, b"\xc1 not msgpack", 0))  # it may have held removals
    publish_all(pipeline, mirror)
    assert pipeline.state_incomplete and mirror.gpu_keys() == set()


def test_a_rejected_removal_withdraws_and_marks_the_state_incomplete() -> None:
    pipeline, mirror, cache = make_pipeline(), ResidencyMirror(), FakeCache(16)
    stored_then(pipeline, mirror, cache)
    bad = msgspec.msgpack.encode([1.0, [["BlockRemoved", "not-a-list", "GPU", 0]], 0])
    pipeline.handle(Frame(b"", 1, bad, 0))
    publish_all(pipeline, mirror)
    assert pipeline.stats.events_rejected == {"bad_hash": 1}
    assert pipeline.state_incomplete and mirror.gpu_keys() == set()


def test_a_rejected_store_only_misses_its_keys() -> None:
    pipeline, mirror, cache = make_pipeline(), ResidencyMirror(), FakeCache(16)
    stored_then(pipeline, mirror, cache)
    bad = msgspec.msgpack.encode([1.0, [["BlockStored", [9], None, [1, 2], 16]], 0])
    pipeline.handle(Frame(b"", 1, bad, 0))
    publish_all(pipeline, mirror)
    assert mirror.gpu_keys() == cache.router_keys(16) and not pipeline.state_incomplete


def test_a_history_with_an_undecodable_frame_keeps_nothing_from_before_it() -> None:
    cache = FakeCache(16)
    first = frame(0, list(cache.store(list(range(64)))), "vllm-0.23")
    evicted = list(cache.evict(4))  # this frame reaches the sidecar corrupted
    later = frame(2, list(cache.store(list(range(300, 332)))), "vllm-0.23")
    history = HistoryReplay((first, Frame(b"", 1, b"\xc1", 0), later))
    pipeline, mirror = make_pipeline(), ResidencyMirror()
    list(pipeline.rebuild_steps(history))
    for batch in pipeline.outbox.snapshot(pipeline.mapper.held(), 0):
        mirror.apply(batch.payload)
    assert evicted and pipeline.state_incomplete
    assert (
        mirror.gpu_keys()
        == cache.router_keys(16)
        == set(block_keys(list(range(300, 332)), model="m"))
    )


def test_sglang_unchained_era_is_refused_in_the_state_and_the_log(
    caplog: pytest.LogCaptureFixture,
) -> None:
    pipeline, mirror = make_pipeline("sglang"), ResidencyMirror()
    old = msgspec.msgpack.encode([1.0, [["BlockStored", [5, 6], None, [3, 3], 1, None]], 0])
    pipeline.handle(Frame(b"", 0, old, 0))
    pipeline.handle(Frame(b"", 1, old, 0))
    publish_all(pipeline, mirror)
    assert mirror.gpu_keys() == set() and pipeline.mapper.router_keys == 0
    assert pipeline.state_incomplete
    assert pipeline.refusal is not None and "0.5.10" in pipeline.refusal
    refused = [
        r for r in caplog.records if r.levelname == "ERROR" and "without its parent" in r.message
    ]
    assert len(refused) == 1  # said once, clearly
