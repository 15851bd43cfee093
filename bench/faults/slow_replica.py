"""A replica much slower than its peers under steady load: one ``kvroute-sim`` of the
fleet has every step's modelled duration multiplied (``/sim/faults`` ``slowdown``), as
an engine on a throttled or older GPU would.

On ``kvroute up``'s fleet (three engines with their sidecars, a control plane, a proxy,
all on 127.0.0.1, the default workload), the steady load of :mod:`bench.faults.load`
runs from the slowdown on; after ``settle_s`` (the proxy learns the replica's rates)
each answer's replica is counted for ``measure_s``. Measured from outside: failed of
sent, each replica's share of the requests, TTFT p99.

Target (issue 46): the slow replica's share proportional to its speed, ``(1/s) / (n - 1
+ 1/s)`` of the requests for a slowdown ``s`` among ``n`` replicas (4.8% for 10x among
three); met here when at most twice that.
"""

from __future__ import annotations

import asyncio
import dataclasses
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

from bench.faults.children import local_fleet
from bench.faults.load import SteadyLoad, p99

SLOW = 0  # kvroute up's engine sim-0, replica r0
TOLERANCE = 2.0  # met when the slow replica's share is at most this times proportional


@dataclass(frozen=True)
class SlowConfig:
    slowdown: float = 10.0
    replicas: int = 3
    rate: float = 10.0
    system_prompts: int = 3
    settle_s: float = 10.0
    measure_s: float = 30.0


@dataclass
class SlowResult:
    slowdown: float
    replicas: int
    sent: int
    failed: int
    by_replica: dict[str, int]  # answers of the measured window, per replica
    ttft_p99_s: float | None
    # the measured window's median TTFT per replica, and what the fleet learned of each
    # replica's speed (``/v1/replicas``' learned rates) at its end
    ttft_p50_by_replica: dict[str, float] = dataclasses.field(default_factory=dict)
    learned: dict[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def proportional(self) -> float:
        speed = 1.0 / self.slowdown
        return speed / (self.replicas - 1 + speed)

    @property
    def slow_share(self) -> float | None:
        total = sum(self.by_replica.values())
        return self.by_replica.get(f"r{SLOW}", 0) / total if total else None

    @property
    def met(self) -> bool:
        share = self.slow_share
        return self.failed == 0 and share is not None and share <= TOLERANCE * self.proportional

    def summary(self) -> dict[str, Any]:
        shares = {"slow_share": self.slow_share, "proportional_share": self.proportional}
        return {**dataclasses.asdict(self), **shares, "met": self.met}


async def run_slow(config: SlowConfig, run_dir: Path) -> SlowResult:
    async with local_fleet(config.replicas, run_dir) as (_, fleet, session):
        slowed = {"slowdown": config.slowdown}
        async with session.post(f"{fleet.engines[SLOW]}/sim/faults", json=slowed) as done:
            done.raise_for_status()
        proxy = fleet.proxy_urls[0]
        async with SteadyLoad(session, proxy, config.rate, config.system_prompts) as load:
            await asyncio.sleep(config.settle_s)  # the proxy learns: the schedule
            measured_from = time.perf_counter()
            await asyncio.sleep(config.measure_s)  # the window measured
            measured_to = time.perf_counter()
            learned = await _learned(session, fleet.admin_urls, fleet.admin_token)
    window = [a for a in load.result.answers if measured_from <= a.sent_at < measured_to]
    by_replica: dict[str, int] = {}
    for answer in window:
        by_replica[answer.replica] = by_replica.get(answer.replica, 0) + 1
    failed = load.result.errors + sum(1 for a in load.result.answers if a.error)
    ttft = p99([a.ttft_s for a in window])
    p50 = {
        replica: statistics.median(a.ttft_s for a in window if a.replica == replica)
        for replica in by_replica
    }
    return SlowResult(
        config.slowdown, config.replicas, load.sent, failed, by_replica, ttft, p50, learned
    )


async def _learned(
    session: aiohttp.ClientSession, admin_urls: list[str], token: str
) -> dict[str, Any]:
    """Each replica's learned speed as the control plane shows it (empty if none)."""
    if not admin_urls:
        return {}
    headers = {"Authorization": f"Bearer {token}"}
    async with session.get(f"{admin_urls[0]}/v1/replicas", headers=headers) as response:
        if response.status != 200:
            return {}
        body = await response.json()
    rows = body.get("replicas", body) if isinstance(body, dict) else body
    return {
        row.get("replica_id", "?"): row.get("learned")
        for row in rows
        if isinstance(row, dict) and row.get("learned")
    }
