"""How fast each replica prefills at least, from the engine's own timing of its requests,
as every router reads it alike.

A router that times a replica by its own clock (:class:`~kvcore.policies.prefill.
PrefillRates`) also waits for whatever else the replica had queued: behind several
routers, the other routers' prefills, which its books do not hold. On a busy fleet each
router's line for each replica then reads slower by chance (2.5-4x in bench sim's RAG
behind four routers), and the replicas not yet read slow draw the requests. The engine
times each request's prefill itself, from the step that first admits it to its first
token, and its load report carries the running totals (``LoadReport.prefill_requests``,
``prefill_seconds``, ``prefill_computed_tokens``; their sources in
``sidecar/load_metrics.py``, the engines' definitions in ``enginesim/metrics.py``). No
queue enters them, and every router reads the same reports.

**What they tell: a bound.** Requests an engine admits in one step each record the whole
step as their prefill (both prefills, and the decode the step also ran), so on a busy
engine the sum of the recorded seconds runs far beyond the time it spent prefilling
(bench sim's RAG at its capacity: 2.5-3.2x), and no fit of seconds against tokens recovers
its rate from the totals. But every computed token took the engine some of that time,
and some of the wall-clock time too, since it runs one step at a time: over a window of
reports, with ``x`` tokens computed, ``s`` seconds recorded and ``wall`` seconds on the
report clock, the engine prefills at least ``x / min(s, wall)`` tokens per second. On an
idle fleet ``s`` is the smaller (each request timed alone, its step's overhead and decode
included); on a busy one ``wall`` (the computed tokens' throughput). A replica ten times
slower can never show a bound above its rate; one whose router clock read it slow
because of the work queued ahead of it shows it is not.

**Rules.**

- no data yet (fewer than ``ENGINE_MIN_REQUESTS`` timed requests, decayed): nothing is
  said, the router's own timings stand;
- the window: each report's differences weigh half as much ``ENGINE_HALF_LIFE`` reports
  with finished requests later (a replica that slows down shows it within a minute);
- an interval in which nothing finished (an idle engine, or one whose requests are all
  still decoding) is not an interval: its totals and time carry over into the next one
  that has some (vLLM observes a request's phases when it finishes);
- a total that went back (an engine restart: its counters start again at zero) starts the
  differences again from the new totals, keeping what was learned (same replica, same
  hardware); a replica that leaves is forgotten (:meth:`EngineRates.forget`);
- outliers: an interval with requests but no seconds or no tokens (a report torn between
  series) is skipped; a recorded time above the window's is the window's (the bound).
"""

from __future__ import annotations

from dataclasses import dataclass, field

ENGINE_HALF_LIFE = 32.0
"""Intervals (load reports with finished requests) after which one weighs half."""
ENGINE_MIN_REQUESTS = 8.0
"""Timed requests (decayed) before the engine's figures say anything."""
_KEEP = 0.5 ** (1 / ENGINE_HALF_LIFE)


@dataclass(slots=True)
class _Replica:
    last: tuple[float, float, float, float] | None = None  # requests, seconds, tokens, at
    sums: list[float] = field(default_factory=lambda: [0.0] * 4)  # decayed n, s, x, wall


class EngineRates:
    """What the engines' own timing shows of each replica's prefill speed, by key."""

    __slots__ = ("_replicas", "bounds")

    def __init__(self) -> None:
        self._replicas: dict[int, _Replica] = {}
        self.bounds: dict[int, float] = {}
        """Replica -> tokens per second it prefills at least (:meth:`at_least`), for
        those whose engine tells it."""

    def report(
        self, replica: int, requests: float, seconds: float, tokens: float, at: float
    ) -> bool:
        """The replica's engine reported these running totals (timed requests, their
        prefill seconds, their computed prompt tokens) at ``at`` (the report's clock, in
        seconds). Returns whether :meth:`at_least` changed."""
        state = self._replicas.get(replica)
        if state is None:
            state = self._replicas[replica] = _Replica()
        last, state.last = state.last, (requests, seconds, tokens, at)
        if last is None:
            return False
        n, s, x, wall = requests - last[0], seconds - last[1], tokens - last[2], at - last[3]
        if n < 0 or s < 0 or x < 0:  # the counters went back: the engine restarted
            return False
        if n == 0:  # nothing finished: the interval carries over into the next
            state.last = last
            return False
        if s <= 0 or x <= 0 or wall <= 0:
            return False
        sums, keep = state.sums, _KEEP
        for i, value in enumerate((n, s, x, wall)):
            sums[i] = sums[i] * keep + value
        bounds = self.bounds
        before = bounds.get(replica)
        n, s, x, wall = sums
        if n >= ENGINE_MIN_REQUESTS:
            bounds[replica] = x / min(s, wall)
        else:
            bounds.pop(replica, None)
        return bounds.get(replica) != before

    def at_least(self, replica: int) -> float | None:
        """Tokens per second ``replica`` prefills at least, by its engine's timing;
        ``None`` before ``ENGINE_MIN_REQUESTS`` timed requests."""
        return self.bounds.get(replica)

    def forget(self, replica: int) -> None:
        self._replicas.pop(replica, None)
        self.bounds.pop(replica, None)
