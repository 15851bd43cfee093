"""The prefill work a proxy has queued on each replica: ``ReplicaState.queued_prefill_tokens``.

Time to first token on a replica is the prefill work ahead of a request plus its own
uncached tokens, at the replica's prefill rate. A proxy knows its own part of that work
exactly and without delay: every request it sent and whose first token has not come
back is still to prefill, for its prompt tokens minus the cached prefix the residency
map showed when it was routed. The engine's load report says only how many requests
wait, is up to a heartbeat old, and leaves out the prefill in progress, which for long
prompts is most of the wait (Dynamo's router keeps the same books for the same reason).

Tokens sent are not all still ahead: the replica has been prefilling since its queue
last moved. When a first token comes back, the replica has just finished a prefill and
everything still pending starts from there, so that moment *anchors* the queue; between
anchors the replica works through it at ``rate`` tokens per second::

    queued(r, now) = max(0, pending(r) + rate * (around(r) - (now - anchor(r))))

``around(r)`` is the time the step that prefills them takes beyond their tokens
(:meth:`PrefillRates.around_s`, learned: the decode of the running batch the engine
runs in the same step, its overhead, the step under way when they arrived). A request
sent where this proxy's requests still wait for a first token joins the step after
theirs, or theirs if it has not begun (an engine admits every waiting request at the
next step, and each first token of that step comes when its whole prefill is done), so
its first token waits for their step to end: tokens alone drained a 128-token hit's
queue in 13 ms where its step ran 35 ms, and in bench sim's ``one_system_prompt`` a
fifth of the requests went to a replica that read idle in the middle of that step (its
requests' mean TTFT 42 ms against 35 ms on the others). Counted in tokens at ``rate``,
so the wait it makes is ``around(r)`` seconds.

An idle replica (nothing pending) anchors at the next send, and a send never inherits
more work done than was pending (a replica slower than ``rate``, whose estimate reached
zero before its first token, still owes the new request all of it). ``rate`` is only
used to age the queue between first tokens; an error in it is corrected at the next one.

A request can also leave the books without a first token the router saw, and then the
queue is taken to be worked first come, first served (``ahead``: the tokens of this
router's requests sent before it and still pending):

- :meth:`~PrefillLedger.prefilled`: its prefill finished at some time before ``at`` (a
  whole non-streamed answer came back): at least ``ahead`` + its own tokens are done;
- :meth:`~PrefillLedger.dropped`: it ended with no first token (refused, failed,
  cancelled, retried elsewhere): work assumed done on it was wasted, not done on the
  requests behind it.

:class:`PrefillLedger`: ``ticket = sent(r, tokens, at)`` when a request goes upstream,
``first_token(r, ticket, at)`` when its first token arrives, or ``prefilled``/``dropped``
(a second settlement of a ticket is ignored), ``queued_tokens(r, now)`` for the routing
state. O(1) each, except ``prefilled``/``dropped``: O(this router's requests pending on r).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from itertools import count
from math import log2

from kvcore.policies.engine_rates import EngineRates

LEARN_HALF_LIFE = 32.0
"""A replica's learned rate weighs its recent requests: a timing's weight halves with
every this many timed after it."""
LEARN_MIN_SAMPLES = 8.0
"""Timed requests (decayed) a replica needs before its own rate is used; before, the
fleet's median of the learned rates, else the configured one. A replica whose timings
show it much slower than the fleet's needs fewer (:meth:`PrefillRates.slower`)."""
LEARN_FIRST = 2.0
"""Timed requests (decayed: three) before a replica's timings tell anything of it: one
timing may be an accident (a step held by another proxy's long prefill)."""
LEARN_APART = 2.0
"""A replica is ranked at its learned rate when that is this many times slower than the
configured one, at the configured one otherwise: timings are noisy (the time around a
prefill varies with what else the engine runs), ranking equal replicas by their noise
cost up to 70% more mean TTFT in bench sim's Mooncake runs, and a replica ranked faster
than it is would draw every request. A slower GPU or model shows as 2x and more."""
LEARN_MIN_SPREAD = 256.0
"""Tokens (standard deviation) the timed prompts' uncached lengths must vary by: prompts
all of one length cannot tell prefill time from the time spent around it."""


@dataclass(slots=True)
class _Queue:
    pending: dict[int, float] = field(default_factory=dict)  # ticket -> uncached tokens
    tokens: float = 0.0  # sum of pending
    anchor: float = 0.0  # when the replica last started on its pending work
    timed: int = 0  # the ticket sent while nothing was pending, to learn the rate from
    timed_at: float = 0.0  # when it was sent


class PrefillRates:
    """Each replica's prefill throughput, learned from the requests this router timed: a
    request sent when none of this router's was pending there takes

        first token - send = fixed + uncached tokens / rate

    where ``fixed`` is the time around its prefill (the step it waits for, the decode of
    the running requests batched with it, the engine's overhead) and ``rate`` the
    replica's prefill speed. A least-squares line through the timings, each weighing half
    as much ``LEARN_HALF_LIFE`` timings later, gives both, so a replica that slows down
    (a smaller GPU, a longer context) is ranked by its speed within a few dozen
    requests; a replica with too little history reads the fleet's median.

    Timings whose lengths do not vary enough for a line of their own (chats of short
    turns, prompts of one length) still show a replica much slower than the rest: its
    timings against what the fleet's typical replica would take for the same prompts
    (:meth:`slower`), the typical line the median of the replicas' own lines, or without
    any, the median seconds per token.

    **The engine's own timing** (:attr:`engine`, an
    :class:`~kvcore.policies.engine_rates.EngineRates` fed by :meth:`engine_report` from
    the replicas' load reports, when the router keeps one) shows how fast each replica
    prefills at least, the same for every router and with no queue in it: a replica is
    never ranked slower than that (:meth:`rate`), and one it shows no ``LEARN_APART``
    times slower than configured is ranked at the configured rate, whatever this router's
    clock read (which also waits for the other routers' work queued there). A replica
    that is slower shows no bound above its speed, so its timings still rank it. The
    router's own timings still give what only it sees: the time around a prefill
    (:meth:`around_s`, :meth:`step_s`), which ages its books."""

    __slots__ = (
        "_around", "_fits", "_least", "_median", "_per_token", "_steps", "_typical",
        "default", "engine",
    )  # fmt: skip

    def __init__(self, default: float, engine: EngineRates | None = None) -> None:
        self.default = default
        self.engine = engine
        self._fits: dict[int, list[float]] = {}  # replica -> decayed n, Sx, Sy, Sxx, Sxy
        self._median: float | None = None
        self._typical: tuple[float, float] | None = None  # median fixed s, median rate
        self._per_token: float | None = None  # median seconds per timed token
        self._steps: dict[int, float] = {}  # replica -> step_s, where above 0
        # replica -> its recent timings' least ratio to the typical replica's time
        self._least: dict[int, deque[float]] = {}
        self._around = 0.0  # the typical replica's seconds around a prefill

    def observe(self, replica: int, tokens: float, seconds: float) -> None:
        """A request of ``tokens`` uncached tokens to idle ``replica`` had its first
        token ``seconds`` after it was sent."""
        if tokens < 0 or seconds <= 0:
            return
        expected = self._expected(1.0, tokens)
        if expected:
            least = self._least.setdefault(replica, deque(maxlen=round(LEARN_MIN_SAMPLES)))
            least.append(seconds / expected)
        fit = self._fits.get(replica)
        if fit is None:
            fit = self._fits[replica] = [0.0] * 5
        keep = _KEEP
        for i, value in enumerate((1.0, tokens, seconds, tokens * tokens, tokens * seconds)):
            fit[i] = fit[i] * keep + value
        lines = [line for line in map(self.line, self._fits) if line is not None]
        median = _median(rate for _, rate in lines)
        self._median = None if median is None else _rounded(median)
        fixed = _median(fixed for fixed, _ in lines)
        self._typical = None if fixed is None or median is None else (fixed, median)
        fits = [f for f in self._fits.values() if f[0] >= LEARN_FIRST and f[1] > 0]
        self._per_token = _median(f[2] / f[1] for f in fits)
        self._steps = self._slow_steps()

    def learned(self, replica: int) -> float | None:
        """``replica``'s own prefill rate, once its timings can tell it."""
        line = self.line(replica)
        return None if line is None else line[1]

    def line(self, replica: int) -> tuple[float, float] | None:
        """``replica``'s fitted (fixed seconds, tokens per second), once it has
        ``LEARN_MIN_SAMPLES`` timings whose lengths vary and a line that rises."""
        fit = self._fits.get(replica)
        if fit is None or fit[0] < LEARN_MIN_SAMPLES:
            return None
        n, sx, sy, sxx, sxy = fit
        spread = n * sxx - sx * sx
        if spread < (n * LEARN_MIN_SPREAD) ** 2:
            return None
        slope = (n * sxy - sx * sy) / spread
        if slope <= 0:
            return None
        return max((sy - slope * sx) / n, 0.0), 1 / slope

    def slower(self, replica: int) -> float | None:
        """How many times as long as the fleet's typical replica ``replica`` took over
        its timings: against the typical line when the fleet has one; else against the
        typical replica's time around a prefill plus the tokens at the typical rate; else
        seconds per token against the median's. (Short prompts' time is mostly the time
        around them: per token, an engine ten times slower in every step read 2x slower
        than the fleet in real processes, against its time 4.4x.)

        Told after ``LEARN_MIN_SAMPLES`` timings, or sooner when the gap is wide:
        ``n`` timings (``LEARN_FIRST`` at least) each ``LEARN_MIN_SAMPLES * LEARN_APART /
        n`` or more times the typical replica's (10x after three; each timing more sends
        it a request it serves ten times slower). :meth:`rate` ranks a replica slower
        only when each of its recent timings (the last ``LEARN_MIN_SAMPLES``) was
        ``LEARN_APART`` times the typical or more, not their sum: noise only lengthens a
        timing (behind several proxies, one waits for another proxy's long prefill and
        reads 10x), and judged by their sum an ordinary replica behind eight proxies was
        ranked slow (bench sim's e2e_shared_prefix lost 1.5 points of hit rate)."""
        fit = self._fits.get(replica)
        if fit is None or fit[0] < LEARN_FIRST:
            return None
        n, tokens, seconds = fit[0], fit[1], fit[2]
        expected = self._expected(n, tokens)
        if not expected:
            return None
        told = n >= LEARN_MIN_SAMPLES or self._apart(replica, n)
        return seconds / expected if told else None

    def _apart(self, replica: int, n: float) -> bool:
        """Whether each of ``replica``'s recent timings (``n`` in all) took ``LEARN_APART``
        times the typical replica's or more, ``LEARN_MIN_SAMPLES * LEARN_APART / n`` times
        with fewer than ``LEARN_MIN_SAMPLES`` (see :meth:`slower`)."""
        least = min(self._least.get(replica) or [0.0])
        return min(n, LEARN_MIN_SAMPLES) * least >= LEARN_MIN_SAMPLES * LEARN_APART

    def _expected(self, n: float, tokens: float) -> float | None:
        """Seconds the fleet's typical replica takes for ``n`` timings of ``tokens`` in
        all (see :meth:`slower`); ``None`` while nothing tells."""
        typical = self._typical
        if typical is None and self._around > 0:  # no line: the typical time around
            typical = self._around, self.typical_rate()  # a prefill, at the typical rate
        if typical is not None:
            fixed, rate = typical
            expected = n * fixed + tokens / rate
        elif self._per_token is not None and tokens > 0:
            expected = self._per_token * tokens
        else:
            return None
        return expected if expected > 0 else None

    def engine_report(
        self, replica: int, requests: float, seconds: float, tokens: float, at: float
    ) -> None:
        """``replica``'s load report carried these totals of its engine's prefill timing
        (see :class:`~kvcore.policies.engine_rates.EngineRates`); ignored without
        :attr:`engine`."""
        engine = self.engine
        if engine is not None and engine.report(replica, requests, seconds, tokens, at):
            self._steps = self._slow_steps()

    def engine_rate(self, replica: int) -> float | None:
        """Tokens per second ``replica`` prefills at least, as its engine's own timing
        shows (``None``: it does not tell yet, or no engine figures are kept)."""
        engine = self.engine
        return None if engine is None else engine.bounds.get(replica)

    def rate(self, replica: int) -> float:
        """Tokens per second ``replica`` prefills, as routing ranks it: by this router's
        timings, the configured rate unless the replica's own is ``LEARN_APART`` times
        slower (then its own); for a replica without a line of its own, the fleet's
        typical rate over :meth:`slower` when that is ``LEARN_APART`` or more, else as
        one with no history: the fleet's median when that is ``LEARN_APART`` times
        slower than configured, else the configured rate. Never below what the engine's
        own timing shows it prefills at least (:meth:`engine_rate`): where that bound
        is above the timings' rate, the bound, or the configured rate once the bound is
        no longer ``LEARN_APART`` times slower than it."""
        clocked = self._clocked_rate(replica)
        engine = self.engine
        if engine is not None and engine.bounds:
            bound = engine.bounds.get(replica)
            if bound is not None and bound > clocked:
                return self.default if bound >= self.default / LEARN_APART else _rounded(bound)
        return clocked

    def _clocked_rate(self, replica: int) -> float:
        """:meth:`rate` by this router's timings alone."""
        slow = self.default / LEARN_APART
        own = self.learned(replica)
        if own is not None:
            return _rounded(own) if own < slow else self.default
        typical = self.typical_rate()
        slower = self.slower(replica)
        if slower is not None and slower >= LEARN_APART and self._apart(replica, LEARN_MIN_SAMPLES):
            return _rounded(typical / slower)
        return typical

    def typical_rate(self) -> float:
        """The rate of a replica with no history: the fleet's median when that is
        ``LEARN_APART`` times slower than configured, else the configured rate."""
        median = self._median
        return (
            median if median is not None and median < self.default / LEARN_APART else self.default
        )

    def own_around_s(self, replica: int) -> float | None:
        """Seconds ``replica``'s timed requests took beyond their uncached tokens at the
        rate routing ranks it at (:meth:`rate`), on average: the time around a prefill
        there (the step it waits for, the decode steps batched with it, the engine's
        overhead); ``None`` before ``LEARN_FIRST`` timings."""
        fit = self._fits.get(replica)
        if fit is None or fit[0] < LEARN_FIRST:
            return None
        n, tokens, seconds = fit[0], fit[1], fit[2]
        return max((seconds - tokens / self.rate(replica)) / n, 0.0)

    def around_s(self, replica: int) -> float:
        """Seconds the step that prefills a request on ``replica`` takes beyond its
        tokens: the fleet's typical replica's :meth:`own_around_s`, plus :meth:`step_s`
        on a replica ranked slower; 0 before any replica was timed."""
        return self._around + self._steps.get(replica, 0.0)

    def step_s(self, replica: int) -> float:
        """Seconds more than on the fleet's typical replica that a request waits around
        its prefill on ``replica``, for a replica ranked slower than one with no history
        (0 for the others, whose differences are the timings' noise): a replica ten
        times slower in every step also runs its decode steps ten times as long, and
        each of them delays the prefills that wait for it."""
        return self._steps.get(replica, 0.0)

    def _slow_steps(self) -> dict[int, float]:
        """:meth:`step_s` of every replica ranked slow, from the timings as they are."""
        typical = self.typical_rate()
        around = {o: a for o in self._fits if (a := self.own_around_s(o)) is not None}
        slow = {o for o in around if self.rate(o) < typical}
        fixed = _median(a for o, a in around.items() if o not in slow)
        self._around = fixed or 0.0
        if fixed is None:
            return {}
        return {o: around[o] - fixed for o in slow if around[o] > fixed}

    def keep_engine(self, *, on: bool) -> None:
        """Keep (or stop keeping, dropping every bound they gave) the engines' own
        prefill timing (:meth:`engine_report`)."""
        if on and self.engine is None:
            self.engine = EngineRates()
        elif not on and self.engine is not None:
            self.engine = None
            self._steps = self._slow_steps()

    def forget(self, replica: int) -> None:
        self._fits.pop(replica, None)
        self._steps.pop(replica, None)
        self._least.pop(replica, None)
        if self.engine is not None:
            self.engine.forget(replica)


_KEEP = 0.5 ** (1 / LEARN_HALF_LIFE)


def _rounded(rate: float) -> float:
    """``rate`` to the nearest 1/64 of an octave (about 1%): replicas whose rates differ
    by less compare as one kind of queue (``kvcore.policies.board``), and a rate that
    wavers within it changes no replica's state."""
    return float(2 ** (round(log2(rate) * 64) / 64))


def _median(values: Iterable[float]) -> float | None:
    ordered = sorted(values)
    if not ordered:
        return None
    middle = len(ordered) // 2
    return ordered[middle] if len(ordered) % 2 else (ordered[middle - 1] + ordered[middle]) / 2


class PrefillLedger:
    """Per replica ordinal: this proxy's requests still waiting for their first token."""

    __slots__ = ("_queues", "_tickets", "rates")

    def __init__(self, prefill_tokens_per_s: float, *, engine_rates: bool = False) -> None:
        """``engine_rates``: rank replicas by their engines' own prefill timing where it
        tells (:meth:`PrefillRates.engine_report`)."""
        if prefill_tokens_per_s <= 0:
            raise ValueError("prefill_tokens_per_s must be positive")
        engine = EngineRates() if engine_rates else None
        self.rates = PrefillRates(prefill_tokens_per_s, engine)
        self._queues: dict[int, _Queue] = {}
        self._tickets = count(1)

    @property
    def rate(self) -> float:
        """The configured rate: a replica's until it has a learned one (or the fleet has)."""
        return self.rates.default

    @rate.setter
    def rate(self, value: float) -> None:
        self.rates.default = value

    def sent(self, replica: int, uncached_tokens: float, at: float) -> int:
        """A request with ``uncached_tokens`` to prefill went to ``replica`` at ``at``;
        returns the ticket for :meth:`first_token`."""
        queue = self._queues.get(replica)
        if queue is None:
            queue = self._queues[replica] = _Queue()
        ticket = next(self._tickets)
        if not queue.pending:
            queue.anchor = queue.timed_at = at  # idle: the replica starts on it now
            queue.timed = ticket
        else:  # work beyond what it had been sent is no head start on this one
            queue.anchor = max(queue.anchor, at - queue.tokens / self.rates.rate(replica))
        tokens = max(float(uncached_tokens), 0.0)
        queue.pending[ticket] = tokens
        queue.tokens += tokens
        return ticket

    def first_token(self, replica: int, ticket: int, at: float) -> None:
        """The request of ``ticket`` produced its first token at ``at``."""
        queue = self._queues.get(replica)
        if queue is None or ticket not in queue.pending:
            return
        tokens = queue.pending.pop(ticket)
        queue.tokens -= tokens
        if not queue.pending:
            queue.tokens = 0.0  # no drift from float sums
        if ticket == queue.timed:
            self.rates.observe(replica, tokens, at - queue.timed_at)
        queue.anchor = max(queue.anchor, at)

    def prefilled(self, replica: int, ticket: int, at: float) -> None:
        """The request of ``ticket`` was prefilled at some time before ``at`` (its whole
        answer came back at once)."""
        self._settle(replica, ticket, at, done=True)

    def dropped(self, replica: int, ticket: int, at: float) -> None:
        """The request of ``ticket`` ended at ``at`` without a first token."""
        self._settle(replica, ticket, at, done=False)

    def _settle(self, replica: int, ticket: int, at: float, *, done: bool) -> None:
        queue = self._queues.get(replica)
        if queue is None or ticket not in queue.pending:
            return
        ahead = 0.0
        for other, pending in queue.pending.items():
            if other == ticket:
                break
            ahead += pending
        tokens = queue.pending.pop(ticket)
        at = max(at, queue.anchor)
        rate = self.rates.rate(replica)
        drained = rate * (at - queue.anchor)  # work the replica has done since
        if done:
            drained = max(drained, ahead + tokens)
        drained -= min(max(drained - ahead, 0.0), tokens)  # of which on the others
        queue.tokens = queue.tokens - tokens if queue.pending else 0.0
        queue.anchor = at - drained / rate

    def queued_tokens(self, replica: int, now: float) -> float:
        """Prefill work ``replica`` still owes this proxy's requests, in prompt tokens
        at its rate: their uncached tokens and the time around the step that prefills
        them (:meth:`PrefillRates.around_s`), less what it has done since the anchor."""
        queue = self._queues.get(replica)
        if queue is None or not queue.pending:
            return 0.0
        rates = self.rates
        left = rates.around_s(replica) - max(0.0, now - queue.anchor)
        return max(0.0, queue.tokens + rates.rate(replica) * left)

    def pending(self, replica: int) -> int:
        """This proxy's requests on ``replica`` still waiting for their first token."""
        queue = self._queues.get(replica)
        return 0 if queue is None else len(queue.pending)

    def forget(self, replica: int) -> None:
        """Drop ``replica``'s books (it left the fleet; its ordinal may be reused)."""
        self._queues.pop(replica, None)
        self.rates.forget(replica)
