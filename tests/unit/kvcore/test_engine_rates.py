"""How fast a replica prefills at least, from its engine's own timing of its requests
(``kvcore.policies.engine_rates``), and how a router ranks it by that
(``PrefillRates.rate``)."""

from __future__ import annotations

import random
from itertools import pairwise

import pytest

from kvcore.policies import PrefillLedger
from kvcore.policies.engine_rates import ENGINE_MIN_REQUESTS, EngineRates

PERIOD = 0.5  # the sidecar's load report period


class Engine:
    """A modelled engine as vLLM times it: every request waiting at a step's start is
    admitted in it and records the whole step (its prefills, a decode) as its prefill;
    the running totals are what its load reports carry (counted when a request's first
    token comes: these requests finish at once)."""

    def __init__(self, rate: float, overhead_s: float = 0.005, decode_s: float = 0.01) -> None:
        self.rate, self.overhead_s, self.decode_s = rate, overhead_s, decode_s
        self.now = 0.0
        self.totals = [0.0, 0.0, 0.0]  # requests, seconds, tokens
        self.waiting: list[int] = []
        self.busy_s = 0.0
        self.ending: tuple[float, int, float, int] | None = None  # the last step's end

    def step(self) -> None:
        admitted, self.waiting = self.waiting, []
        length = self.decode_s + sum(self.overhead_s + x / self.rate for x in admitted)
        self.now += length
        self.busy_s += length
        self.ending = (self.now, len(admitted), length * len(admitted), sum(admitted))

    def reported(self, at: float) -> list[float]:
        """The totals a report at ``at`` carries: the steps ended by then."""
        if self.ending is not None and self.ending[0] <= at:
            for i, value in enumerate(self.ending[1:]):
                self.totals[i] += value
            self.ending = None
        return self.totals

    def run(self, until: float, arrivals: list[tuple[float, int]]) -> None:
        """Serve ``arrivals`` ((time, uncached tokens), in order) with steps that start
        before ``until`` (the last may end after it: its requests count then)."""
        while self.now < until:
            while arrivals and arrivals[0][0] <= self.now:
                self.waiting.append(arrivals.pop(0)[1])
            if self.waiting:
                self.reported(self.now)
                self.step()
            elif arrivals and arrivals[0][0] < until:
                self.now = arrivals[0][0]
            else:
                self.now = until


def reports(engine: Engine, seconds: float, per_s: float, seed: int = 1):
    """(at, requests, prefill seconds, computed tokens) every ``PERIOD`` while
    ``engine`` serves Poisson arrivals of 300-3,000-token prompts at ``per_s``."""
    rng = random.Random(seed)
    t, arrivals = engine.now, []
    while t < engine.now + seconds:
        t += rng.expovariate(per_s)
        arrivals.append((t, rng.randrange(300, 3000)))
    at, end = engine.now, engine.now + seconds
    while at < end:
        at += PERIOD
        engine.run(at, arrivals)
        yield (at, *engine.reported(at))


@pytest.mark.parametrize("load", [0.2, 0.7, 1.5])
def test_the_bound_never_exceeds_the_engines_rate_and_a_busy_engine_reads_near_it(
    load: float,
) -> None:
    """At 20% of its capacity an engine's requests are mostly timed alone; at 70% and
    overloaded, several are admitted per step and each records the whole step (their
    recorded seconds run 1.5x and more beyond its busy time). The bound stays below its 10,000
    tokens/s, and on a busy engine within 2x of it: the rate a router ranks it at."""
    engine, rates = Engine(10_000), EngineRates()
    per_s = load * 10_000 / 1650  # the mean prompt takes 0.165 s
    bounds = []
    for at, n, s, x in reports(engine, 60.0, per_s):
        rates.report(0, n, s, x, at)
        if (bound := rates.at_least(0)) is not None:
            bounds.append(bound)
    assert bounds and max(bounds) <= 10_000
    if load > 0.5:
        assert engine.totals[1] > 1.5 * engine.busy_s  # each request counted the whole step
        assert min(bounds[20:]) >= 5_000
    slow, rates = Engine(1_000), EngineRates()
    for at, n, s, x in reports(slow, 60.0, per_s / 10):
        rates.report(0, n, s, x, at)
    assert (rates.at_least(0) or 0.0) <= 1_000


def test_no_data_an_idle_interval_a_restart_and_torn_reports() -> None:
    rates = EngineRates()
    assert rates.at_least(0) is None
    assert not rates.report(0, 0, 0.0, 0, at=0.0)  # the first report: nothing to compare
    rates.report(0, 4, 0.4, 4_000, at=0.5)
    assert rates.at_least(0) is None  # fewer than ENGINE_MIN_REQUESTS
    assert ENGINE_MIN_REQUESTS == 8
    # nothing finished in (0.5, 1.0]: that interval's time joins the next one's
    assert not rates.report(0, 4, 0.4, 4_000, at=1.0)
    assert rates.report(0, 12, 1.2, 12_000, at=2.0)  # 8 more over 1.0 s: 10,000 tokens/s
    told = rates.at_least(0)
    assert told == pytest.approx(10_000, rel=0.01)
    # the engine restarted: its totals start again from 0, what was learned stays
    assert not rates.report(0, 2, 0.1, 1_000, at=2.5)
    assert rates.at_least(0) == told
    assert rates.report(0, 6, 0.5, 9_000, at=3.0)  # differences from the new totals
    # a report torn between series (requests without seconds) teaches nothing
    before = rates.at_least(0)
    assert not rates.report(0, 9, 0.5, 9_000, at=3.5)
    assert rates.at_least(0) == before
    rates.forget(0)
    assert rates.at_least(0) is None


def engine_reports(
    ledger: PrefillLedger, replica: int, speed: float, at: float, totals: list[float], k: int
) -> float:
    """``k`` load reports of ``replica``'s engine, busy prefilling 1,000-token prompts
    at ``speed`` (plus 20 ms around each), one every ``PERIOD``; returns the time."""
    per_request = 0.02 + 1_000 / speed
    for _ in range(k):
        served = PERIOD / per_request
        totals[0] += served
        totals[1] += served * per_request
        totals[2] += served * 1_000
        at += PERIOD
        ledger.rates.engine_report(replica, *totals, at)
    return at


def timed(ledger: PrefillLedger, replica: int, tokens: int, seconds: float, now: float) -> float:
    """One request this router timed on idle ``replica``: its first token after
    ``seconds``."""
    ticket = ledger.sent(replica, tokens, now)
    ledger.first_token(replica, ticket, now + seconds)
    return now + seconds + 1.0


def test_the_learned_rate_follows_the_engines_reported_speed() -> None:
    """Behind four routers, this router's first tokens on replica 0 also wait for the
    other routers' prefills: its timings read 2,500 tokens/s where the engine prefills at
    10,000, and alone they rank it 4x slower. Its engine's reports show it prefilling at
    9,800 at least, so it is ranked at the configured 10,000. When the replica slows to
    2,000 (its engine's reports and the router's timings both show it), the rate
    follows it there within the reports' half-life; when it speeds up again, the
    reports lift it back to 10,000 whatever the router's timings still say."""
    ledger = PrefillLedger(prefill_tokens_per_s=10_000, engine_rates=True)
    plain = PrefillLedger(prefill_tokens_per_s=10_000)
    now, totals = 0.0, [0.0, 0.0, 0.0]
    for i in range(40):
        tokens = (500, 1_000, 2_000, 4_000)[i % 4]
        for book in (ledger, plain):
            timed(book, 0, tokens, 0.08 + tokens / 2_500, now)
        now = timed(ledger, 1, tokens, 0.02 + tokens / 10_000, now)
    assert plain.rates.rate(0) == pytest.approx(2_500, rel=0.02)  # the router's clock
    assert ledger.rates.rate(0) == pytest.approx(2_500, rel=0.02)  # before any report
    now = engine_reports(ledger, 0, 10_000, now, totals, 40)
    assert ledger.rates.engine_rate(0) == pytest.approx(1_000 / 0.12, rel=0.01)
    assert ledger.rates.rate(0) == 10_000
    ranked = []
    for i in range(200):  # slowed to 2,000: both clocks show it
        tokens = (500, 1_000, 2_000, 4_000)[i % 4]
        timed(ledger, 0, tokens, 0.02 + tokens / 2_000, now)
        now = engine_reports(ledger, 0, 2_000, now, totals, 1)
        ranked.append(ledger.rates.rate(0))
    assert ranked[0] == 10_000
    assert ranked[-1] == pytest.approx(2_000, rel=0.1)
    assert all(a >= b for a, b in pairwise(ranked))  # no swing back
    back = []
    for _ in range(120):  # fast again; the router's last timings still read it slow
        now = engine_reports(ledger, 0, 10_000, now, totals, 1)
        back.append(ledger.rates.rate(0))
    assert back[-1] == 10_000 and back.index(10_000) < 60
