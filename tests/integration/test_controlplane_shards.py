"""Two control-plane shards (real processes, NATS and etcd), pools split between them,
sidecars' exact wire messages published to all four pools from two publisher
processes: each shard's watcher gets its own pools' replicas and every sample key
published to them, and nothing of the others' (the load bench.controlplane's `shards`
part measures at rate)."""

from __future__ import annotations

import pytest

from bench.controlplane.shards import measure

pytestmark = pytest.mark.integration


async def test_two_shards_each_serve_their_pools_to_their_watchers() -> None:
    figures = await measure(2, 8_000, 2.0, sidecars=32, publishers=2, batch_events=8)
    assert [f.shard for f in figures] == ["s0", "s1"]
    assert [f.pools for f in figures] == [("s0p0", "s0p1"), ("s1p0", "s1p1")]
    for shard in figures:
        assert shard.only_its_pools
        assert shard.lost == 0 and shard.samples > 0
        assert shard.published > 1_000
        assert shard.p99_s < 2.0
