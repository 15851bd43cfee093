"""A hung engine under steady load: one ``kvroute-sim`` of the fleet stopped (SIGSTOP: the
kernel still accepts its connections, nothing answers) and resumed (SIGCONT).

On ``kvroute up``'s fleet (three engines with their sidecars, a control plane, a proxy, all
on 127.0.0.1), the steady load of :mod:`bench.faults.load` runs before, through and after
the stop, streamed or whole (non-streamed: its first token is its whole answer's).
Measured from outside: requests that failed out of those sent; the requests started 2 s
or more after the stop that took over 3 s to their end; TTFT p99 while the engine was
stopped; and how long after SIGCONT the engine answered a request again.

Targets (issue 46): 0 failed; none over 3 s among those started 2 s or more after the
stop; traffic on the engine again within 2 s of SIGCONT.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

from bench.faults.children import child_named, local_fleet, stopped
from bench.faults.load import SteadyLoad, p99
from kvroute.supervisor import Child

SETTLED_S = 2.0  # requests started this long after the stop must not wait for the engine
SLOW_S = 3.0
BACK_TARGET_S = 2.0
VICTIM = 0  # kvroute up's engine sim-0, replica r0


@dataclass(frozen=True)
class HungConfig:
    stop_s: float = 10.0
    replicas: int = 3
    rate: float = 10.0
    system_prompts: int = 3
    before_s: float = 3.0
    after_s: float = 5.0
    stream: bool = True  # False: whole answers


@dataclass
class HungResult:
    stop_s: float
    stream: bool
    sent: int
    failed: int
    slow_after_settled: int  # started >= SETTLED_S after the stop, took over SLOW_S
    settled: int  # requests started >= SETTLED_S after the stop, before SIGCONT
    ttft_p99_during_s: float | None
    back_s: float | None  # SIGCONT to the first request the engine answered again

    @property
    def met(self) -> bool:
        back = self.back_s
        quick = self.slow_after_settled == 0
        return self.failed == 0 and quick and back is not None and back <= BACK_TARGET_S

    def summary(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "met": self.met}


async def run_hung(config: HungConfig, run_dir: Path) -> HungResult:
    async with local_fleet(config.replicas, run_dir) as (local, fleet, session):
        victim = child_named(local, f"sim-{VICTIM}")
        stop = await stopped_under_load(session, fleet.proxy_urls[0], victim, config)
    back = sorted(
        a.sent_at + a.ttft_s - stop.resumed_at
        for a in stop.load.result.answers
        if a.replica == f"r{VICTIM}" and a.sent_at >= stop.resumed_at
    )
    return HungResult(config.stop_s, config.stream, *stop.figures(), back[0] if back else None)


@dataclass
class Stop:
    """A stop under steady load: the load's answers, and when it stopped and resumed."""

    load: SteadyLoad
    stopped_at: float
    resumed_at: float
    again: float | None = None  # when what ``stopped_under_load`` waited for came

    def figures(self) -> tuple[int, int, int, int, float | None]:
        """Sent, failed, slow among the settled, settled, TTFT p99 while stopped."""
        answers = self.load.result.answers
        stopped_at, resumed_at = self.stopped_at, self.resumed_at
        settled = [a for a in answers if stopped_at + SETTLED_S <= a.sent_at < resumed_at]
        during = p99([a.ttft_s for a in answers if stopped_at <= a.sent_at < resumed_at])
        slow = sum(1 for a in settled if a.total_s > SLOW_S)
        failed = self.load.result.errors  # every failure counts, whenever it was sent
        return self.load.sent, failed, slow, len(settled), during


async def stopped_under_load(
    session: aiohttp.ClientSession,
    proxy: str,
    victim: Child,
    config: HungConfig,
    again: Callable[[], Awaitable[float | None]] | None = None,
) -> Stop:
    """``config``'s steady load through ``proxy``, ``victim`` stopped in its midst; after
    SIGCONT, ``again`` awaited (its time kept) before the load's last stretch."""
    prompts, stream = config.system_prompts, config.stream
    async with SteadyLoad(session, proxy, config.rate, prompts, stream) as load:
        await asyncio.sleep(config.before_s)  # steady load first: the fault's schedule
        stopped_at = time.perf_counter()
        async with stopped(victim):
            await asyncio.sleep(config.stop_s)  # the stop's length is the fault
        resumed_at = time.perf_counter()
        came = None if again is None else await again()
        await asyncio.sleep(config.after_s)
    return Stop(load, stopped_at, resumed_at, came)
