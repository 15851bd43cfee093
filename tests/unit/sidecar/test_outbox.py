"""Outbox: contiguous seq, bounded buffer, and snapshots that rebuild the exact state."""

from __future__ import annotations

from kvcore.pb import events_pb2
from sidecar.key_mapper import RouterCleared, RouterRemoved, RouterStored
from sidecar.outbox import Outbox, OutboxConfig, chain_runs
from tests.unit.sidecar.support import ResidencyMirror


def outbox(**overrides: int) -> Outbox:
    return Outbox(OutboxConfig(replica_id="r1", pool="p", **overrides), epoch=7)


def drain(box: Outbox, mirror: ResidencyMirror) -> list[events_pb2.KvEventBatch]:
    batches = []
    while (batch := box.take_batch()) is not None:
        mirror.apply(batch.payload)
        batches.append(events_pb2.KvEventBatch.FromString(batch.payload))
    return batches


def test_batches_carry_contiguous_seq_and_events_in_order() -> None:
    box, mirror = outbox(max_batch_events=2), ResidencyMirror()
    box.add([RouterStored((1, 2), None), RouterStored((3,), 2), RouterRemoved((3,))], 0)
    box.add([RouterCleared(), RouterStored((9,), None, "CPU")], 0)
    batches = drain(box, mirror)
    assert [b.seq for b in batches] == [0, 1, 2]
    assert {(b.replica_id, b.pool, b.epoch) for b in batches} == {("r1", "p", 7)}
    assert batches[0].events[1].stored.parent_key == 2
    assert not batches[0].events[0].stored.HasField("parent_key")
    assert mirror.keys == {("CPU", 9)} and mirror.gaps == 0


def test_long_stores_are_split_and_stay_chained() -> None:
    box, mirror = outbox(max_event_keys=3), ResidencyMirror()
    box.add([RouterStored(tuple(range(1, 9)), None)], 0)
    (batch,) = drain(box, mirror)
    stores = [e.stored for e in batch.events]
    assert [list(s.keys) for s in stores] == [[1, 2, 3], [4, 5, 6], [7, 8]]
    assert [s.parent_key for s in stores[1:]] == [3, 6]
    assert mirror.gpu_keys() == set(range(1, 9))


def test_a_full_buffer_drops_the_oldest_and_asks_for_a_snapshot() -> None:
    box = outbox(max_pending_events=3)
    box.add([RouterStored((k,), None) for k in range(5)], 0)
    assert box.depth == 3 and box.stats.events_dropped == 2 and box.needs_snapshot


def test_the_buffer_is_bounded_in_keys_too() -> None:
    box = outbox(max_pending_keys=10)
    box.add([RouterStored(tuple(range(k * 4, k * 4 + 4)), None) for k in range(4)], 0)
    assert (box.depth, box.depth_keys, box.stats.events_dropped) == (2, 8, 2)
    batch = box.take_batch()
    assert batch is not None and box.depth_keys == 0


def test_snapshot_replaces_state_and_continues_the_seq() -> None:
    box, mirror = outbox(snapshot_batch_keys=4), ResidencyMirror()
    box.add([RouterStored((100,), None)], 0)
    drain(box, mirror)
    box.add([RouterStored((5,), None)], 0)  # pending: already part of the state below
    held = [("GPU", k, k - 1 if k > 1 else None) for k in range(1, 11)] + [("CPU", 50, None)]
    snapshot = box.snapshot(held, snapshot_id=42)
    assert box.depth == 0 and not box.needs_snapshot
    assert [b.seq for b in snapshot] == [1, 2, 3]
    for batch in snapshot:
        mirror.apply(batch.payload)
    decoded = [events_pb2.KvEventBatch.FromString(b.payload) for b in snapshot]
    assert all(b.snapshot and b.snapshot_id == 42 for b in decoded)
    assert [b.snapshot_done for b in decoded] == [False, False, True]
    assert mirror.keys == {("GPU", k) for k in range(1, 11)} | {("CPU", 50)}
    box.add([RouterRemoved((1,))], 0)
    drain(box, mirror)
    assert ("GPU", 1) not in mirror.keys and mirror.gaps == 0


def test_empty_snapshot_is_one_done_batch() -> None:
    box, mirror = outbox(), ResidencyMirror(keys={("GPU", 1)})
    (only,) = box.snapshot([], snapshot_id=1)
    mirror.epoch = 7
    mirror.apply(only.payload)
    assert mirror.keys == set() and mirror.snapshots_done == 1


def test_new_epoch_restarts_seq_and_forgets_pending() -> None:
    box = outbox()
    box.add([RouterStored((1,), None)], 0)
    box.take_batch()
    box.add([RouterStored((2,), None)], 0)
    box.new_epoch(8)
    assert box.depth == 0
    box.add([RouterStored((3,), None)], 0)
    batch = box.take_batch()
    assert batch is not None
    decoded = events_pb2.KvEventBatch.FromString(batch.payload)
    assert (decoded.epoch, decoded.seq) == (8, 0)


def test_chain_runs_groups_consecutive_chained_keys() -> None:
    held = [("GPU", 1, None), ("GPU", 2, 1), ("GPU", 3, 2), ("GPU", 9, 1), ("CPU", 4, 3)]
    assert list(chain_runs(held)) == [
        RouterStored((1, 2, 3), None),
        RouterStored((9,), 1),
        RouterStored((4,), 3, "CPU"),
    ]
