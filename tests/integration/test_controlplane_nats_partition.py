"""Issue 46, item 1, for a control plane that loses NATS while the sidecars keep it: two
real ``nats-server`` nodes in a cluster, the sidecars on one, the control plane on the
other, which is killed -9 and restarted on its port. The control plane downs nobody
while it cannot hear (it keeps the replicas, residency and all, flagged stale), and once
back it asks every replica for its state and follows their events again."""

from __future__ import annotations

import asyncio
import contextlib
import signal
from collections.abc import AsyncIterator, Iterator

import pytest

from controlplane.fleet.fleet import Fleet
from controlplane.fleet.ingest import Ingest
from controlplane.settings import ControlPlaneSettings
from kvroute.servers import NatsServer, free_port
from tests.integration.controlplane_harness import SidecarDouble
from tests.integration.sidecar_harness import wait_until

TIMEOUT_S = 1.0  # the control plane's heartbeat timeout here
REPORT_EVERY_S = 0.2


class ClusterNode(NatsServer):
    """A node of a two-node NATS cluster; killed -9 when stopped, restartable on its port."""

    stop_signal = signal.SIGKILL

    def __init__(self, cluster_port: int, peer_cluster_port: int) -> None:
        super().__init__()
        self.cluster_port, self.peer_cluster_port = cluster_port, peer_cluster_port

    def command(self) -> list[str]:
        return [
            *super().command(),
            "--cluster_name", "kvroute-test",
            "--cluster", f"nats://127.0.0.1:{self.cluster_port}",
            "--routes", f"nats://127.0.0.1:{self.peer_cluster_port}",
            "--no_advertise",  # clients keep to their node: it is the one that goes
        ]  # fmt: skip

    def prepare(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)  # stop() removed it


@pytest.fixture
def cluster() -> Iterator[tuple[ClusterNode, ClusterNode]]:
    ports = free_port(), free_port()
    sidecars_node, controlplane_node = ClusterNode(*ports), ClusterNode(*reversed(ports))
    with sidecars_node, controlplane_node:
        yield sidecars_node, controlplane_node


@contextlib.asynccontextmanager
async def reporting(sidecars: list[SidecarDouble]) -> AsyncIterator[None]:
    """The sidecars announce and report load every REPORT_EVERY_S, as real ones do."""

    async def report() -> None:
        while True:
            for sidecar in sidecars:
                await sidecar.announce()
                await sidecar.load()
            await asyncio.sleep(REPORT_EVERY_S)  # the reports' period

    task = asyncio.create_task(report())
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


def held(fleet: Fleet, replica: str) -> set[int]:
    return set(fleet.index.keys_of(fleet.by_id[replica].ordinal))


async def test_a_control_plane_that_loses_nats_keeps_every_replica_and_resyncs_on_return(
    cluster: tuple[ClusterNode, ClusterNode],
) -> None:
    sidecars_node, controlplane_node = cluster
    settings = ControlPlaneSettings(
        nats_url=controlplane_node.url, pools=["p"], heartbeat_timeout_s=TIMEOUT_S
    )
    fleet = Fleet(heartbeat_timeout_s=TIMEOUT_S, resync_retry_s=0.5)
    ingest = Ingest(settings, fleet)
    await ingest.start()
    sidecars = [await SidecarDouble(sidecars_node.url, f"r{i}", pool="p").start() for i in range(3)]
    try:
        async with reporting(sidecars):
            await wait_until(lambda: len(fleet.by_id) == 3 and fleet.stats.snapshots_applied >= 3)
            await sidecars[0].store(range(1, 11))
            await wait_until(lambda: held(fleet, "r0") == set(range(1, 11)))

            controlplane_node.stop()  # kill -9: the control plane hears nobody
            await wait_until(lambda: not ingest.connected)
            await wait_until(lambda: fleet.stale_count() == 3)  # silent past the timeout
            assert [r.down for r in fleet.by_id.values()] == [False] * 3
            assert held(fleet, "r0") == set(range(1, 11))
            await sidecars[0].store(range(11, 21))  # while it cannot hear

            controlplane_node.start()
            await wait_until(lambda: ingest.connected)
            await wait_until(lambda: fleet.stale_count() == 0)  # their reports again
            # asked on its return: the snapshot brings what it missed
            await wait_until(lambda: held(fleet, "r0") == set(range(1, 21)))
            assert fleet.stats.resyncs.get("nats reconnected", 0) >= 3
            await sidecars[1].store(range(100, 105))
            await wait_until(lambda: held(fleet, "r1") == set(range(100, 105)), 2.0)
            assert not any(r.down for r in fleet.by_id.values())
    finally:
        for sidecar in sidecars:
            await sidecar.stop()
        await ingest.aclose()
