"""The SQL engine: one per control plane, migrated to head at start-up.

SQLite (a file, no server: the default) and PostgreSQL are both supported through
SQLAlchemy's async drivers (``sqlite+aiosqlite://``, ``postgresql+asyncpg://``). A
session is opened per admin request or per background step; repositories never commit,
services do.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

from alembic import command
from alembic.config import Config
from sqlalchemy import event, text
from sqlalchemy.engine import Connection, make_url
from sqlalchemy.exc import IntegrityError, OperationalError
from sqlalchemy.ext.asyncio import AsyncEngine, async_sessionmaker, create_async_engine

MIGRATIONS_DIR = Path(__file__).resolve().parents[3] / "migrations"
SQLITE_BUSY_TIMEOUT_S = 30
SQLITE_MIGRATE_ATTEMPTS = 5
SQLITE_CONNECTIONS = 5  # all opened at start and kept (see _engine_options)
MIGRATION_LOCK_KEY = 0x6B76726F757465  # "kvroute": the advisory lock migrations hold


class Database:
    """An async engine, its session factory and the migrations."""

    def __init__(self, url: str, *, migrations_dir: Path = MIGRATIONS_DIR) -> None:
        options = _engine_options(url)
        self.engine: AsyncEngine = create_async_engine(url, **options)
        self._fixed_pool = "pool_size" in options  # a SQLite file: opened whole at start
        self.sessions = async_sessionmaker(self.engine, expire_on_commit=False)
        self.dialect = self.engine.dialect.name
        self._migrations_dir = migrations_dir
        if self.dialect == "sqlite":
            event.listen(self.engine.sync_engine, "connect", _sqlite_pragmas)

    async def migrate(self) -> None:
        """Bring the schema to the newest migration (the only way tables are made).

        Both control-plane instances may start at once against an empty database: on
        PostgreSQL a transaction-scoped advisory lock lets one migrate while the other
        waits and then finds the schema at head; SQLite serializes writers, and the one
        that planned against the old schema retries.
        """
        for attempt in range(1, SQLITE_MIGRATE_ATTEMPTS + 1):
            try:
                await self._migrate_once()
                return
            except (OperationalError, IntegrityError):
                if self.dialect != "sqlite" or attempt == SQLITE_MIGRATE_ATTEMPTS:
                    raise

    async def open_connections(self) -> None:
        """Open the SQLite pool's every connection now, so that its open files are what
        they will be (``_engine_options``); nothing for a server or in-memory database."""
        if not self._fixed_pool:
            return
        async with contextlib.AsyncExitStack() as held:
            for _ in range(SQLITE_CONNECTIONS):
                await held.enter_async_context(self.engine.connect())

    async def _migrate_once(self) -> None:
        async with self.engine.connect() as connection:
            if self.dialect == "postgresql":
                await connection.execute(
                    text("SELECT pg_advisory_xact_lock(:key)"), {"key": MIGRATION_LOCK_KEY}
                )
            await connection.run_sync(self._upgrade)
            await connection.commit()

    def _upgrade(self, connection: Connection) -> None:
        config = Config()
        config.set_main_option("script_location", str(self._migrations_dir))
        config.attributes["connection"] = connection
        command.upgrade(config, "head")

    async def ping(self) -> bool:
        """Whether the database answers."""
        try:
            async with self.engine.connect() as connection:
                await connection.execute(text("SELECT 1"))
        except Exception:  # any driver or network failure means "not ready"
            return False
        return True

    async def aclose(self) -> None:
        await self.engine.dispose()


def _engine_options(url: str) -> dict[str, Any]:
    """SQLite: a fixed pool of ``SQLITE_CONNECTIONS``, every one opened at start
    (:meth:`Database.open_connections`) and none ever closed before the end. A pool that
    grows and shrinks leaves files open for good: each connection holds the database file
    and its WAL, SQLAlchemy's default pool keeps up to 5 opened by any burst of concurrent
    sessions, and SQLite keeps the file of a connection closed while another one holds
    its shared lock, which in WAL mode an open connection always does (issue 42: the
    control plane's open files grew with each burst). SQLite runs one writer at a time,
    so more connections buy nothing; a session beyond them waits for one. An in-memory
    database keeps SQLAlchemy's one shared connection (its ``StaticPool`` takes no size)."""
    if not url.startswith("sqlite"):
        return {"pool_pre_ping": True}
    options: dict[str, Any] = {"connect_args": {"timeout": SQLITE_BUSY_TIMEOUT_S}}
    if not _in_memory(url):
        options |= {"pool_size": SQLITE_CONNECTIONS, "max_overflow": 0}
    return options


def _in_memory(url: str) -> bool:
    database = make_url(url).database
    return not database or ":memory:" in database or "mode=memory" in url


def _sqlite_pragmas(dbapi_connection: Any, _record: Any) -> None:
    cursor = dbapi_connection.cursor()
    cursor.execute("PRAGMA journal_mode=WAL")
    cursor.execute("PRAGMA synchronous=NORMAL")  # WAL stays consistent; fsync per checkpoint
    cursor.close()
