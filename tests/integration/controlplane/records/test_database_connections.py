"""Issue 42: the control plane's open files must not grow. Every burst of concurrent
sessions (readiness probes, admin requests, reports arriving together) used to leave the
records' SQLite pool with more connections, each holding the database file and its WAL
open for good (28 -> 30 fds over the 20-minute chaos soak; 3 -> 14 files here), and
SQLite kept the files of the connections the pool closed."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import aetcd
import pytest
from prometheus_client import CollectorRegistry
from sqlalchemy import text

from controlplane.records import Records
from controlplane.records.db.database import SQLITE_CONNECTIONS, Database
from tests.integration.controlplane.records.conftest import InTestFleet, make_settings

pytestmark = pytest.mark.integration
BURSTS = 5


def open_files_under(folder: Path) -> int:
    """This process's file descriptors on files in ``folder``."""
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue  # closed meanwhile (the listing's own)
        if target.startswith(str(folder)):
            count += 1
    return count


async def burst(records: Records, at_once: int) -> None:
    """``at_once`` sessions, each holding its connection until all of them have one."""
    together = asyncio.Barrier(at_once)

    async def one_session() -> None:
        async with records.database.sessions() as session:
            await session.execute(text("SELECT 1"))
            await together.wait()

    await asyncio.gather(*(one_session() for _ in range(at_once)))


async def test_bursts_of_concurrent_sessions_leave_the_sqlite_files_open_no_more(
    etcd: aetcd.Client, etcd_prefix: str, tmp_path: Path
) -> None:
    settings = make_settings(f"sqlite+aiosqlite:///{tmp_path}/records.db", etcd_prefix)
    records = Records(settings, etcd, InTestFleet(), CollectorRegistry())
    await records.start()
    try:
        assert await records.ready()
        serving = open_files_under(tmp_path)
        for _ in range(BURSTS):
            await burst(records, SQLITE_CONNECTIONS)  # more would wait for a connection
            assert await records.ready()
            assert open_files_under(tmp_path) == serving
    finally:
        await records.aclose()


async def test_an_in_memory_sqlite_database_starts_and_keeps_its_tables() -> None:
    """``--database-url sqlite+aiosqlite:///:memory:`` (a trial run): one shared
    connection, which a fixed pool's size would refuse at start."""
    database = Database("sqlite+aiosqlite:///:memory:")
    try:
        await database.migrate()
        await database.open_connections()
        async with database.sessions() as session:
            rows = await session.execute(text("SELECT count(*) FROM config_revisions"))
            assert rows.scalar_one() == 0
    finally:
        await database.aclose()
