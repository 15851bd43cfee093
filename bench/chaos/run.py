"""One chaos run: the fleet up, the steady load on, the faults in turn, each measured.

Per fault, from outside, as a client and an operator would see it:

- **failed / sent**: requests sent from the fault's start until the next fault's that
  failed (any status but 200, a broken stream, no token, or a stream ended by an error
  event), except a stream already running on a replica that was then killed, which may
  end with a clean error event (counted apart, as *cut*);
- **converged**: seconds from the fault's end until the residency equals the engines'
  caches again, key for key, on both control planes (:mod:`bench.chaos.residency`);
- **predicted vs measured cached tokens** *during* (from the fault's start until it has
  converged) and *after* (the ``after_s`` that follow): the proxies' prediction
  (``x-kvroute-prefix-blocks``) against the engines' ``cached_tokens``;
- **TTFT p99 during**.

The targets are the issue's (0 failed, the residency equal again) and, where it names
none, ours: converged within ``CONVERGED_TARGET_S``, predicted within
``PREDICTION_TARGET`` of measured after the fault.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from bench.chaos.faults import FAULTS, Scene, Window
from bench.chaos.fleet import ChaosFleet, chaos_options
from bench.chaos.residency import Check, PromptBook, compare
from bench.chaos.soak import RSS_TARGET, ProcessTrend, sample_children_async
from bench.faults.load import SteadyLoad, p99
from kvcore.keys import DEFAULT_BLOCK_SIZE
from kvroute.demo import Answer
from kvroute.up import SIM_MODEL

CONVERGED_TARGET_S = 10.0
PREDICTION_TARGET = 0.10  # |predicted - measured| / measured, after the fault
CHECK_EVERY_S = 1.0  # the convergence poll's pace (each check takes ~SETTLE_S too)


@dataclass(frozen=True)
class ChaosConfig:
    faults: tuple[str, ...] = tuple(FAULTS)
    replicas: int = 6
    rate: float = 10.0  # requests/s, open loop
    prompts: int = 3  # shared system prompts
    hold_s: float = 10.0
    partition_s: float = 60.0
    warmup_s: float = 5.0
    after_s: float = 10.0
    converge_deadline_s: float = 60.0


@dataclass
class FaultResult:
    name: str
    what: str
    note: str
    victim: str
    began: float  # perf_counter
    fault_s: float
    sent: int
    failed: int
    cut: int  # streams on a killed replica ended by a clean error event (allowed)
    converged_s: float | None  # None: not equal within the deadline
    predicted_during: int
    measured_during: int
    predicted_after: int
    measured_after: int
    ttft_p99_during_s: float | None
    trace: list[dict[str, Any]] = field(default_factory=list)  # the checks, in order

    @property
    def prediction_error_after(self) -> float | None:
        if self.measured_after == 0:
            return None
        return abs(self.predicted_after - self.measured_after) / self.measured_after

    @property
    def met(self) -> dict[str, bool]:
        error = self.prediction_error_after
        converged = self.converged_s
        return {
            "failed": self.failed == 0,
            "converged": converged is not None and converged <= CONVERGED_TARGET_S,
            "prediction_after": error is not None and error <= PREDICTION_TARGET,
        }

    def summary(self) -> dict[str, Any]:
        return {
            "fault": self.name,
            "what": self.what,
            "note": self.note,
            "victim": self.victim,
            "fault_s": round(self.fault_s, 2),
            "sent": self.sent,
            "failed": self.failed,
            "cut_on_killed_replica": self.cut,
            "converged_s": None if self.converged_s is None else round(self.converged_s, 2),
            "cached_tokens": {
                "predicted_during": self.predicted_during,
                "measured_during": self.measured_during,
                "predicted_after": self.predicted_after,
                "measured_after": self.measured_after,
            },
            "ttft_p99_during_s": self.ttft_p99_during_s,
            "targets": {
                "failed": 0,
                "converged_s": CONVERGED_TARGET_S,
                "prediction_error_after": PREDICTION_TARGET,
            },
            "met": self.met,
            "trace": self.trace,
        }


def predicted_tokens(answer: Answer) -> int:
    head = answer.prefix_blocks.split("/")[0]
    return int(head) * DEFAULT_BLOCK_SIZE if head.isdigit() else 0


class ChaosRun:
    """The fleet, the load, the book of prompts; :meth:`fault` runs one fault."""

    def __init__(self, config: ChaosConfig, fleet: ChaosFleet, session: aiohttp.ClientSession):
        self.config, self.fleet, self.session = config, fleet, session
        self.scene = Scene(fleet, session, config.hold_s, config.partition_s)
        self.book = PromptBook(SIM_MODEL, fleet.options.tokenizer, fleet.options.event_format)
        self.load: SteadyLoad | None = None
        self._booked = self._extra_booked = 0
        self._counted: set[int] = set()  # answers ended by an error event, already counted

    # -- measuring ---------------------------------------------------------------
    def _sync_book(self) -> None:
        """Every prompt sent so far in the book."""
        assert self.load is not None
        for index in range(self._booked, self.load.sent):
            self.book.add_chat(self.load.body(index)["messages"])
        self._booked = self.load.sent
        for body in self.scene.extra_bodies[self._extra_booked :]:
            self.book.add_chat(body["messages"])
        self._extra_booked = len(self.scene.extra_bodies)

    async def check(self) -> list[Check]:
        """One key-for-key check against each control plane that answers."""
        self._sync_book()
        engines = {f"r{i}": url for i, url in enumerate(self.fleet.fleet.engines)}
        checks = []
        for address in self.fleet.fleet.grpc_addresses:
            try:
                checks.append(await compare(self.session, engines, address, self.book, _now))
            except (OSError, TimeoutError, aiohttp.ClientError, ConnectionError) as exc:
                checks.append(Check(_now(), f"{address} ({exc.__class__.__name__})"))
        return checks

    async def converge(self, since: float) -> tuple[float | None, list[dict[str, Any]]]:
        """Seconds from ``since`` until a check finds every control plane equal to the
        engines (None within the deadline), and every check made."""
        trace: list[dict[str, Any]] = []
        deadline = since + self.config.converge_deadline_s
        while _now() < deadline:
            checks = await self.check()
            trace.extend({"t_s": round(c.at - since, 2), **c.summary()} for c in checks)
            answered = [c for c in checks if c.replicas]
            if len(answered) == len(checks) and all(c.equal for c in checks):
                return max(c.at for c in checks) - since, trace
            await asyncio.sleep(CHECK_EVERY_S)  # the poll's pace
        return None, trace

    # -- one fault ---------------------------------------------------------------
    def _failures(self) -> int:
        assert self.load is not None
        return self.load.result.errors + self.scene.extra_result.errors

    def _answers(self) -> list[Answer]:
        assert self.load is not None
        return self.load.result.answers + self.scene.extra_result.answers

    async def fault(self, name: str) -> FaultResult:
        assert self.load is not None
        fault, what = FAULTS[name]
        errors_before, sent_before = self._failures(), self._sent()
        window = await fault(self.scene)
        converged, trace = await self.converge(window.ended)
        during_end = window.ended + (converged or self.config.converge_deadline_s)
        await asyncio.sleep(self.config.after_s)  # the after window's length
        await asyncio.gather(*self.scene.extra)
        self.scene.extra.clear()
        return self._result(name, what, window, during_end, converged, trace, errors_before,
                            sent_before)  # fmt: skip

    def _sent(self) -> int:
        assert self.load is not None
        return self.load.sent + len(self.scene.extra_bodies)

    def _result(
        self,
        name: str,
        what: str,
        window: Window,
        during_end: float,
        converged: float | None,
        trace: list[dict[str, Any]],
        errors_before: int,
        sent_before: int,
    ) -> FaultResult:
        answers = [a for a in self._answers() if a.sent_at >= window.began - 60.0]
        ended_by_error = [a for a in answers if a.error and id(a) not in self._counted]
        cut = [a for a in ended_by_error if a.replica == window.victim and a.sent_at < window.began]
        during = [a for a in answers if window.began <= a.sent_at < during_end]
        after = [a for a in answers if during_end <= a.sent_at]
        failed = self._failures() - errors_before + len(ended_by_error) - len(cut)
        self._counted.update(id(a) for a in ended_by_error)  # not again by the next fault
        return FaultResult(
            name,
            what,
            window.note,
            window.victim,
            window.began,
            window.ended - window.began,
            self._sent() - sent_before,
            failed,
            len(cut),
            converged,
            sum(predicted_tokens(a) for a in during),
            sum(a.cached_tokens for a in during),
            sum(predicted_tokens(a) for a in after),
            sum(a.cached_tokens for a in after),
            p99([a.ttft_s for a in during]),
            trace,
        )

    async def baseline(self) -> FaultResult:
        """No fault: whether the residency equals the caches at all under the load."""
        errors_before, sent_before = self._failures(), self._sent()
        now = _now()
        converged, trace = await self.converge(now)
        window = Window(now, now, note="no fault: the checker's own baseline")
        await asyncio.sleep(self.config.after_s)
        end = now + (converged or self.config.converge_deadline_s)
        return self._result("baseline", "none", window, end, converged, trace, errors_before,
                            sent_before)  # fmt: skip


@dataclass(frozen=True)
class SoakConfig:
    duration_s: float = 1200.0
    rate: float = 7.0  # requests/s
    warmup_s: float = 60.0  # not measured: caches fill, pools open
    sample_s: float = 10.0
    check_every: int = 3  # a residency check every this many samples


@dataclass
class SoakResult:
    config: SoakConfig
    sent: int
    failed: int
    ttft_p99_s: float | None
    checks: list[dict[str, Any]]
    processes: list[ProcessTrend]

    @property
    def met(self) -> dict[str, bool]:
        return {
            "failed": self.failed == 0,
            "rss_flat": all(abs(p.rss_change or 0.0) <= RSS_TARGET for p in self.processes),
            "never_above_caches": bool(self.checks) and max(c["extra"] for c in self.checks) == 0,
            "no_fd_growth": all(p.fd_growth <= 0 for p in self.processes),
        }

    def summary(self) -> dict[str, Any]:
        c = self.config
        return {
            "duration_s": c.duration_s,
            "rate": c.rate,
            "warmup_s": c.warmup_s,
            "sent": self.sent,
            "failed": self.failed,
            "ttft_p99_s": self.ttft_p99_s,
            "checks": len(self.checks),
            "max_extra_keys": max((k["extra"] for k in self.checks), default=None),
            "max_missing_keys": max((k["missing"] for k in self.checks), default=None),
            "targets": {"failed": 0, "rss_change": RSS_TARGET, "extra_keys": 0, "fd_growth": 0},
            "met": self.met,
            "processes": [p.summary() for p in self.processes],
            "rss_series_mib": {
                p.name: [(round(t, 1), round(s.rss_kib / 1024, 1)) for t, s in p.samples]
                for p in self.processes
            },
            "fd_series": {p.name: [s.fds for _, s in p.samples] for p in self.processes},
            "trace": self.checks,
        }


async def soak(run: ChaosRun, config: SoakConfig) -> SoakResult:
    """The fleet under ``config.rate`` for ``config.duration_s``, sampled (see soak.py)."""
    trends: dict[str, ProcessTrend] = {}
    checks: list[dict[str, Any]] = []
    async with SteadyLoad(run.session, run.fleet.url, config.rate, run.config.prompts) as load:
        run.load = load
        start = _now()
        await asyncio.sleep(min(config.warmup_s, config.duration_s))  # the soak's warm-up
        samples = 0
        while _now() - start < config.duration_s:
            await sample_children_async(run.fleet.running(), trends, _now() - start)
            if samples % config.check_every == 0:
                for check in await run.check():
                    checks.append({"t_s": round(check.at - start, 1), **check.summary()})
            samples += 1
            await asyncio.sleep(config.sample_s)  # the sampling's pace
    failed = load.result.errors + sum(1 for a in load.result.answers if a.error)
    ttft = p99([a.ttft_s for a in load.result.answers])
    return SoakResult(config, load.sent, failed, ttft, checks, list(trends.values()))


def _now() -> float:
    return time.perf_counter()


@dataclass
class ChaosResult:
    faults: list[FaultResult] = field(default_factory=list)
    soak: SoakResult | None = None
    timeline: list[tuple[float, float]] = field(default_factory=list)  # (sent, TTFT) s
    windows: list[tuple[str, float, float]] = field(default_factory=list)  # fault, from, to


async def run_chaos(
    config: ChaosConfig, run_dir: Path, soak_config: SoakConfig | None = None
) -> ChaosResult:
    """Start the fleet, run the baseline and each fault under the load, then the soak
    (when asked), stop."""
    fleet = ChaosFleet(chaos_options(run_dir, config.replicas))
    result = ChaosResult()
    try:
        await fleet.start()
        timeout = aiohttp.ClientTimeout(total=120)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            run = ChaosRun(config, fleet, session)
            async with SteadyLoad(session, fleet.url, config.rate, config.prompts) as load:
                run.load = load
                start = _now()
                await asyncio.sleep(config.warmup_s)  # the load's warm-up: the schedule
                result.faults.append(await run.baseline())
                for name in config.faults:
                    result.faults.append(await run.fault(name))
            result.timeline = [(a.sent_at - start, a.ttft_s) for a in run._answers()]
            result.windows = [(f.name, f.began - start, f.began - start + f.fault_s)
                              for f in result.faults]  # fmt: skip
            if soak_config is not None:
                result.soak = await soak(run, soak_config)
    finally:
        await fleet.aclose()
    return result
