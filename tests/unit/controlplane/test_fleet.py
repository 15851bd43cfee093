"""The fleet follows the sidecar's stream semantics exactly (docs/architecture.md)."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from controlplane.fleet.fleet import Fleet, ReplicaRecord
from controlplane.fleet.fleet_view import LiveFleetView
from kvcore.pb import events_pb2
from tests.unit.controlplane.support import announce, batch, load, snapshot_parts


class Recorder:
    def __init__(self) -> None:
        self.asked: list[tuple[str, str]] = []

    def __call__(self, record: ReplicaRecord, reason: str, snapshot_id: int) -> None:
        self.asked.append((record.replica_id, reason))


@pytest.fixture
def resyncs() -> Recorder:
    return Recorder()


@pytest.fixture
def fleet(resyncs: Recorder) -> Fleet:
    return Fleet(heartbeat_timeout_s=5.0, resync_retry_s=0.0, resync=resyncs)


def held(fleet: Fleet, replica: str = "r1") -> set[int]:
    return set(fleet.index.keys_of(fleet.by_id[replica].ordinal))


def feed(fleet: Fleet, *batches: events_pb2.KvEventBatch) -> None:
    for b in batches:
        fleet.on_batch(b, b.pool, 0.0)


def test_a_stream_from_seq_0_is_applied_in_order_without_resync(
    fleet: Fleet, resyncs: Recorder
) -> None:
    feed(fleet, batch(0, stored=[[1, 2, 3]]), batch(1, removed=[2]), batch(2, stored=[[4]]))
    assert held(fleet) == {1, 3, 4}
    assert resyncs.asked == []
    assert fleet.stats.block_events == 5


def test_duplicates_and_stale_epochs_are_ignored(fleet: Fleet) -> None:
    feed(fleet, batch(0, epoch=5, stored=[[1]]), batch(0, epoch=5, stored=[[9]]))
    feed(fleet, batch(7, epoch=4, stored=[[8]]))
    assert held(fleet) == {1}
    assert fleet.stats.batches_ignored == 2


def test_other_tiers_are_not_residency(fleet: Fleet) -> None:
    feed(fleet, batch(0, stored=[[1]], medium=events_pb2.MEDIUM_CPU), batch(1, stored=[[2]]))
    assert held(fleet) == {2}


def test_a_gap_asks_for_a_resync_and_the_snapshot_replaces(fleet: Fleet, resyncs: Recorder) -> None:
    feed(fleet, batch(0, stored=[[1, 2]]), batch(2, stored=[[3]]))  # seq 1 lost
    assert resyncs.asked == [("r1", "seq gap")]
    assert held(fleet) == {1, 2, 3}  # best effort until the snapshot
    feed(fleet, *snapshot_parts(3, [[1, 5], [6]], snapshot_id=7))
    assert held(fleet) == {1, 5, 6}
    feed(fleet, batch(5, stored=[[7]]))
    assert held(fleet) == {1, 5, 6, 7}
    assert fleet.by_id["r1"].stream.exact
    assert len(resyncs.asked) == 1


def test_a_higher_epoch_replaces_and_seq_0_needs_no_resync(fleet: Fleet, resyncs: Recorder) -> None:
    feed(fleet, batch(0, epoch=1, stored=[[1, 2]]))
    feed(fleet, batch(0, epoch=2, cleared=True), batch(1, epoch=2, stored=[[3]]))
    assert held(fleet) == {3}
    assert resyncs.asked == []


def test_a_higher_epoch_joined_late_clears_and_resyncs(fleet: Fleet, resyncs: Recorder) -> None:
    feed(fleet, batch(0, epoch=1, stored=[[1, 2]]), batch(4, epoch=2, stored=[[3]]))
    assert held(fleet) == {3}  # the old epoch's keys may be wrong: gone
    assert resyncs.asked and "new epoch" in resyncs.asked[0][1]


def test_an_unknown_stream_resyncs_and_waits_for_a_whole_snapshot(
    fleet: Fleet, resyncs: Recorder
) -> None:
    parts = snapshot_parts(10, [[1], [2], [3]], snapshot_id=4)
    feed(fleet, parts[1], parts[2])  # joined in the middle: cannot be used
    assert held(fleet) == set()
    assert resyncs.asked
    record = fleet.by_id["r1"]
    asked = record.stream.asked_ids[-1]
    fleet.on_resync_reply(record, asked, 1, 20)
    feed(fleet, *snapshot_parts(20, [[4], [5]], snapshot_id=asked))
    assert held(fleet) == {4, 5}
    assert record.stream.exact


def test_our_snapshot_before_its_reply_is_held_until_the_reply_places_it(
    fleet: Fleet, resyncs: Recorder
) -> None:
    fleet.on_announce(announce(), now=0.0)
    record = fleet.by_id["r1"]
    first = record.stream.asked_ids[-1]
    fleet.retry_resyncs()  # asked again before the first snapshot came
    assert len(resyncs.asked) == 2
    feed(fleet, *snapshot_parts(40, [[1], [2]], snapshot_id=first), batch(42, stored=[[3]]))
    assert held(fleet) == set() and record.held is not None
    fleet.on_resync_reply(record, first, 1, 40)
    assert held(fleet) == {1, 2, 3}
    assert record.stream.exact and record.held is None


def test_a_part_is_never_taken_for_the_first_on_its_id_alone(
    fleet: Fleet, resyncs: Recorder
) -> None:
    fleet.on_announce(announce(), now=0.0)
    record = fleet.by_id["r1"]
    asked = record.stream.asked_ids[-1]
    parts = snapshot_parts(40, [[1], [2]], snapshot_id=asked)
    feed(fleet, parts[1])  # the first part was lost
    fleet.on_resync_reply(record, asked, 1, 40)
    assert held(fleet) == set() and not record.stream.exact
    assert resyncs.asked[-1][1].startswith("unknown stream")


def test_without_a_reply_held_batches_are_released_and_resynced(
    fleet: Fleet, resyncs: Recorder
) -> None:
    fleet.on_announce(announce(), now=0.0)
    record = fleet.by_id["r1"]
    feed(fleet, *snapshot_parts(40, [[1], [2]], snapshot_id=record.stream.asked_ids[-1]))
    fleet.retry_resyncs()  # resync_retry_s is 0 here: the reply is overdue
    assert record.held is None and held(fleet) == set()
    assert len(resyncs.asked) >= 2


def test_an_unsolicited_snapshot_following_the_stream_replaces(fleet: Fleet) -> None:
    feed(fleet, batch(0, stored=[[1, 2]]), *snapshot_parts(1, [[2, 3]]), batch(2, removed=[3]))
    assert held(fleet) == {2}


def test_a_lost_snapshot_part_abandons_it(fleet: Fleet, resyncs: Recorder) -> None:
    parts = snapshot_parts(1, [[5], [6], [7]])
    feed(fleet, batch(0, stored=[[1]]), parts[0], parts[2])
    assert held(fleet) == {1}
    assert resyncs.asked == [("r1", "snapshot part lost")]


def test_a_silent_replica_goes_down_in_steps_and_returns_on_announce(
    fleet: Fleet, resyncs: Recorder
) -> None:
    fleet.on_announce(announce(), now=0.0)
    feed(fleet, batch(0, stored=[list(range(1, 101))]))
    fleet.on_load(load(), "default", now=1.0)
    fleet.on_announce(announce("r2"), now=6.0)  # one of two silent: evidence about r1
    assert fleet.expire(now=5.0) == []
    gone = fleet.expire(now=6.5)
    assert [r.replica_id for r in gone] == ["r1"]
    steps = list(fleet.drop_steps(gone[0], chunk=10))
    assert len(steps) > 5
    assert fleet.index.key_count() == 0
    view = LiveFleetView(fleet)
    assert view.replicas()[0].status == "down" and not view.replicas()[0].stale
    fleet.on_announce(announce(), now=7.0)
    assert view.replicas()[0].status == "healthy"
    assert resyncs.asked[-1] == ("r1", "unknown stream")


def test_changes_are_net_per_replica(fleet: Fleet) -> None:
    feed(fleet, batch(0, stored=[[1, 2]]))
    fleet.changes.take()
    feed(fleet, batch(1, removed=[1]), batch(2, stored=[[1, 3]]), batch(3, removed=[3]))
    net = fleet.changes.take().residency[0]
    assert (net.cleared, net.added, net.removed) == (False, {1}, {3})


async def test_view_for_explain_and_the_admin_api(fleet: Fleet) -> None:
    fleet.on_announce(announce("a"), now=0.0)
    fleet.on_announce(announce("b", pool="other"), now=0.0)
    feed(fleet, batch(0, stored=[[1, 2]], replica="a"))
    feed(fleet, batch(0, stored=[[1]], replica="b", pool="other"))
    fleet.on_load(load("a", running=3), "default", now=0.0)
    view = LiveFleetView(fleet)
    summary = await view.residency_summary()
    assert summary.total_keys == 2 and summary.per_replica == {"a": 2, "b": 1}
    assert [(p.key, set(p.holders)) for p in summary.most_shared] == [(1, {"a", "b"})]
    state = view.state_view("default")
    assert [r.replica_id for r in state.replicas()] == ["a"]
    assert state.replicas()[0].running == 3
    assert state.leading_runs([1, 2], now=None)[fleet.by_id["a"].ordinal] == 2


async def test_the_residency_summary_of_many_keys_lets_events_in_while_it_ranks(
    fleet: Fleet,
) -> None:
    """An operator asking for the most shared keys of a large index does not stop the
    control plane: events that arrive meanwhile are applied before the answer, which
    ranks every key (the same as ranking them all at once)."""
    for name in "abcd":
        fleet.on_announce(announce(name), now=0.0)
        feed(fleet, batch(0, stored=[[1]], replica=name))
    ordinals = [fleet.by_id[name].ordinal for name in "abcd"]
    keys = np.arange(2, 600_002, dtype=np.uint64)
    fleet.index.add(ordinals[0], keys)  # 600,000 keys, some held by more replicas
    fleet.index.add(ordinals[1], keys[::1000])
    fleet.index.add(ordinals[2], keys[::7000])
    view = LiveFleetView(fleet)
    view.summary_rows = 65_536  # (pieces of the ~1M-slot table)
    late = batch(1, stored=[[900_001, 900_002]], replica="d")

    async def events_meanwhile() -> int:
        feed(fleet, late)
        return fleet.index.key_count(ordinals[3])

    arriving = asyncio.ensure_future(events_meanwhile())
    summary = await view.residency_summary(top=50)
    assert arriving.done() and arriving.result() == 3
    assert summary.total_keys == 600_003 and summary.per_replica["d"] == 3
    held, masks = fleet.index.residency()  # ranked at once: the most holders first
    expected = held[np.argsort(-np.bitwise_count(masks).sum(axis=1), kind="stable")][:50]
    assert [p.key for p in summary.most_shared] == expected.tolist()
    assert set(summary.most_shared[0].holders) == {"a", "b", "c", "d"}
    assert {len(p.holders) for p in summary.most_shared[1:]} == {3}


async def test_drain_is_persisted_then_seen(fleet: Fleet) -> None:
    persisted = []

    class Store:
        async def persist_draining(self, pool: str, replica_id: str, draining: bool) -> None:
            persisted.append((pool, replica_id, draining))

    fleet.on_announce(announce(), now=0.0)
    view = LiveFleetView(fleet, drains=Store())
    info = await view.set_draining("r1", True)
    assert info.status == "draining" and persisted == [("default", "r1", True)]
    from controlplane.contracts import UnknownReplica

    with pytest.raises(UnknownReplica):
        await view.set_draining("nope", True)
