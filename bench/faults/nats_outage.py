"""A NATS outage under steady load: ``nats-server`` killed -9 and restarted on its port
(``cut="server"``), or the control plane's own link to it cut while the sidecars keep
theirs (``cut="controlplane"``: the control plane reaches NATS through a loopback
:class:`~bench.chaos.fleet.Link` that falls silent, as a partition looks, and is mended).

On ``kvroute up``'s fleet (``kvroute-sim`` engines with their sidecars, one control plane,
one proxy, all on 127.0.0.1), an open-loop load of streamed chat requests on a few shared
system prompts runs before, through and after the outage. What a user of the proxy sees
is measured from outside: requests that failed (any status but 200, a broken stream, no
token) out of those sent, and TTFT while NATS was away. Once NATS is back, new system
prompts are sent one after the other, each followed by its repeats, under a workload
that never speculates (``speculative_ttl_s`` 0), so a repeat shows predicted cached
blocks only when the engine's KV events reached the proxy through sidecar, NATS and
control plane: the time from NATS's return to the first such repeat is how long routing
went without fresh events.

The control plane's ``/v1/replicas`` is read throughout: how many replicas it flagged
stale while NATS was away, and whether it marked any down (it must not: they all serve).

Targets (issue 46): 0 failed requests, no replica down; a new prefix routed by its events
within 2 s.
"""

from __future__ import annotations

import asyncio
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

from bench.chaos.fleet import Link
from bench.faults.children import child_named, kill_child
from bench.faults.load import SteadyLoad, chat, p99, system_prompt
from kvroute.demo import AdminClient, Answer, PhaseResult, send_one
from kvroute.servers import free_port
from kvroute.supervisor import Child
from kvroute.up import LocalFleet, UpOptions

EVENTS_ONLY = "events-only"  # the probe's workload: kv_aware that never speculates
EVENTS_BACK_TARGET_S = 2.0
REPEAT_WINDOW_S = 1.0  # how long one new prefix's repeats are tried before the next
WATCH_EVERY_S = 0.2  # how often the control plane's /v1/replicas is read
CUTS = ("server", "controlplane")  # what goes: nats-server, or the control plane's link


@dataclass(frozen=True)
class OutageConfig:
    outage_s: float = 5.0
    replicas: int = 3
    rate: float = 10.0  # requests per second, open loop
    system_prompts: int = 3
    before_s: float = 3.0  # steady load before the kill
    after_s: float = 5.0  # and after NATS is back (the probe runs meanwhile)
    probe_deadline_s: float = 30.0  # after this, routing by events is reported as never back
    cut: str = "server"  # one of CUTS
    controlplane_flags: tuple[str, ...] = ()  # added to the control plane's command line


@dataclass
class OutageResult:
    outage_s: float
    sent: int
    failed: int
    ttft_p99_during_s: float | None  # requests sent while NATS was away
    events_back_s: float | None  # None: no new prefix routed by events before the deadline
    cut: str = "server"
    stale_seen: int = 0  # the most replicas /v1/replicas flagged stale at once
    down_seen: int = 0  # the most it said were down at once (from the load's start)

    @property
    def met(self) -> bool:
        back = self.events_back_s
        return (
            self.failed == 0
            and self.down_seen == 0
            and back is not None
            and back <= EVENTS_BACK_TARGET_S
        )

    def summary(self) -> dict[str, Any]:
        return {
            "cut": self.cut,
            "outage_s": self.outage_s,
            "stale_seen": self.stale_seen,
            "down_seen": self.down_seen,
            "sent": self.sent,
            "failed": self.failed,
            "ttft_p99_during_s": self.ttft_p99_during_s,
            "events_back_s": self.events_back_s,
            "met": self.met,
        }


class NatsOutage:
    """One run: the fleet, the load, the kill, the restart, the probe."""

    def __init__(self, config: OutageConfig, run_dir: Path) -> None:
        if config.cut not in CUTS:
            raise ValueError(f"cut {config.cut!r}: choose from {', '.join(CUTS)}")
        self.config = config
        options = UpOptions(replicas=config.replicas, port=free_port(), data_dir=run_dir)
        self.local = CuttableFleet(options, config.controlplane_flags)
        self.stale_seen = self.down_seen = 0
        self.probes = PhaseResult("probe")  # the probe's requests: failed ones count
        self.sent_probes = 0

    async def run(self) -> OutageResult:
        fleet = await self.local.start()
        proxy = fleet.proxy_urls[0]
        timeout = aiohttp.ClientTimeout(total=60)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            admin = AdminClient(session, fleet.admin_urls[0], fleet.admin_token)
            await admin.put_workload(EVENTS_ONLY, {"strategy": "kv_aware", "speculative_ttl_s": 0})
            await self._wait_workload(session, proxy)
            c = self.config
            watch = asyncio.create_task(self._watch(admin))
            try:
                async with SteadyLoad(session, proxy, c.rate, c.system_prompts) as load:
                    await asyncio.sleep(c.before_s)  # steady load first: the fault's schedule
                    killed_at = time.perf_counter()
                    await self._cut()
                    await asyncio.sleep(c.outage_s)  # the outage's length is the fault
                    await self._restore()
                    back_at = time.perf_counter()
                    events_back = await self._events_back(session, proxy, back_at)
                    await asyncio.sleep(max(0.0, c.after_s - (time.perf_counter() - back_at)))
            finally:
                watch.cancel()
        answers = load.result.answers
        during = p99([a.ttft_s for a in answers if killed_at <= a.sent_at < back_at])
        sent = load.sent + self.sent_probes
        failed = load.result.errors + self.probes.errors
        return OutageResult(
            c.outage_s, sent, failed, during, events_back, c.cut, self.stale_seen, self.down_seen
        )

    async def aclose(self) -> None:
        await self.local.aclose()

    async def _events_back(
        self, session: aiohttp.ClientSession, proxy: str, back_at: float
    ) -> float | None:
        """Seconds from NATS's return to the first repeat of a new prefix that the proxy
        routed by the engine's events (predicted cached blocks, speculation off)."""
        headers = {"x-kvroute-workload": EVENTS_ONLY}
        probe = 0
        while time.perf_counter() - back_at < self.config.probe_deadline_s:
            system = system_prompt(f"probe{probe}-{os.getpid()}")
            sent_at = time.perf_counter()
            first = await self._ask(session, proxy, chat(system, "First?", 1), headers)
            if first is None:  # failed (counted): the next prefix at the load's pace
                await asyncio.sleep(max(0.0, sent_at + 1 / self.config.rate - time.perf_counter()))
            tried_until = time.perf_counter() + REPEAT_WINDOW_S
            while first is not None and time.perf_counter() < tried_until:
                again = await self._ask(session, proxy, chat(system, "Again?", 1), headers)
                if again is not None and _predicted_blocks(again) > 0:
                    return time.perf_counter() - back_at
            probe += 1
        return None

    async def _ask(
        self,
        session: aiohttp.ClientSession,
        proxy: str,
        body: dict[str, Any],
        headers: dict[str, str],
    ) -> Answer | None:
        """One probe request; its answer, or None when it failed (counted as failed)."""
        answered = len(self.probes.answers)
        self.sent_probes += 1
        await send_one(session, proxy, body, self.probes, headers=headers)
        return self.probes.answers[-1] if len(self.probes.answers) > answered else None

    async def _wait_workload(self, session: aiohttp.ClientSession, proxy: str) -> None:
        """Until the proxy knows the probe's workload (its config arrives over gRPC; an
        unknown workload is a 400), bounded."""
        headers = {"x-kvroute-workload": EVENTS_ONLY}
        deadline = time.perf_counter() + 30.0
        while time.perf_counter() < deadline:
            answers = PhaseResult("ready")
            await send_one(session, proxy, chat("Ready?", "Ready?", 1), answers, headers=headers)
            if answers.answers:
                return
        raise RuntimeError(f"the proxy did not learn the {EVENTS_ONLY} workload in 30 s")

    async def _watch(self, admin: AdminClient) -> None:
        """Reads the control plane's /v1/replicas until cancelled: the most replicas it
        flagged stale, and the most it called down, at once."""
        url = f"{admin.base_url}/v1/replicas"
        while True:
            try:
                async with admin.session.get(url, headers=admin.headers) as response:
                    replicas = (await response.json())["replicas"]
            except (aiohttp.ClientError, TimeoutError, KeyError):
                replicas = []  # the admin API is the control plane's own: not NATS
            stale = sum(1 for r in replicas if r["stale"])
            down = sum(1 for r in replicas if r["status"] == "down")
            self.stale_seen = max(self.stale_seen, stale)
            self.down_seen = max(self.down_seen, down)
            await asyncio.sleep(WATCH_EVERY_S)  # the watch's period

    # -- NATS ------------------------------------------------------------------------
    async def _cut(self) -> None:
        if self.config.cut == "controlplane":
            self.local.link.sever()
        else:
            await self._kill_nats()

    async def _restore(self) -> None:
        if self.config.cut == "controlplane":
            self.local.link.mend()
        else:
            await self._restart_nats()

    def _nats(self) -> Child:
        return child_named(self.local, "nats")

    async def _kill_nats(self) -> None:
        await kill_child(self._nats())

    async def _restart_nats(self) -> None:
        """The same command line, so the same port; returns once it is ready."""
        await self.local.supervisor.start(self._nats().spec)


class CuttableFleet(LocalFleet):
    """``kvroute up``'s fleet whose control plane reaches NATS through :attr:`link` (the
    sidecars straight), with ``controlplane_flags`` on its command line."""

    def __init__(self, options: UpOptions, controlplane_flags: tuple[str, ...]) -> None:
        super().__init__(options, say=lambda _line: None)
        self.link = Link()
        self.controlplane_flags = controlplane_flags

    async def _start_control_planes(self) -> None:
        host, port = self.fleet.nats_url.removeprefix("nats://").rsplit(":", 1)
        self.link.backend = (host, int(port))
        await self.link.start()
        await super()._start_control_planes()

    def controlplane_argv(self, index: int) -> list[str]:
        argv = super().controlplane_argv(index)
        argv[argv.index("--nats-url") + 1] = f"nats://{self.link.address}"
        return [*argv, *self.controlplane_flags]

    async def aclose(self) -> None:
        await self.link.aclose()
        await super().aclose()


def _predicted_blocks(answer: Answer) -> int:
    head = answer.prefix_blocks.split("/")[0]
    return int(head) if head.isdigit() else 0


async def run_outage(config: OutageConfig, run_dir: Path) -> OutageResult:
    outage = NatsOutage(config, run_dir)
    try:
        return await outage.run()
    finally:
        await outage.aclose()
