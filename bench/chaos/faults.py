"""The faults, one function each: inject, hold, heal; what each one does to the fleet.

Each takes the :class:`Scene` (the fleet, an HTTP session, the clock) and returns a
:class:`Window`: when the fault began and ended, and which replica it struck, if one.
Every fault leaves the fleet whole (what it killed is started again), so the next one
starts from a working fleet. Each fault strikes its own engine (:meth:`Scene.victim`:
``r0`` the sidecar, ``r1`` the restart with replay, ...), so none inherits another's
damage on a fleet of six.

A partition cuts the last proxy's :class:`~bench.chaos.fleet.Link` to each control
plane: its connections stay open and fall silent (what a partition looks like from
either end), and new ones are accepted and held; after the hold the links close what
they held, and the proxy's reconnection goes through.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from bench.chaos.fleet import ChaosFleet
from bench.faults.children import stopped
from bench.faults.load import chat
from kvroute.demo import PhaseResult, send_one

LONG_STREAMS = 12  # long answers in flight when a replica is killed mid-stream
LONG_TOKENS = 400


@dataclass
class Scene:
    fleet: ChaosFleet
    session: aiohttp.ClientSession
    hold_s: float = 10.0  # how long a lasting fault lasts (the partition: partition_s)
    partition_s: float = 60.0
    # requests a fault sends itself, and their answers (counted with the load's)
    extra: list[asyncio.Task[None]] = field(default_factory=list)
    extra_bodies: list[dict[str, Any]] = field(default_factory=list)
    extra_result: PhaseResult = field(default_factory=lambda: PhaseResult("fault"))

    def victim(self, slot: int) -> int:
        """The engine a fault strikes: its own slot, within the fleet's engines."""
        return slot % len(self.fleet.fleet.engines)


@dataclass
class Window:
    began: float  # perf_counter
    ended: float
    victim: str = ""  # the replica id struck (r0..), "" when none
    note: str = ""


Fault = Callable[[Scene], Awaitable[Window]]


def _now() -> float:
    return time.perf_counter()


async def _kill_and_restart(
    scene: Scene, name: str, hold_s: float, victim: str = "", flags: dict[str, str] | None = None
) -> Window:
    """kill -9 the child ``name``; ``hold_s`` later (0: at once) start it again on its
    ports, with ``flags`` (``--flag``: value) changed."""
    began = _now()
    await scene.fleet.kill(name)
    await asyncio.sleep(hold_s)  # the fault's length
    await scene.fleet.restart(name, flags)
    return Window(began, _now(), victim=victim)


async def controlplane_leader(scene: Scene) -> Window:
    """kill -9 the shard's leader; the standby takes over; the old one restarts."""
    leader = await scene.fleet.leader(scene.session) or "controlplane-0"
    window = await _kill_and_restart(scene, leader, scene.hold_s)
    window.note = f"killed {leader}"
    return window


async def nats_restart(scene: Scene) -> Window:
    """kill -9 nats-server and start it again at once, on its port."""
    return await _kill_and_restart(scene, "nats", 0.0)


async def etcd_restart(scene: Scene) -> Window:
    """kill -9 etcd; after the hold, start it again on its data folder and ports."""
    return await _kill_and_restart(scene, "etcd", scene.hold_s)


async def sidecar_kill(scene: Scene) -> Window:
    """kill -9 an engine's sidecar; after the hold, start it again."""
    index = scene.victim(0)
    return await _kill_and_restart(scene, f"sidecar-{index}", scene.hold_s, f"r{index}")


async def engine_restart_replay(scene: Scene) -> Window:
    """An engine killed and started again at once on its ports: its cache is lost; its
    replay endpoint is back (empty)."""
    index = scene.victim(1)
    return await _kill_and_restart(scene, f"sim-{index}", 0.0, f"r{index}")


async def engine_restart_no_replay(scene: Scene) -> Window:
    """Another engine killed and started again at once, without a replay endpoint: the
    sidecar cannot ask it for what it missed."""
    index = scene.victim(2)
    no_replay = {"--replay-endpoint": ""}
    return await _kill_and_restart(scene, f"sim-{index}", 0.0, f"r{index}", no_replay)


async def events_past_replay(scene: Scene) -> Window:
    """An engine's KV events paused for the hold (they queue in its replay buffer),
    then the buffer dropped before they resume: the gap cannot be replayed."""
    index = scene.victim(3)
    url = scene.fleet.fleet.engines[index]
    began = _now()
    await _sim_fault(scene.session, url, {"pause_events": True})
    try:
        await asyncio.sleep(scene.hold_s)
        await _sim_fault(scene.session, url, {"drop_replay": True})
    finally:
        await _sim_fault(scene.session, url, {"pause_events": False})
    return Window(began, _now(), victim=f"r{index}")


async def replica_kill_midstream(scene: Scene) -> Window:
    """An engine killed -9 while long answers stream (some from it); after the hold it
    starts again, cache empty."""
    for index in range(LONG_STREAMS):
        body = chat(f"Long answer {index}", "Tell me everything.", LONG_TOKENS)
        scene.extra_bodies.append(body)
        sent = send_one(scene.session, scene.fleet.url, body, scene.extra_result, index)
        scene.extra.append(asyncio.create_task(sent))
    await asyncio.sleep(1.0)  # the long answers are streaming: the fault's schedule
    index = scene.victim(4)
    return await _kill_and_restart(scene, f"sim-{index}", scene.hold_s, f"r{index}")


async def replica_sigstop(scene: Scene) -> Window:
    """An engine stopped (SIGSTOP: connections accepted, nothing answers) for the hold."""
    index = scene.victim(5)
    began = _now()
    async with stopped(scene.fleet.child(f"sim-{index}")):
        await asyncio.sleep(scene.hold_s)
    return Window(began, _now(), victim=f"r{index}")


async def proxy_partition(scene: Scene) -> Window:
    """The last proxy cut from both control planes for ``partition_s``."""
    links = scene.fleet.links
    began = _now()
    for link in links:
        link.sever()
    try:
        await asyncio.sleep(scene.partition_s)
    finally:
        for link in links:
            link.mend()
    return Window(began, _now(), note=f"{scene.fleet.partitioned_proxy} cut")


async def _sim_fault(session: aiohttp.ClientSession, url: str, update: dict[str, bool]) -> None:
    async with session.post(f"{url}/sim/faults", json=update) as response:
        response.raise_for_status()


# name -> (the fault, what it does, in a phrase)
FAULTS: dict[str, tuple[Fault, str]] = {
    "leader": (controlplane_leader, "kill -9 the control-plane leader"),
    "nats": (nats_restart, "kill -9 NATS and restart it"),
    "etcd": (etcd_restart, "kill -9 etcd, restart it after the hold"),
    "sidecar": (sidecar_kill, "kill -9 a sidecar, restart it after the hold"),
    "engine-replay": (engine_restart_replay, "restart an engine (cache lost), replay on"),
    "engine-no-replay": (engine_restart_no_replay, "restart an engine (cache lost), no replay"),
    "events-gap": (events_past_replay, "pause an engine's events past its replay buffer"),
    "midstream": (replica_kill_midstream, "kill -9 a replica mid-stream"),
    "sigstop": (replica_sigstop, "SIGSTOP a replica for the hold"),
    "partition": (proxy_partition, "partition a proxy from the control planes"),
}
