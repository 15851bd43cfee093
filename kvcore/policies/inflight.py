"""This proxy's in-flight requests per replica, and how many the engine has not yet counted.

A replica's load is what its engine last reported (running + waiting, taken at the
report's ``ts``) plus the requests this proxy sent it *after* that report: the earlier
ones are already in the engine's figures, so adding every in-flight request again would
count them twice (128 requests from one proxy on a 256-slot replica would read as full).
:class:`InflightLedger` answers "how many of my requests to replica r, still in flight,
were sent after time T" for every replica on every routing decision, so the answer must
cost O(1):

- ``ticket = ledger.sent(r, at)`` when a request goes upstream, ``ledger.done(r, ticket)``
  when it ends (answered, failed, cancelled; a second ``done`` is ignored);
- ``ledger.unreported(r, report_ts)`` with the ``ts`` of the replica's latest
  ``LoadReport`` (``-inf`` with none: nothing is reported, so every in-flight request
  counts) goes into ``ReplicaState.unreported``.

Send times and report times must come from one clock: the sidecar stamps ``LoadReport.ts``
with wall-clock ``time.time()``, so the proxy passes ``time.time()`` to :meth:`sent`. Clock
skew between hosts only shifts which requests count as reported (a proxy clock behind the
sidecar's by ``d`` drops the requests of the last ``d`` seconds from the count; ahead, it
counts them twice); keep hosts NTP-synchronised.

Per replica, sends are kept in send order in a queue that a report only walks forward
(each send is popped once), and requests that end are dropped from the queue's front as
they reach it; a queue left mostly finished behind a long request is compacted when it
holds more than twice its live entries, so memory stays proportional to the requests in
flight and every call is amortised O(1). A report time that moves backwards (a restarted
sidecar) recounts that replica once.

The other way round, the report still counts this proxy's requests that have ended
since it was taken: ``ledger.done(r, ticket, at)`` with the end time, and
``ledger.ended(r, report_ts)`` says how many of the requests the report counted (sent at
or before ``report_ts``) ended after it; :func:`discount_ended` takes them out of the
report's figures. Without it a proxy sees the replica its last requests left as busy as
the report says until the next one, up to a report period later: behind several proxies
each one then sends its next new prompt to the replica every proxy reads as least busy
from the same report, and they pile up there (issue #39: four replicas serving 40/60/
55/85 requests of a chat app behind eight proxies). Ends are kept, in end order, only
until a report newer than them arrives (at most ``_ENDED_KEPT`` a replica).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from itertools import count

_SLACK = 32  # finished entries a queue may keep before compaction is considered
_ENDED_KEPT = 4096  # ends a replica keeps while no newer report arrives (oldest dropped)


@dataclass(slots=True)
class _ReplicaLedger:
    """One replica's in-flight requests (``sent_at``: ticket -> send time, in send
    order) and the ones sent after ``watermark`` (the latest report time seen)."""

    sent_at: dict[int, float] = field(default_factory=dict)
    after: deque[tuple[int, float]] = field(default_factory=deque)  # may hold finished
    watermark: float = -math.inf
    unreported: int = 0  # in-flight requests sent after ``watermark``
    latest: float = -math.inf  # send times are kept non-decreasing
    # (sent, ended) of the requests that ended after ``watermark``, in end order
    ends: deque[tuple[float, float]] = field(default_factory=deque)
    gone: int = 0  # of ``ends``, those sent at or before ``watermark``: reported, ended
    last_end: float = -math.inf  # end times are kept non-decreasing

    def sent(self, ticket: int, at: float) -> None:
        at = self.latest = max(at, self.latest)
        self.sent_at[ticket] = at
        if at > self.watermark:
            self.after.append((ticket, at))
            self.unreported += 1

    def done(self, ticket: int, at: float | None) -> None:
        sent = self.sent_at.pop(ticket, None)
        if sent is None:
            return
        if sent > self.watermark:
            self.unreported -= 1
        if at is not None:
            self._ended(sent, at)
        self._trim()

    def _ended(self, sent: float, at: float) -> None:
        at = self.last_end = max(max(at, self.last_end), sent)  # two-argument max: compiled inline
        if at <= self.watermark:
            return  # ended before the report was taken: the report left it out
        ends = self.ends
        ends.append((sent, at))
        if sent <= self.watermark:
            self.gone += 1
        if len(ends) > _ENDED_KEPT:
            first_sent, _ = ends.popleft()
            if first_sent <= self.watermark:
                self.gone -= 1

    def count_after(self, ts: float) -> int:
        if ts > self.watermark:
            self._advance(ts)
        elif ts < self.watermark:
            self._recount(ts)
        return self.unreported

    def ended_after(self, ts: float) -> int:
        if ts != self.watermark:
            self.count_after(ts)
        return self.gone

    def _advance(self, ts: float) -> None:
        after, sent_at = self.after, self.sent_at
        while after and after[0][1] <= ts:
            ticket, _ = after.popleft()
            if ticket in sent_at:
                self.unreported -= 1
        self.watermark = ts
        self._recount_ends(ts)

    def _recount(self, ts: float) -> None:
        self.after = deque((t, at) for t, at in self.sent_at.items() if at > ts)
        self.unreported = len(self.after)
        self.watermark = ts
        self._recount_ends(ts)

    def _recount_ends(self, ts: float) -> None:
        """``gone`` for a report taken at ``ts``: the ends kept after it of requests
        sent at or before it (a report walks forward: each end is dropped once)."""
        ends = self.ends
        while ends and ends[0][1] <= ts:
            ends.popleft()
        self.gone = sum(1 for sent, _ in ends if sent <= ts) if ends else 0

    def _trim(self) -> None:
        after, sent_at = self.after, self.sent_at
        while after and after[0][0] not in sent_at:
            after.popleft()
        if len(after) > 2 * self.unreported + _SLACK:
            self.after = deque(entry for entry in after if entry[0] in sent_at)


class InflightLedger:
    """Per replica ordinal: this proxy's requests in flight, with their send times."""

    __slots__ = ("_replicas", "_tickets")

    def __init__(self) -> None:
        self._replicas: dict[int, _ReplicaLedger] = {}
        self._tickets = count(1)

    def sent(self, replica: int, at: float) -> int:
        """Record a request sent to ``replica`` at ``at`` (wall-clock seconds, the clock
        of ``LoadReport.ts``); returns the ticket to pass to :meth:`done`."""
        ticket = next(self._tickets)
        ledger = self._replicas.get(replica)
        if ledger is None:
            ledger = self._replicas[replica] = _ReplicaLedger()
        ledger.sent(ticket, at)
        return ticket

    def done(self, replica: int, ticket: int, at: float | None = None) -> None:
        """The request of ``ticket`` ended (in any way) at ``at`` (the clock of
        :meth:`sent`; ``None``: not known, then :meth:`ended` leaves it out); unknown
        tickets are ignored."""
        ledger = self._replicas.get(replica)
        if ledger is not None:
            ledger.done(ticket, at)

    def unreported(self, replica: int, report_ts: float = -math.inf) -> int:
        """Requests to ``replica`` still in flight that were sent after ``report_ts``,
        the time of the engine's latest load report (``-inf``: none yet)."""
        ledger = self._replicas.get(replica)
        return 0 if ledger is None else ledger.count_after(report_ts)

    def ended(self, replica: int, report_ts: float = -math.inf) -> int:
        """Requests to ``replica`` the report taken at ``report_ts`` counts (sent at or
        before it) that have ended since; 0 without a report."""
        ledger = self._replicas.get(replica)
        return 0 if ledger is None else ledger.ended_after(report_ts)

    def inflight(self, replica: int) -> int:
        """Every request to ``replica`` still in flight, reported or not."""
        ledger = self._replicas.get(replica)
        return 0 if ledger is None else len(ledger.sent_at)

    def total(self) -> int:
        """Every request still in flight, to any replica."""
        return sum(len(ledger.sent_at) for ledger in self._replicas.values())

    def forget(self, replica: int) -> None:
        """Drop ``replica``'s requests (it left the fleet; its ordinal may be reused)."""
        self._replicas.pop(replica, None)


def discount_ended(
    running: int, waiting: int, kv_usage: float, ended: int
) -> tuple[int, int, float]:
    """An engine's reported ``running``, ``waiting`` and ``kv_usage`` less ``ended`` of
    the requests they count (:meth:`InflightLedger.ended`). The engine admits a waiting
    request into the room one that ends leaves, so the ended ones come out of the
    waiting figure first (the running ones and their KV stay as they were), and only
    beyond it out of the running ones and the KV usage, each by its running request's
    share of it (a request's blocks are not known, the replica's mean is)."""
    if ended <= 0:
        return running, waiting, kv_usage
    from_waiting = min(ended, waiting)
    from_running = min(ended - from_waiting, running)
    if from_running:
        kv_usage *= (running - from_running) / running
    return running - from_running, waiting - from_waiting, kv_usage
