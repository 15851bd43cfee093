"""Proxies' counters: stored as they arrive, rolled up per minute by the leader.

Each proxy streams a :class:`~kvroute.v1.ProxyReport` every 10 s to whichever control
plane instance it is connected to, so reports reach both. Either instance stores each
report's rows at once in ``proxy_reports`` (the report is safe once ``record`` returns);
a row's ``(proxy, ts, workload, pool, replica)`` is unique, so a resent report counts
once. Only the leader rolls stored rows into ``workload_stats``: it claims rows and adds
them to their minutes in one transaction, and a row claimed once is never claimed
again, even if two instances both believe they lead for a moment. No report is lost (it
is durable before the proxy's next one) and none is counted twice.

A row's minute is the minute holding the middle of its report interval. Rows that make
no sense (a name that is not an id, a time far from now, more measured than sent
requests) are counted by reason and skipped; the rest of the report is kept.
"""

from __future__ import annotations

import math
import re
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from typing import Any

from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from controlplane.records.db.repositories import COUNTERS, ReportRow, StatsRepository
from controlplane.records.metrics import RecordsMetrics
from kvcore.pb import routing_pb2

MAX_PAST_S = 25 * 3600  # a report older than this is refused (stats cover 24 h back)
MAX_FUTURE_S = 300  # clock skew tolerated
MAX_INTERVAL_S = 3600
MAX_COUNTER = 2**62
ROLLUP_BATCH = 5000
_ID = re.compile(r"[A-Za-z0-9_-]{1,64}\Z")
_REPLICA = re.compile(r"[A-Za-z0-9_-]{1,128}\Z")
_PROXY = re.compile(r"[\x21-\x7e]{1,128}\Z")


class ReportInbox:
    """The :class:`~controlplane.contracts.ReportSink` of the records half."""

    def __init__(
        self,
        sessions: async_sessionmaker[AsyncSession],
        metrics: RecordsMetrics,
        *,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._sessions = sessions
        self._metrics = metrics
        self._clock = clock

    async def record(self, report: routing_pb2.ProxyReport) -> None:
        rows = self._rows(report)
        if not rows:
            return
        async with self._sessions() as session:
            await StatsRepository(session).add_reports(rows)
            await session.commit()
        self._metrics.report_rows.inc(len(rows))

    def _rows(self, report: routing_pb2.ProxyReport) -> list[ReportRow]:
        problem = self._report_problem(report)
        if problem is not None:
            self._metrics.report_rows_rejected.labels(problem).inc(max(1, len(report.rows)))
            return []
        minute = int((report.ts - report.interval_s / 2) // 60 * 60)
        rows = []
        for row in report.rows:
            problem = _row_problem(row)
            if problem is not None:
                self._metrics.report_rows_rejected.labels(problem).inc()
                continue
            counters = counter_values(row.counters)
            if any(counters):
                rows.append(
                    ReportRow(
                        report.proxy_id,
                        report.ts,
                        minute,
                        row.workload,
                        row.pool,
                        row.replica_id,
                        counters,
                    )
                )
        return rows

    def _report_problem(self, report: routing_pb2.ProxyReport) -> str | None:
        if not _PROXY.match(report.proxy_id):
            return "proxy_id"
        if not math.isfinite(report.ts) or not math.isfinite(report.interval_s):
            return "time"
        now = self._clock()
        if not now - MAX_PAST_S <= report.ts <= now + MAX_FUTURE_S:
            return "time"
        if not 0 <= report.interval_s <= MAX_INTERVAL_S:
            return "interval"
        return None

    async def rollup(self) -> int:
        """Add every stored, not yet rolled-up row to its minute; rows rolled up."""
        total = 0
        while True:
            async with self._sessions() as session:
                stats = StatsRepository(session)
                claimed = await stats.claim_pending(ROLLUP_BATCH)
                await stats.add_to_minutes(_sum_by_minute(claimed))
                await session.commit()
            total += len(claimed)
            if len(claimed) < ROLLUP_BATCH:
                break
        self._metrics.rolled_up_rows.inc(total)
        return total


def _row_problem(row: routing_pb2.ReportRow) -> str | None:
    if not _ID.match(row.workload) or not _ID.match(row.pool):
        return "name"
    if not _REPLICA.match(row.replica_id):
        return "name"
    c = row.counters
    if any(v > MAX_COUNTER for v in counter_values(c)):
        return "counter"
    if c.measured_requests > c.requests or c.errors > c.requests:
        return "counter"
    return None


def counter_values(counters: routing_pb2.UsageCounters) -> tuple[int, ...]:
    return tuple(getattr(counters, name) for name in COUNTERS)


def _sum_by_minute(rows: Sequence[Any]) -> dict[tuple[int, str, str, str], list[int]]:
    sums: dict[tuple[int, str, str, str], list[int]] = defaultdict(lambda: [0] * len(COUNTERS))
    for minute, workload, pool, replica, *counters in rows:
        totals = sums[(minute, workload, pool, replica)]
        for i, value in enumerate(counters):
            totals[i] += value
    return dict(sums)
