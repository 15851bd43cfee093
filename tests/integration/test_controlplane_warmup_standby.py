"""The leader's warm-up state reaches the standby (through etcd), so proxies watching
either control plane keep a warming replica's prefixes off it alike; when the leader dies
its warm-ups die with its lease and the new leader does not keep them; a leader that
loses its lease drops its own warm-ups, and leading again warms afresh."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import pytest

from controlplane.etcd_client import EtcdClient
from controlplane.fleet.fleet import Fleet
from controlplane.fleet.leadership import Leadership
from controlplane.fleet.warmup import Warmer
from controlplane.settings import ControlPlaneSettings
from kvcore.keys import chain_keys, root_key
from kvcore.pb import routing_pb2
from kvcore.subjects import EtcdKeys
from kvcore.workload import parse_workload
from kvroute.servers import EtcdServer
from tests.integration.sidecar_harness import wait_until
from tests.unit.controlplane.support import announce, batch

POOL = "warm"


def settings(etcd: EtcdServer, instance: str) -> ControlPlaneSettings:
    return ControlPlaneSettings(
        etcd_endpoints=[etcd.endpoint],
        etcd_prefix="/warmup-standby/",
        instance_id=instance,
        pools=[POOL],
        lease_ttl_s=2,
    )


class Instance:
    def __init__(self, etcd: EtcdServer, name: str) -> None:
        self.settings = settings(etcd, name)
        self.etcd = EtcdClient(self.settings, timeout_s=1.0)
        self.fleet = Fleet(heartbeat_timeout_s=30.0)
        self.record = self.fleet.record(POOL, "warm-r1", now=0.0)  # as its announce made it
        self.leadership = Leadership(self.settings, self.etcd, self.fleet)

    async def close(self) -> None:
        await self.leadership.aclose()
        with contextlib.suppress(Exception):
            await self.etcd.close()


@pytest.fixture
async def pair(etcd_server: EtcdServer) -> AsyncIterator[tuple[Instance, Instance]]:
    leader, standby = Instance(etcd_server, "cp-a"), Instance(etcd_server, "cp-b")
    await leader.leadership.start()
    await wait_until(leader.leadership.is_leader, 10.0)
    await standby.leadership.start()
    yield leader, standby
    await standby.close()
    await leader.close()


async def test_the_standby_applies_the_leaders_warm_up_and_drops_it_on_takeover(
    pair: tuple[Instance, Instance],
) -> None:
    leader, standby = pair
    standby.fleet.changes.take()

    leader.leadership.share_warmup(POOL, "warm-r1", frozenset({11, 12}))
    await wait_until(lambda: standby.record.warmup == frozenset({11, 12}), 10.0)
    assert standby.record.ordinal in standby.fleet.changes.take().replicas  # streamed on

    leader.leadership.share_warmup(POOL, "warm-r1", frozenset({12}))  # 11 confirmed
    await wait_until(lambda: standby.record.warmup == frozenset({12}), 10.0)
    leader.leadership.share_warmup(POOL, "warm-r1", None)  # the warm-up ended
    await wait_until(lambda: standby.record.warmup is None, 10.0)

    # a standby writes nothing: its state is the leader's
    standby.leadership.share_warmup(POOL, "warm-r1", frozenset({99}))
    leader.leadership.share_warmup(POOL, "warm-r1", frozenset({13}))
    await wait_until(lambda: standby.record.warmup == frozenset({13}), 10.0)
    assert leader.record.warmup is None  # the leader's own warmer owns its records

    # the leader dies mid warm-up: the standby leads and keeps no warm-up of the old term
    await leader.close()
    await wait_until(standby.leadership.is_leader, 15.0)
    await wait_until(lambda: standby.record.warmup is None, 10.0)


MODEL, BS = "m", 16
PREFIX = [7 + i % 50 for i in range(8 * BS)]  # one hot prefix of 8 blocks
PREFIX_KEYS = chain_keys(root_key(model=MODEL), PREFIX, BS)


class HangingOnceEngine:
    """The engine's completions API: the first warm-up request never answers (a wedged
    engine); later ones answer, and the replica's KV events then show the prefix."""

    def __init__(self, fleet: Fleet) -> None:
        self.fleet, self.calls, self.cancelled, self._seq = fleet, 0, 0, 1

    async def send(self, base_url: str, model: str, token_ids: list[int]) -> None:
        self.calls += 1
        if self.calls == 1:
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                self.cancelled += 1
                raise
        stored = [chain_keys(root_key(model=model), token_ids, BS)]
        self.fleet.on_batch(
            batch(self._seq, stored=stored, replica="warm-r2", pool=POOL), POOL, 0.0
        )
        self._seq += 1


async def test_a_leader_that_loses_its_lease_drops_its_warm_up_and_warms_afresh(
    etcd_server: EtcdServer,
) -> None:
    """Without the drop, the past term's send stays wedged and its job 'active' forever:
    the replica, still empty, is never warmed again."""
    instance = Instance(etcd_server, "cp-solo")
    fleet = instance.fleet
    fleet.on_announce(announce("warm-r2", pool=POOL, model=MODEL), 0.0)
    fleet.on_batch(batch(0, replica="warm-r2", pool=POOL), POOL, 0.0)  # in sync, empty
    engine = HangingOnceEngine(fleet)
    workload = parse_workload({"strategy": "kv_cost", "warmup": {"enabled": True}})
    leadership = instance.leadership
    warmer = Warmer(
        fleet,
        lambda: [workload],
        leadership.is_leader,
        engine.send,
        interval_s=0.05,
        share=leadership.share_warmup,
    )
    leadership.on_step_down(warmer.step_down)
    report = routing_pb2.ProxyReport(proxy_id="p1", ts=1.0, interval_s=1.0)
    report.hot_prefixes.add(
        workload="default",
        model=MODEL,
        token_ids=PREFIX,
        key=PREFIX_KEYS[-1],
        requests_per_s=2.0,
        block_size=BS,
    )
    warmer.on_report(report)
    record = fleet.by_id["warm-r2"]
    leader_key = (
        EtcdKeys(instance.settings.etcd_prefix).shard_leader(instance.settings.shard).encode()
    )
    try:
        await leadership.start()
        await warmer.start()
        await wait_until(lambda: engine.calls == 1, 10.0)  # warming, its send wedged
        assert record.warmup == frozenset({PREFIX_KEYS[-1]})  # proxies keep it off
        term = await instance.etcd.get(leader_key)

        await instance.etcd.revoke_lease(term.lease)  # the lease is lost (as to a partition)
        await wait_until(lambda: warmer.counters.outcomes.get("stepped_down") == 1, 10.0)
        assert engine.cancelled == 1  # its past term's send is not left running

        # it leads again (nobody else campaigns) and plans from the fleet as it is now
        await wait_until(lambda: warmer.counters.outcomes.get("done") == 1, 15.0)
        assert engine.calls == 2
        state = warmer.state_of("warm-r2")
        assert state is not None
        (summary,) = state["workloads"]  # type: ignore[misc]
        assert summary["sent"] == 1 and summary["confirmed"] == 1  # a fresh plan and budget
        assert record.warmup is None  # and the proxies route to it as to any other
        assert fleet.index.leading_runs(PREFIX_KEYS).get(record.ordinal) == len(PREFIX_KEYS)
    finally:
        await warmer.aclose()
        await instance.close()
