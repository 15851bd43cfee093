"""A 2M-key Watch snapshot as residency columns over real gRPC: the control plane's
RoutingState server, the proxy's StateClient and FleetState (compact index), checked
key for key (bench.controlplane measures the same path at 10M keys)."""

from __future__ import annotations

import numpy as np
import pytest

from bench.controlplane.inprocess import proxy_watch, rows_fleet
from controlplane.fleet.broadcast import Broadcaster, EmptyConfig

pytestmark = pytest.mark.integration
KEYS = 2_000_000


def _sorted_rows(keys: np.ndarray, masks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    order = np.argsort(keys)
    return keys[order], masks[order]


async def test_a_two_million_key_snapshot_arrives_key_for_key() -> None:
    fleet = rows_fleet(KEYS)
    broadcaster = Broadcaster(fleet, EmptyConfig())
    state, _, _ = await proxy_watch(broadcaster)
    assert broadcaster.stats.snapshots == 1
    sent_keys, sent_masks = _sorted_rows(*fleet.index.residency())
    got_keys, got_masks = _sorted_rows(*state.replicas.index.residency())
    assert sent_keys.size == fleet.index.key_count() == KEYS + 8  # (and 8 replicas' first)
    assert np.array_equal(got_keys, sent_keys)
    assert np.array_equal(got_masks[:, : sent_masks.shape[1]], sent_masks)
    assert state.refused == state.ignored == 0
