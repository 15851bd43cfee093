"""SQL records on SQLite and PostgreSQL: the schema comes from the migrations, and
proxies' reports reaching either instance are rolled up once each."""

from __future__ import annotations

import asyncio
import time

import pytest
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import select

from controlplane.records.db.models import Base, WorkloadStat
from kvcore.pb import routing_pb2
from tests.integration.controlplane.records.conftest import RecordsFactory

pytestmark = pytest.mark.integration


def report(proxy: str, ts: float, *rows: tuple[str, str, int, int, int]) -> routing_pb2.ProxyReport:
    """Rows: (workload, replica, requests, prompt tokens, measured cached tokens)."""
    message = routing_pb2.ProxyReport(proxy_id=proxy, ts=ts, interval_s=10)
    for workload, replica, requests, prompt, cached in rows:
        message.rows.add(
            workload=workload,
            pool="default",
            replica_id=replica,
            counters=routing_pb2.UsageCounters(
                requests=requests,
                prompt_tokens=prompt,
                predicted_cached_tokens=cached,
                measured_cached_tokens=cached,
                measured_requests=requests,
            ),
        )
    return message


async def test_the_schema_is_exactly_what_the_migrations_make(
    make_records: RecordsFactory, database_url: str
) -> None:
    if database_url.startswith("postgresql"):
        # both instances starting at once on an empty database: one migrates, the other
        # waits for its lock (alembic's context is per process, so on SQLite, where the
        # retry covers two processes, two instances in one test process start in turn)
        records, _ = await asyncio.gather(make_records(), make_records())
    else:
        records = await make_records()
    await records.database.migrate()  # a second start finds it at head and changes nothing
    async with records.database.engine.connect() as connection:
        diff = await connection.run_sync(
            lambda sync: compare_metadata(MigrationContext.configure(sync), Base.metadata)
        )
    assert diff == []


async def test_reports_reaching_either_instance_are_counted_once(
    make_records: RecordsFactory,
) -> None:
    first, second = await make_records(), await make_records()
    now = time.time()
    minute = int((now - 5) // 60 * 60)
    sent = report("proxy-a", now, ("chat", "r0", 10, 1000, 600), ("chat", "r1", 5, 500, 100))
    await first.reports.record(sent)
    await second.reports.record(sent)  # resent after a reconnect, to the other instance
    await second.reports.record(report("proxy-b", now, ("chat", "r0", 2, 200, 200)))
    bad = report("proxy-b", now + 1, ("chat", "r0", 1, 10, 0), ("bad.name", "r0", 1, 10, 0))
    bad.rows[0].counters.measured_requests = 5  # more measured than sent: refused
    await first.reports.record(bad)
    await first.reports.record(report("proxy-c", now - 30 * 3600, ("chat", "r0", 9, 9, 9)))

    # both instances believe they lead for a moment: each row is still rolled up once
    rolled = await asyncio.gather(first.reports.rollup(), second.reports.rollup())
    assert sum(rolled) == 3
    assert await first.reports.rollup() == 0

    async with first.database.sessions() as session:
        rows = (await session.scalars(select(WorkloadStat).order_by(WorkloadStat.replica_id))).all()
    got = [
        (r.minute, r.replica_id, r.requests, r.prompt_tokens, r.measured_cached_tokens)
        for r in rows
    ]
    assert got == [(minute, "r0", 12, 1200, 800), (minute, "r1", 5, 500, 100)]
    rejected = first.metrics.report_rows_rejected
    assert rejected.labels("counter")._value.get() == 1
    assert rejected.labels("name")._value.get() == 1
    assert rejected.labels("time")._value.get() == 1
