"""In-flight tickets: this proxy's requests from their sending to their end.

Every request sent gets an :class:`InflightTicket`: it is counted in the in-flight ledger
(the load its replica has not reported yet) and, while a ``kv_cost`` workload is
configured, booked in the prefill books (:mod:`dataplane.fleet.prefill_books`) for the
tokens it leaves its replica to prefill. Its first bytes and its end settle it, and each
of these marks the replica's state in the view cache (:mod:`dataplane.fleet.views`) for
a rebuild. A ticket names its replica by ledger key, so one that outlives a snapshot
renumbering the replicas still settles on the right one.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from mypy_extensions import mypyc_attr

from dataplane.fleet.prefill_books import PrefillBooks
from dataplane.fleet.replicas import ReplicaTable
from dataplane.fleet.views import ViewCache
from kvcore.pb import routing_pb2
from kvcore.policies import InflightLedger


@dataclass(slots=True)  # one per request; a frozen init costs 3x (read-only by convention)
class InflightTicket:
    """One request sent by this proxy, for :meth:`Inflight.on_done`."""

    ordinal: int
    ledger_key: int
    ticket: int
    prefill: int = 0  # the prefill books' ticket (0: not booked)
    # a batch's later prompts' ticket: a stream's first event is its first prompt's first
    # token, so only a whole answer or the request's end settles them
    prefill_later: int = 0

    def __init__(  # written out: one per request (see dataplane/native.py)
        self, ordinal: int, ledger_key: int, ticket: int, prefill: int = 0, prefill_later: int = 0
    ) -> None:
        self.ordinal = ordinal
        self.ledger_key = ledger_key
        self.ticket = ticket
        self.prefill = prefill
        self.prefill_later = prefill_later


@mypyc_attr(allow_interpreted_subclasses=True)  # tests build on it (compiled, see native.py)
class Inflight:
    """This proxy's requests in flight and its prefill books; see the module docstring."""

    def __init__(
        self, table: ReplicaTable, views: ViewCache, ledger: InflightLedger, books: PrefillBooks
    ) -> None:
        self._table = table
        self._views = views
        self._ledger = ledger
        self._books = books

    @property
    def keeps_books(self) -> bool:
        """Whether this proxy keeps prefill books (a ``kv_cost`` workload is configured)."""
        return self._books.on

    def on_sent(
        self, ordinal: int, now: float, uncached_tokens: int = 0, later_uncached: int = 0
    ) -> InflightTicket | None:
        """A request went to ``ordinal`` at ``now`` (wall clock, like LoadReport.ts) with
        ``uncached_tokens`` to prefill there (its prompt less the predicted cached tokens)
        and, for a batch, ``later_uncached`` for its other prompts."""
        record = self._table.records.get(ordinal)
        if record is None:
            return None
        key = record.ledger_key
        ticket = self._ledger.sent(key, now)
        self._views.refresh(ordinal)
        books = self._books
        first = books.sent(key, uncached_tokens)  # booked first: the engine starts on it
        later = books.sent(key, later_uncached) if later_uncached else 0
        return InflightTicket(ordinal, key, ticket, first, later)

    def on_first_byte(self, ticket: InflightTicket | None, status: int, streaming: bool) -> None:
        """The first bytes of the request's answer arrived (a stream's first event, or a
        whole body), with HTTP ``status``: its prefill is settled (a batch's later
        prompts' only by a whole answer or an error)."""
        if ticket is None or not ticket.prefill:
            return
        books, key = self._books, ticket.ledger_key
        books.answered(key, ticket.prefill, status, streaming)
        if ticket.prefill_later and (not streaming or status >= 400):
            books.answered(key, ticket.prefill_later, status, streaming)
        self._refresh(ticket)

    def on_done(self, ticket: InflightTicket | None, now: float | None = None) -> None:
        """The request of ``ticket`` ended, in any way (twice: ignored), at ``now`` (wall
        clock, like LoadReport.ts; default: now)."""
        if ticket is None:
            return
        self._ledger.done(ticket.ledger_key, ticket.ticket, time.time() if now is None else now)
        if ticket.prefill:
            self._books.ended(ticket.ledger_key, ticket.prefill)
        if ticket.prefill_later:
            self._books.ended(ticket.ledger_key, ticket.prefill_later)
        self._refresh(ticket, ended=True)

    def _refresh(self, ticket: InflightTicket, *, ended: bool = False) -> None:
        ordinal, record = ticket.ordinal, self._table.records.get(ticket.ordinal)
        if record is None or record.ledger_key != ticket.ledger_key:
            found = self._table.by_ledger_key(ticket.ledger_key)
            if found is None:  # renumbered by a snapshot since, or gone
                return
            ordinal, record = found
        if ended:
            self._views.settle(ordinal, record)
        else:
            self._views.refresh(ordinal)

    def warmed(self, key: int) -> None:
        """A replica's warm-up ended: forget the prefill rate learned while it warmed."""
        self._books.forget_rate(key)

    def forget(self, key: int) -> None:
        """A replica left: drop its counts."""
        self._ledger.forget(key)
        self._books.forget(key)

    def prefill_rates(self) -> dict[str, float]:
        """Replica id -> the prefill rate kv_cost ranks it at (empty without books)."""
        books = self._books
        if not books.on:
            return {}
        records = self._table.records.values()
        rates = {r.info.replica_id: books.rate(r.ledger_key) for r in records}
        return {replica: rate for replica, rate in rates.items() if rate is not None}

    def learned_rates(self) -> list[routing_pb2.LearnedRate]:
        """What this proxy has learned of each replica's prefill speed, for its reports
        to the control plane (``/v1/replicas``): replicas with nothing learned are left
        out."""
        rows = []
        for record in self._table.records.values():
            learned = self._books.learned(record.ledger_key)
            if learned is None:
                continue
            rate, line, slower, engine = learned
            row = routing_pb2.LearnedRate(
                replica_id=record.info.replica_id, prefill_tokens_per_s=rate
            )
            if engine is not None:
                row.engine_tokens_per_s = engine
            if line is not None:
                row.line_fixed_s, row.line_tokens_per_s = line
            if slower is not None:
                row.slowness = slower
            rows.append(row)
        return rows

    def total(self) -> int:
        """This proxy's requests in flight to any replica (what the HPA scales on)."""
        return self._ledger.total()
