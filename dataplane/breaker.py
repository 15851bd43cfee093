"""Keeping failing replicas out for a while, and retries from multiplying an outage.

:class:`CircuitBreakers`: a replica that fails ``failures`` times in a row (a connect
failure, a 502/503 before the first byte) is *open*: excluded from routing for
``open_s`` seconds. Then it is *half-open*: routable again, and the first request sent
to it is its probe (other requests leave it out until the probe ends); a probe that
succeeds closes the breaker, one that fails opens it for another ``open_s``. A replica
that missed a first-byte deadline is *suspect* (``dataplane.first_byte``): excluded with
no end in time, until a probe of its health answers or a request it still had does.
Replicas are tracked by id, so a snapshot that renumbers ordinals keeps their history.

:class:`RetryBudget`: a token bucket that every request tops up by ``ratio`` and time
tops up by ``min_per_s``; a retry spends one token. When a whole fleet fails, retries
stay a bounded share of the load instead of multiplying it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from mypy_extensions import mypyc_attr


@dataclass(slots=True)
class _Breaker:
    ordinal: int
    failures: int = 0
    open_until: float = -math.inf  # routable again (half-open) from this time
    probing: bool = False
    suspect_url: str = ""  # suspect: the base URL its probes go to ("" when not)


@mypyc_attr(allow_interpreted_subclasses=True)  # the tests log its calls through one
class CircuitBreakers:
    """Per-replica circuit breakers; time is passed in (monotonic seconds)."""

    def __init__(self, failures: int, open_s: float) -> None:
        self.failures = failures
        self.open_s = open_s
        self._breakers: dict[str, _Breaker] = {}
        self._excluded: frozenset[int] = frozenset()
        self._recompute_at = math.inf

    def excluded(self, now: float) -> frozenset[int]:
        """Ordinals routing must leave out now (open, or half-open with a probe out)."""
        if now >= self._recompute_at:
            self._recompute(now)
        return self._excluded

    def open_ids(self, now: float) -> list[str]:
        """Replica ids whose breaker is open or probing (metrics, /readyz)."""
        return sorted(r for r, b in self._breakers.items() if b.probing or now < b.open_until)

    def suspect(self, replica_id: str, ordinal: int, base_url: str, now: float) -> None:
        """The replica missed a first-byte deadline: out until :meth:`on_probe_answered`
        (or :meth:`on_success`)."""
        breaker = self._breakers.get(replica_id)
        if breaker is None:
            breaker = self._breakers[replica_id] = _Breaker(ordinal)
        breaker.ordinal, breaker.suspect_url = ordinal, base_url
        breaker.open_until, breaker.probing = math.inf, False
        self._recompute(now)

    def suspects(self) -> dict[str, tuple[int, str]]:
        """Suspect replica ids, each with the ordinal it is excluded by and the base URL
        its probes go to."""
        return {r: (b.ordinal, b.suspect_url) for r, b in self._breakers.items() if b.suspect_url}

    def on_probe_answered(self, replica_id: str, now: float) -> None:
        """A suspect replica's probe answered, or it left the fleet (or its ordinal went
        to another replica): routable again, its failures forgotten."""
        if self._breakers.pop(replica_id, None) is not None:
            self._recompute(now)

    def on_sent(self, replica_id: str, ordinal: int, now: float) -> None:
        """A request goes to the replica: it is the probe if the breaker is half-open."""
        breaker = self._breakers.get(replica_id)
        if breaker is not None and breaker.failures >= self.failures and not breaker.probing:
            breaker.probing = True
            breaker.ordinal = ordinal
            self._recompute(now)

    def on_success(self, replica_id: str, now: float) -> None:
        breaker = self._breakers.pop(replica_id, None)
        if breaker is not None and (breaker.failures >= self.failures or breaker.suspect_url):
            self._recompute(now)

    def on_failure(self, replica_id: str, ordinal: int, now: float) -> None:
        breaker = self._breakers.get(replica_id)
        if breaker is None:
            breaker = self._breakers[replica_id] = _Breaker(ordinal)
        breaker.ordinal = ordinal
        breaker.failures += 1
        breaker.probing = False
        if breaker.failures >= self.failures and not breaker.suspect_url:
            breaker.open_until = now + self.open_s
            self._recompute(now)

    def on_abandoned(self, replica_id: str, now: float) -> None:
        """The request ended without telling (cancelled): a probe may be sent again."""
        breaker = self._breakers.get(replica_id)
        if breaker is not None and breaker.probing:
            breaker.probing = False
            self._recompute(now)

    def _recompute(self, now: float) -> None:
        excluded, next_change = set(), math.inf
        for breaker in self._breakers.values():
            if breaker.probing:
                excluded.add(breaker.ordinal)
            elif now < breaker.open_until:
                excluded.add(breaker.ordinal)
                next_change = min(next_change, breaker.open_until)
        self._excluded = frozenset(excluded)
        self._recompute_at = next_change


class RetryBudget:
    """Retries allowed: ``ratio`` per request plus ``min_per_s``, banked up to a cap."""

    def __init__(self, ratio: float, min_per_s: float, now: float) -> None:
        self.ratio = ratio
        self.min_per_s = min_per_s
        self.cap = max(1.0, min_per_s) + 100 * ratio
        self._tokens = self.cap
        self._at = now

    def on_request(self) -> None:
        self._tokens = min(self.cap, self._tokens + self.ratio)

    def try_spend(self, now: float) -> bool:
        """Take one retry from the budget; False when it is spent."""
        self._tokens = min(self.cap, self._tokens + (now - self._at) * self.min_per_s)
        self._at = now
        if self._tokens < 1:
            return False
        self._tokens -= 1
        return True
