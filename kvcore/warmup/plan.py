"""What to warm a replica with, in which order, and how fast: pure planning and pacing.

A replica that joins empty is sent hot prefixes once each, as one-token completions.
:func:`plan` orders the prefixes by the queue they would unload (``pressure``: the load
of the least busy replica holding each, so that the prefixes whose holders are the most
overloaded go first, and one no other replica holds before all), then by value, requests
per second times the tokens the replica does not hold yet (a prefix it holds whole is
skipped), and keeps to the total budget; :func:`stagger` reorders it for a replica
joining while others warm, so that each starts with the prefixes the others will send
last, and :func:`share` keeps of it the replica's part when several warm together (the
prefixes the fleet would move to it, not every hot prefix: the rest it takes as any
other replica once its warm-up ends). :class:`Pacer` spaces the
sends so that no more than ``tokens_per_s`` prompt tokens a second reach the replica (a
token bucket holding one second's worth).
:class:`Warming` is one replica's warm-up as it goes: prefixes sent, confirmed by the
replica's KV events, failed; when it ends and why.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from kvcore.warmup.hot_prefixes import HotPrefix
from kvcore.workload.warmup import WarmupSettings

HeldBlocks = Callable[[HotPrefix], int]  # leading blocks of the prefix the replica holds
# how loaded the least busy other replica holding the prefix is (inf: no other holds it)
Pressure = Callable[[HotPrefix], float]


@dataclass(frozen=True, slots=True)
class Step:
    """One prefix to send: ``uncached`` of its tokens are new to the replica."""

    prefix: HotPrefix
    uncached: int
    pressure: float = 0.0

    @property
    def value(self) -> float:
        return self.prefix.requests_per_s * self.uncached


def plan(
    prefixes: Sequence[HotPrefix],
    held: HeldBlocks,
    max_tokens: int,
    pressure: Pressure | None = None,
) -> list[Step]:
    """The prefixes worth sending, those whose holders are the most loaded first
    (``pressure``; without it all count alike), then the most valuable, within
    ``max_tokens`` in all."""
    steps = []
    for prefix in prefixes:
        uncached = (prefix.blocks - held(prefix)) * prefix.block_size
        if uncached > 0:
            steps.append(Step(prefix, uncached, 0.0 if pressure is None else pressure(prefix)))
    steps.sort(key=lambda s: (s.pressure, s.value, s.uncached), reverse=True)
    kept, spent = [], 0
    for step in steps:
        cost = len(step.prefix.tokens)  # the engine is sent (and may recompute) all of it
        if spent + cost <= max_tokens:
            kept.append(step)
            spent += cost
    return kept


def stagger(steps: Sequence[Step], others: Sequence[Sequence[int]]) -> list[Step]:
    """``steps`` (most valuable first) for a replica that starts warming while others do
    (``others``: each running warm-up's prefix keys still to send, in order): first the
    prefixes no other will send, then those the others reach late (at or past the median
    of their soonest places), then the rest; each part most valuable first.

    Replicas that join together (a scale-out) would otherwise all be sent the same prefix
    first: for the seconds their warm-ups take (each prefix a prefill of its length),
    every joiner holds the same few prefixes and the requests for the others still queue
    on the old replicas. Staggered, two joiners start half a plan apart and hold twice as
    many different prefixes until they meet."""
    soonest: dict[int, int] = {}  # prefix key -> its earliest place in another's queue
    for queue in others:
        for place, key in enumerate(queue):
            soonest[key] = min(place, soonest.get(key, place))
    places = sorted(soonest.values())
    median = (places[(len(places) - 1) // 2] + places[len(places) // 2]) / 2 if places else 0
    alone = [step for step in steps if step.prefix.key not in soonest]
    late = [step for step in steps if soonest.get(step.prefix.key, -1) >= median]
    soon = [step for step in steps if -1 < soonest.get(step.prefix.key, -1) < median]
    return alone + late + soon


def share(steps: Sequence[Step], warming: int, others: Sequence[Sequence[int]] = ()) -> list[Step]:
    """One replica's part of ``steps`` (in their order) when ``warming`` replicas warm
    together (itself included; ``others``: the running warm-ups' keys still to send):
    the prefixes no other is sent, until they carry ``1 / warming`` of the requests per
    second; only when every prefix goes to another already, that much of the others'.

    Each warms what it would take of the traffic rather than every hot prefix: a
    prefix's prefill on the joiner holds its running requests and keeps the fleet's
    overflow off it for as long, and what it was not warmed with it takes, once its
    warm-up ends, as any other replica would (measured in ``docs/benchmarks.md``,
    "Fleet changes")."""
    if warming <= 1:
        return list(steps)
    taken = {key for queue in others for key in queue}
    wanted = sum(step.prefix.requests_per_s for step in steps) / warming
    alone = [step for step in steps if step.prefix.key not in taken]
    kept: list[Step] = []
    got = 0.0
    for step in alone or steps:
        if kept and got >= wanted * (1 - 1e-9):
            break
        kept.append(step)
        got += step.prefix.requests_per_s
    return kept


def moves_it(source_waiting: int | None, busy: bool) -> bool:
    """A warm-up by transfer: whether the next prefix is moved (True) or computed by the
    warming replica (False). ``source_waiting``: the requests waiting on the least busy
    other replica holding it (None: none holds it); ``busy``: whether the warming replica
    runs or queues anything (another warm-up prefix, or requests it serves).

    A move is a one-token request on its source, which waits there for a free slot: on a
    saturated replica (requests waiting) that takes seconds (a slot frees as one of its
    running requests ends), while the warming replica, idle, computes the prefix in one
    step and no request waits behind it. So a prefix whose holders all have requests
    waiting is computed by the warming replica while it is idle, the others moved
    meanwhile; a prefix no other replica holds is computed in any case (one at a time:
    the caller queues it behind the one computing). Without it a scale-out of a
    saturated fleet had no prefix on its new replicas for its first 2.3 s (measured in
    ``docs/benchmarks.md``, "Fleet changes")."""
    return source_waiting is not None and (source_waiting <= 0 or busy)


class Pacer:
    """A token bucket: at most ``tokens_per_s`` a second, bursts up to one second's."""

    def __init__(self, tokens_per_s: float, now: float) -> None:
        self.rate = tokens_per_s
        self.capacity = tokens_per_s
        self.level = tokens_per_s
        self.at = now

    def wait_s(self, tokens: int, now: float) -> float:
        """Seconds until ``tokens`` may go (0: now); a send bigger than the bucket waits
        for a full bucket and then goes, leaving it in debt."""
        self._fill(now)
        need = min(tokens, self.capacity)
        wait = (need - self.level) / self.rate
        return wait if wait > 1e-6 else 0.0  # (not a float's rounding away from going now)

    def take(self, tokens: int, now: float) -> None:
        self._fill(now)
        self.level -= tokens

    def _fill(self, now: float) -> None:
        self.level = min(self.capacity, self.level + (now - self.at) * self.rate)
        self.at = now


@dataclass
class Warming:
    """One replica's warm-up (see the module docstring)."""

    replica_id: str
    workload: str
    started: float
    settings: WarmupSettings
    steps: list[Step] = field(default_factory=list)
    sent: int = 0  # prefixes sent
    cursor: int = 0  # steps sent or skipped (held already): the next to send is steps[cursor]
    sent_tokens: int = 0
    confirmed: int = 0  # prefixes the replica's KV events show it holds
    failed: int = 0
    pending: dict[int, Step] = field(default_factory=dict)  # key -> step, not confirmed yet
    ended: float | None = None
    outcome: str = ""  # done, budget, timeout, traffic, refused, failed, left, stepped_down

    @property
    def warming(self) -> bool:
        return self.ended is None

    def deadline(self) -> float:
        return self.started + self.settings.max_duration_s

    def end(self, outcome: str, now: float) -> None:
        if self.ended is None:
            self.ended, self.outcome = now, outcome

    def queue(self) -> list[int]:
        """The keys of the prefixes still to send, in order."""
        return [step.prefix.key for step in self.steps[self.cursor :]]

    def confirm(self, held: Callable[[int], bool]) -> int:
        """Drop pending prefixes whose last key ``held`` says the replica holds; how many."""
        done = [key for key in self.pending if held(key)]
        for key in done:
            del self.pending[key]
        self.confirmed += len(done)
        return len(done)

    def summary(self) -> dict[str, object]:
        return {
            "workload": self.workload,
            "warming": self.warming,
            "planned": len(self.steps),
            "sent": self.sent,
            "sent_tokens": self.sent_tokens,
            "confirmed": self.confirmed,
            "failed": self.failed,
            "outcome": self.outcome,
            "seconds": None if self.ended is None else round(self.ended - self.started, 3),
        }
