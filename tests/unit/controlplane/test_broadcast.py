"""Versions, the delta ring, snapshots in chunks and slow watchers, without a network."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from bench.controlplane.mirror import StateMirror
from controlplane.fleet.broadcast import Broadcaster, EmptyConfig
from controlplane.fleet.fleet import Fleet
from controlplane.fleet.routing_server import RoutingStateService
from kvcore.pb import routing_pb2
from tests.unit.controlplane.support import announce, batch, load


def make(**options: int) -> tuple[Fleet, Broadcaster]:
    fleet = Fleet(heartbeat_timeout_s=5.0)
    return fleet, Broadcaster(fleet, EmptyConfig(), **options)


def apply_all(mirror: StateMirror, updates: list[bytes]) -> None:
    for data in updates:
        mirror.apply(routing_pb2.StateUpdate.FromString(data))


def fleet_keys(fleet: Fleet) -> dict[int, set[int]]:
    return {o: set(fleet.index.keys_of(o)) for o in fleet.by_ordinal if fleet.index.keys_of(o)}


def mirror_keys(mirror: StateMirror) -> dict[int, set[int]]:
    return {o: keys for o, keys in mirror.residency.items() if keys}


async def test_snapshot_then_consecutive_deltas_give_the_fleets_state() -> None:
    fleet, broadcaster = make()
    fleet.on_announce(announce("a"), now=0.0)
    fleet.on_batch(batch(0, stored=[[1, 2, 3]], replica="a"), "default", 0.0)
    watcher, first = broadcaster.watch(None, 0, 0)
    mirror = StateMirror()
    apply_all(mirror, first)  # cut before the pending changes were flushed
    fleet.on_batch(batch(1, removed=[2], replica="a"), "default", 0.0)
    fleet.on_load(load("a", running=7), "default", 0.0)
    broadcaster.flush()
    broadcaster.flush()  # a heartbeat: an empty delta, one version on
    apply_all(mirror, await watcher.next_batch())
    assert mirror_keys(mirror) == fleet_keys(fleet) == {0: {1, 3}}
    assert mirror.replicas[0].load.running == 7
    assert mirror.version == broadcaster.version == 2


async def test_the_covering_version_is_the_one_a_proxy_must_hold_to_see_every_change() -> None:
    """``/v1/replicas`` names it: a change applied now reaches proxies in the next
    version, so that is the one named until it is published."""
    fleet, broadcaster = make()
    watcher, first = broadcaster.watch(None, 0, 0)
    mirror = StateMirror()
    apply_all(mirror, first)
    assert broadcaster.covering() == (mirror.epoch, mirror.version)  # nothing pending
    fleet.on_batch(batch(0, stored=[[1, 2]], replica="a"), "default", 0.0)
    epoch, version = broadcaster.covering()
    assert (epoch, version) == (mirror.epoch, mirror.version + 1)
    broadcaster.flush()
    apply_all(mirror, await watcher.next_batch())
    assert (mirror.epoch, mirror.version) == (epoch, version) == broadcaster.covering()
    assert mirror.keys_of("a") == {1, 2}


async def test_a_watcher_sees_only_its_pools() -> None:
    fleet, broadcaster = make()
    fleet.on_batch(batch(0, stored=[[1]], replica="a", pool="p1"), "p1", 0.0)
    fleet.on_batch(batch(0, stored=[[2]], replica="b", pool="p2"), "p2", 0.0)
    watcher, first = broadcaster.watch(frozenset({"p2"}), 0, 0)
    mirror = StateMirror()
    apply_all(mirror, first)
    fleet.on_batch(batch(1, stored=[[3]], replica="a", pool="p1"), "p1", 0.0)
    fleet.on_batch(batch(1, stored=[[4]], replica="b", pool="p2"), "p2", 0.0)
    broadcaster.flush()
    apply_all(mirror, await watcher.next_batch())
    assert {r.replica_id for r in mirror.replicas.values()} == {"b"}
    assert mirror.keys_of("b") == {2, 4}
    assert mirror_keys(mirror) == {1: {2, 4}}


def test_a_recent_version_resumes_from_the_ring_and_an_old_one_gets_a_snapshot() -> None:
    fleet, broadcaster = make(ring=3)
    mirror = StateMirror()
    watcher, first = broadcaster.watch(None, 0, 0)
    apply_all(mirror, first)
    broadcaster.unwatch(watcher)
    for seq in range(2):
        fleet.on_batch(batch(seq, stored=[[seq + 10]]), "default", 0.0)
        broadcaster.flush()
    _, missed = broadcaster.watch(None, mirror.epoch, mirror.version)
    assert [routing_pb2.StateUpdate.FromString(d).WhichOneof("body") for d in missed] == [
        "delta",
        "delta",
    ]
    apply_all(mirror, missed)
    assert mirror.keys_of("r1") == {10, 11}
    for seq in range(2, 6):
        fleet.on_batch(batch(seq, stored=[[seq + 10]]), "default", 0.0)
        broadcaster.flush()
    _, again = broadcaster.watch(None, mirror.epoch, mirror.version)
    assert routing_pb2.StateUpdate.FromString(again[0]).WhichOneof("body") == "snapshot"
    _, other_epoch = broadcaster.watch(None, mirror.epoch + 1, broadcaster.version)
    assert routing_pb2.StateUpdate.FromString(other_epoch[0]).WhichOneof("body") == "snapshot"


def test_a_large_snapshot_comes_in_chunks_below_the_limit() -> None:
    fleet, broadcaster = make(chunk_bytes=64 * 1024)
    for r in range(3):
        fleet.on_announce(announce(f"r{r}"), now=0.0)
        keys = list(range(r * 10_000, r * 10_000 + 20_000))  # overlapping holders
        fleet.on_batch(batch(0, stored=[keys], replica=f"r{r}"), "default", 0.0)
    chunks = broadcaster.snapshot(None)
    assert len(chunks) >= 60_000 * 8 // (64 * 1024)  # 60,000 keys held, 8 bytes each
    assert max(len(c) for c in chunks) < 64 * 1024
    mirror = StateMirror()
    apply_all(mirror, chunks)
    assert mirror_keys(mirror) == fleet_keys(fleet)
    assert len(mirror.replicas) == 3


async def test_a_slow_watcher_is_dropped_and_the_others_keep_receiving() -> None:
    fleet, broadcaster = make(queue=4)
    slow, _ = broadcaster.watch(None, 0, 0)
    fast, _ = broadcaster.watch(None, 0, 0)
    for seq in range(6):
        fleet.on_batch(batch(seq, stored=[[seq]]), "default", 0.0)
        broadcaster.flush()
        await fast.next_batch()
    assert slow.dropped and not fast.dropped
    assert await slow.next_batch() == []
    assert broadcaster.watchers == {fast}
    assert broadcaster.stats.watchers_dropped == 1


@pytest.mark.parametrize("pools", [None, frozenset({"default"})])
def test_snapshots_are_cached_per_version(pools: frozenset[str] | None) -> None:
    fleet, broadcaster = make()
    fleet.on_batch(batch(0, stored=[[1]]), "default", 0.0)
    assert broadcaster.snapshot(pools) is broadcaster.snapshot(pools)
    broadcaster.flush()
    assert broadcaster.stats.snapshots == 1
    broadcaster.snapshot(pools)
    assert broadcaster.stats.snapshots == 2


async def test_a_failing_report_sink_neither_ends_the_stream_nor_counts_as_malformed() -> None:
    class Broken:
        calls = 0

        async def record(self, report: routing_pb2.ProxyReport) -> None:
            Broken.calls += 1
            if Broken.calls == 1:
                raise OSError("database is locked")

    _, broadcaster = make()
    service = RoutingStateService(broadcaster, Broken(), None)
    report = routing_pb2.ProxyReport(proxy_id="p").SerializeToString()

    async def reports() -> AsyncIterator[bytes]:
        for data in (report, report, b"\xff"):
            yield data

    ack = routing_pb2.ReportAck.FromString(await service.report(reports(), None))  # type: ignore[arg-type]
    assert ack.reports == 1
    stats = service.report_stats
    assert (stats.reports, stats.failed, stats.malformed) == (1, 1, 1)
