"""What to warm a replica with, in which order, and how fast: pure planning and pacing.

A replica that joins empty is sent each hot prefix once, as a one-token completion.
:func:`plan` orders the prefixes by value, requests per second times the tokens the
replica does not hold yet (a prefix it holds whole is skipped), and keeps to the total
budget; :func:`stagger` reorders it for a replica joining while others warm, so that
each starts with the prefixes the others will send last. :class:`Pacer` spaces the
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


@dataclass(frozen=True, slots=True)
class Step:
    """One prefix to send: ``uncached`` of its tokens are new to the replica."""

    prefix: HotPrefix
    uncached: int

    @property
    def value(self) -> float:
        return self.prefix.requests_per_s * self.uncached


def plan(prefixes: Sequence[HotPrefix], held: HeldBlocks, max_tokens: int) -> list[Step]:
    """The prefixes worth sending, most valuable first, within ``max_tokens`` in all."""
    steps = []
    for prefix in prefixes:
        uncached = (prefix.blocks - held(prefix)) * prefix.block_size
        if uncached > 0:
            steps.append(Step(prefix, uncached))
    steps.sort(key=lambda s: (s.value, s.uncached), reverse=True)
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
