"""Snapshots whose residency comes as columns: the proxy loads them key for key, into
either index, and refuses a chunk whose buffers do not match its header, keeping what
it had until a good snapshot arrives."""

from __future__ import annotations

import numpy as np
import pytest

from controlplane.fleet.broadcast import Broadcaster, EmptyConfig
from controlplane.fleet.fleet import Fleet
from dataplane.epp.main import SettingsRefused as EppSettingsRefused
from dataplane.epp.main import load_settings as load_epp_settings
from dataplane.epp.service import EppService
from dataplane.errors import SnapshotNeeded
from dataplane.fleet.state import FleetState
from dataplane.main import SettingsRefused, load_settings
from dataplane.service import ProxyService
from kvcore.index import (
    NATIVE_LOOKUP,
    BitmaskResidencyIndex,
    CompactResidencyIndex,
    ResidencyIndex,
)
from kvcore.pb import events_pb2, routing_pb2
from tests.unit.dataplane.state_messages import MODEL, delta, replica, residency_change, snapshot

KEYS = [7, 8, 9, 10]


def _fleet(keys_per_replica: int) -> Fleet:
    """Three replicas; each holds its own keys and the first half of the next one's."""
    fleet = Fleet(heartbeat_timeout_s=60.0)
    for r in range(3):
        batch = events_pb2.KvEventBatch(replica_id=f"r{r}", pool="default", epoch=1, seq=0)
        keys = range(1 + r * keys_per_replica, 1 + (r + 1) * keys_per_replica)
        batch.events.add().stored.keys.extend(keys)
        if r:
            batch.events.add().stored.keys.extend(range(1, 1 + keys_per_replica // 2))
        fleet.on_batch(batch, "default", 0.0)
    return fleet


def _apply(state: FleetState, chunks: list[bytes]) -> None:
    for chunk in chunks:
        state.apply(routing_pb2.StateUpdate.FromString(chunk))


@pytest.mark.parametrize("index", [BitmaskResidencyIndex, CompactResidencyIndex])
def test_a_column_snapshot_in_many_chunks_arrives_key_for_key(
    index: type[ResidencyIndex],
) -> None:
    fleet = _fleet(20_000)
    broadcaster = Broadcaster(fleet, EmptyConfig(), chunk_bytes=64 * 1024)
    _, chunks = broadcaster.watch(None, 0, 0, columns=True)
    assert len(chunks) > 10
    assert all(len(c) < 64 * 1024 for c in chunks)
    state = FleetState(index=index)
    _apply(state, chunks)
    assert dict(state.replicas.index.holdings()) == dict(fleet.index.holdings())
    assert state.replicas.residency_keys() == fleet.index.key_count() == 60_000
    assert state.refused == state.ignored == 0


def test_the_old_form_is_sent_to_a_watcher_that_did_not_ask_for_columns() -> None:
    fleet = _fleet(100)
    broadcaster = Broadcaster(fleet, EmptyConfig())
    _, chunks = broadcaster.watch(None, 0, 0)
    update = routing_pb2.StateUpdate.FromString(chunks[0])
    assert not update.snapshot.HasField("residency_columns")
    assert sum(len(b.keys) for b in update.snapshot.residency) == 300 + 2 * 50
    state = FleetState()
    _apply(state, chunks)
    assert dict(state.replicas.index.holdings()) == dict(fleet.index.holdings())


def _column_snapshot(keys: list[int], masks: list[int], **header: int) -> routing_pb2.StateUpdate:
    [update] = snapshot(2, 5, [replica(0), replica(1)])
    columns = update.snapshot.residency_columns
    columns.count, columns.words = len(keys), 1
    columns.keys = np.array(keys, dtype="<u8").tobytes()
    columns.masks = np.array(masks, dtype="<u8").tobytes()
    for field, value in header.items():
        setattr(columns, field, value)
    return update


@pytest.mark.parametrize("header", [{"count": 5}, {"count": 3}, {"words": 2}, {"words": 0}])
def test_a_chunk_whose_buffers_do_not_match_its_header_is_refused_and_the_state_kept(
    header: dict[str, int],
) -> None:
    state = FleetState(index=CompactResidencyIndex)
    state.apply(_column_snapshot(KEYS, [1, 1, 3, 3]))
    before = state.views.view(MODEL).leading_runs(KEYS, now=None)
    assert before == {0: 4}
    with pytest.raises(SnapshotNeeded, match="refused"):
        state.apply(_column_snapshot([20, 21, 22, 23], [2, 2, 2, 2], **header))
    assert state.refused == 1
    assert state.views.view(MODEL).leading_runs(KEYS, now=None) == before
    assert state.position() == (0, 0)  # a new snapshot is asked for
    state.apply(_column_snapshot([20, 21], [2, 2]))
    assert state.views.view(MODEL).leading_runs([20, 21], now=None) == {1: 2}


def test_bits_of_replicas_the_snapshot_does_not_list_are_dropped_and_counted() -> None:
    state = FleetState(index=CompactResidencyIndex)
    state.apply(_column_snapshot(KEYS, [1, 1 | 1 << 9, 1 << 9, 1]))
    assert state.ignored == 2
    assert dict(state.replicas.index.holdings()) == {7: 1, 8: 1, 10: 1}


def test_a_proxy_keeps_its_residency_in_the_index_its_settings_name() -> None:
    compact = ProxyService(
        load_settings(["--controlplane", "127.0.0.1:9", "--residency-index", "compact"])
    )
    assert isinstance(compact.fleet.replicas.index, CompactResidencyIndex)
    compact.fleet.apply(_column_snapshot(KEYS, [1, 1, 1, 1]))
    compact.fleet.apply(delta(2, 6, residency=[residency_change(1, added=[7, 8])]))
    assert (
        compact.fleet.replicas.index._pending.count == 0
    )  # applied by the delta, not by a request
    bitmask = ProxyService(
        load_settings(["--controlplane", "127.0.0.1:9", "--residency-index", "bitmask"])
    )
    assert isinstance(bitmask.fleet.replicas.index, BitmaskResidencyIndex)
    default = ProxyService(load_settings(["--controlplane", "127.0.0.1:9"]))  # auto
    chosen = CompactResidencyIndex if NATIVE_LOOKUP else BitmaskResidencyIndex
    assert type(default.fleet.replicas.index) is chosen
    with pytest.raises(SettingsRefused, match="--residency-index"):
        load_settings(["--controlplane", "127.0.0.1:9", "--residency-index", "radix"])


def test_the_endpoint_picker_takes_the_residency_index_as_the_proxy_does() -> None:
    picker = EppService(load_epp_settings(["--controlplane", "127.0.0.1:9"]))  # auto
    chosen = CompactResidencyIndex if NATIVE_LOOKUP else BitmaskResidencyIndex
    assert type(picker.fleet.replicas.index) is chosen
    for name, kind in (("compact", CompactResidencyIndex), ("bitmask", BitmaskResidencyIndex)):
        argv = ["--controlplane", "127.0.0.1:9", "--residency-index", name]
        assert type(EppService(load_epp_settings(argv)).fleet.replicas.index) is kind
    with pytest.raises(EppSettingsRefused, match="--residency-index"):
        load_epp_settings(["--controlplane", "127.0.0.1:9", "--residency-index", "radix"])
