"""The leader's warm-up state reaches the standby (through etcd), so proxies watching
either control plane keep a warming replica's prefixes off it alike; when the leader dies
its warm-ups die with its lease and the new leader does not keep them."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

import pytest

from controlplane.etcd_client import EtcdClient
from controlplane.fleet.fleet import Fleet
from controlplane.fleet.leadership import Leadership
from controlplane.settings import ControlPlaneSettings
from kvroute.servers import EtcdServer
from tests.integration.sidecar_harness import wait_until

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
