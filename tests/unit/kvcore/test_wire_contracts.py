"""The protobuf contracts carry what the components rely on, at the limits that matter."""

from __future__ import annotations

from kvcore.pb import events_pb2, routing_pb2

MAX_KEY = 2**64 - 1


def test_block_keys_survive_the_wire_at_full_64_bits() -> None:
    batch = events_pb2.KvEventBatch(replica_id="r", pool="p", epoch=1, seq=0)
    stored = batch.events.add().stored
    stored.parent_key = MAX_KEY
    stored.keys.extend([0, 2**63, MAX_KEY])
    batch.events.add().removed.keys.append(2**63 + 1)
    batch.events.add().cleared.SetInParent()
    decoded = events_pb2.KvEventBatch.FromString(batch.SerializeToString())
    kinds = [e.WhichOneof("kind") for e in decoded.events]
    assert kinds == ["stored", "removed", "cleared"], "event order must be preserved"
    assert list(decoded.events[0].stored.keys) == [0, 2**63, MAX_KEY]
    assert decoded.events[0].stored.parent_key == MAX_KEY


def test_a_run_from_the_root_has_no_parent_key() -> None:
    stored = events_pb2.BlocksStored(keys=[5])
    decoded = events_pb2.BlocksStored.FromString(stored.SerializeToString())
    assert not decoded.HasField("parent_key")
    with_zero = events_pb2.BlocksStored(parent_key=0, keys=[5])
    assert events_pb2.BlocksStored.FromString(with_zero.SerializeToString()).HasField("parent_key")


def test_fixed64_keys_cost_eight_bytes_each_so_chunks_can_be_sized() -> None:
    keys = list(range(2**63, 2**63 + 100_000))
    chunk = routing_pb2.SnapshotChunk(residency=[routing_pb2.ReplicaBlocks(ordinal=1, keys=keys)])
    size = len(chunk.SerializeToString())
    assert 800_000 <= size <= 800_016


def test_state_update_is_either_a_snapshot_chunk_or_a_delta() -> None:
    update = routing_pb2.StateUpdate(epoch=3, version=10)
    update.delta.residency.add(ordinal=2, cleared=True, added=[1, 2])
    assert update.WhichOneof("body") == "delta"
    update.snapshot.last_chunk = True
    assert update.WhichOneof("body") == "snapshot"
