"""Repositories: the only code that writes SQL; they add and query, never commit.

A service opens one session, calls repositories, and commits once, so a change and its
audit entry land together or not at all.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import delete, func, select, update
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.ext.asyncio import AsyncSession

from controlplane.records.db.models import (
    Alert,
    ApiToken,
    AuditEntry,
    ConfigRevision,
    ProxyReportRow,
    WorkloadStat,
)
from kvcore.pb import routing_pb2

# the proxies' UsageCounters, in proto order: the columns of proxy_reports and workload_stats
COUNTERS = tuple(field.name for field in routing_pb2.UsageCounters.DESCRIPTOR.fields)


def _insert(session: AsyncSession, table: Any) -> Any:
    dialect = session.get_bind().dialect.name
    return (postgresql.insert if dialect == "postgresql" else sqlite.insert)(table)


class AuditRepository:
    def __init__(self, session: AsyncSession) -> None:
        self.session = session

    def add(
        self,
        *,
        actor: str,
        action: str,
        target: str,
        result: str,
        before: str | None = None,
        after: str | None = None,
        detail: str = "",
    ) -> AuditEntry:
        entry = AuditEntry(
            at=time.time(),
            actor=actor,
            action=action,
            target=target,
            result=result,
            before=before,
            after=after,
            detail=detail,
        )
        self.session.add(entry)
        return entry

    async def page(self, *, limit: int, offset: int) -> tuple[Sequence[AuditEntry], int]:
        """Newest first, and the total count."""
        query = select(AuditEntry).order_by(AuditEntry.id.desc()).limit(limit).offset(offset)
        rows = (await self.session.scalars(query)).all()
        total = await self.session.scalar(select(func.count()).select_from(AuditEntry))
        return rows, int(total or 0)


class RevisionRepository:
    def __init__(self, session: AsyncSession) -> None:
        self.session = session

    def add(self, revision: ConfigRevision) -> None:
        self.session.add(revision)

    async def page(
        self, kind: str, name: str, *, limit: int, offset: int
    ) -> Sequence[ConfigRevision]:
        query = (
            select(ConfigRevision)
            .where(ConfigRevision.kind == kind, ConfigRevision.name == name)
            .order_by(ConfigRevision.id.desc())
            .limit(limit)
            .offset(offset)
        )
        return (await self.session.scalars(query)).all()

    async def get(self, kind: str, name: str, revision_id: int) -> ConfigRevision | None:
        row = await self.session.get(ConfigRevision, revision_id)
        if row is None or row.kind != kind or row.name != name:
            return None
        return row


class TokenRepository:
    def __init__(self, session: AsyncSession) -> None:
        self.session = session

    def add(self, token: ApiToken) -> None:
        self.session.add(token)

    async def by_hash(self, key_sha256: str) -> ApiToken | None:
        query = select(ApiToken).where(ApiToken.key_sha256 == key_sha256)
        return (await self.session.scalars(query)).first()

    async def get(self, token_id: str) -> ApiToken | None:
        return await self.session.get(ApiToken, token_id)

    async def all(self) -> Sequence[ApiToken]:
        return (await self.session.scalars(select(ApiToken).order_by(ApiToken.created_at))).all()

    async def delete(self, token: ApiToken) -> None:
        await self.session.delete(token)


@dataclass(frozen=True, slots=True)
class ReportRow:
    """One validated report row, ready to be stored."""

    proxy_id: str
    report_ts: float
    minute: int
    workload: str
    pool: str
    replica_id: str
    counters: tuple[int, ...]  # in COUNTERS order


@dataclass(frozen=True, slots=True)
class Totals:
    """Counters summed over some rows."""

    requests: int = 0
    prompt_tokens: int = 0
    predicted_cached_tokens: int = 0
    measured_cached_tokens: int = 0
    measured_requests: int = 0
    errors: int = 0

    @classmethod
    def of(cls, parts: Iterable[Totals]) -> Totals:
        """The sum of ``parts``."""
        sums = [0] * len(COUNTERS)
        for part in parts:
            for i, name in enumerate(COUNTERS):
                sums[i] += getattr(part, name)
        return cls(*sums)

    @property
    def measured_hit_rate(self) -> float | None:
        """Engine-measured cached tokens over the prompt tokens of the measured requests
        (estimated as the prompt tokens times the measured share of the answered
        requests: an error carries no prompt tokens, ``dataplane.exchange``)."""
        answered = self.requests - self.errors
        if not self.measured_requests or answered <= 0 or not self.prompt_tokens:
            return None
        measured_prompt = self.prompt_tokens * self.measured_requests / answered
        return min(1.0, self.measured_cached_tokens / measured_prompt)

    @property
    def predicted_hit_rate(self) -> float | None:
        if not self.prompt_tokens:
            return None
        return min(1.0, self.predicted_cached_tokens / self.prompt_tokens)


class StatsRepository:
    def __init__(self, session: AsyncSession) -> None:
        self.session = session

    async def add_reports(self, rows: Iterable[ReportRow]) -> None:
        """Store report rows; a row already stored (a resent report) is ignored."""
        values = [
            {
                "proxy_id": r.proxy_id,
                "report_ts": r.report_ts,
                "minute": r.minute,
                "workload": r.workload,
                "pool": r.pool,
                "replica_id": r.replica_id,
                "rolled_up": False,
                **dict(zip(COUNTERS, r.counters, strict=True)),
            }
            for r in rows
        ]
        if not values:
            return
        keys = ["proxy_id", "report_ts", "workload", "pool", "replica_id"]
        statement = _insert(self.session, ProxyReportRow).on_conflict_do_nothing(
            index_elements=keys
        )
        await self.session.execute(statement, values)

    async def claim_pending(self, limit: int) -> Sequence[Any]:
        """Mark up to ``limit`` unrolled report rows rolled up and return them.

        A row claimed by a concurrent transaction is skipped (the ``rolled_up`` test is
        re-checked after its lock), so each row is rolled up exactly once.
        """
        pending = (
            select(ProxyReportRow.id)
            .where(ProxyReportRow.rolled_up.is_(False))
            .order_by(ProxyReportRow.id)
            .limit(limit)
        )
        claim = (
            update(ProxyReportRow)
            .where(ProxyReportRow.id.in_(pending.scalar_subquery()))
            .where(ProxyReportRow.rolled_up.is_(False))
            .values(rolled_up=True)
            .returning(
                ProxyReportRow.minute,
                ProxyReportRow.workload,
                ProxyReportRow.pool,
                ProxyReportRow.replica_id,
                *(getattr(ProxyReportRow, c) for c in COUNTERS),
            )
        )
        return (await self.session.execute(claim)).all()

    async def add_to_minutes(self, sums: dict[tuple[int, str, str, str], list[int]]) -> None:
        """Add counters to their (minute, workload, pool, replica) rows."""
        if not sums:
            return
        values = [
            {
                "minute": minute,
                "workload": workload,
                "pool": pool,
                "replica_id": replica,
                **dict(zip(COUNTERS, counters, strict=True)),
            }
            for (minute, workload, pool, replica), counters in sorted(sums.items())
        ]
        statement = _insert(self.session, WorkloadStat)
        statement = statement.on_conflict_do_update(
            index_elements=["minute", "workload", "pool", "replica_id"],
            set_={c: getattr(WorkloadStat, c) + getattr(statement.excluded, c) for c in COUNTERS},
        )
        await self.session.execute(statement, values)

    async def per_minute(self, workload: str, since: int) -> list[tuple[int, Totals]]:
        """The workload's counters per minute from ``since``, summed over replicas."""
        query = (
            select(WorkloadStat.minute, *(func.sum(getattr(WorkloadStat, c)) for c in COUNTERS))
            .where(WorkloadStat.workload == workload, WorkloadStat.minute >= since)
            .group_by(WorkloadStat.minute)
            .order_by(WorkloadStat.minute)
        )
        rows = (await self.session.execute(query)).all()
        return [(int(row[0]), Totals(*(int(v or 0) for v in row[1:]))) for row in rows]

    async def totals_by_workload(self, since: int, until: int) -> dict[str, Totals]:
        """Each workload's counters over minutes in ``[since, until)``."""
        query = (
            select(WorkloadStat.workload, *(func.sum(getattr(WorkloadStat, c)) for c in COUNTERS))
            .where(WorkloadStat.minute >= since, WorkloadStat.minute < until)
            .group_by(WorkloadStat.workload)
        )
        rows = (await self.session.execute(query)).all()
        return {row[0]: Totals(*(int(v or 0) for v in row[1:])) for row in rows}

    async def prune(self, before_minute: int) -> None:
        await self.session.execute(delete(WorkloadStat).where(WorkloadStat.minute < before_minute))
        await self.session.execute(
            delete(ProxyReportRow).where(
                ProxyReportRow.rolled_up.is_(True), ProxyReportRow.minute < before_minute
            )
        )


class AlertRepository:
    def __init__(self, session: AsyncSession) -> None:
        self.session = session

    async def open_by_workload(self, kind: str) -> dict[str, Alert]:
        query = select(Alert).where(Alert.kind == kind, Alert.state == "open")
        return {alert.workload: alert for alert in (await self.session.scalars(query)).all()}

    def add(self, alert: Alert) -> None:
        self.session.add(alert)

    async def recent(self, *, state: str | None, limit: int) -> Sequence[Alert]:
        query = select(Alert).order_by(Alert.id.desc()).limit(limit)
        if state is not None:
            query = query.where(Alert.state == state)
        return (await self.session.scalars(query)).all()
