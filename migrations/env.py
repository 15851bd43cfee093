"""Alembic environment: migrations run on a connection the control plane hands over
(``config.attributes["connection"]``), or, by hand, on ``KVROUTE_DATABASE_URL``."""

from __future__ import annotations

import asyncio
import os

from alembic import context
from sqlalchemy.engine import Connection
from sqlalchemy.ext.asyncio import create_async_engine

from controlplane.records.db.models import Base

target_metadata = Base.metadata


def _run(connection: Connection) -> None:
    context.configure(
        connection=connection,
        target_metadata=target_metadata,
        render_as_batch=connection.dialect.name == "sqlite",
    )
    with context.begin_transaction():
        context.run_migrations()


async def _run_from_url(url: str) -> None:
    engine = create_async_engine(url)
    try:
        async with engine.connect() as connection:
            await connection.run_sync(_run)
            await connection.commit()
    finally:
        await engine.dispose()


def main() -> None:
    connection = context.config.attributes.get("connection")
    if connection is not None:
        _run(connection)
        return
    url = os.environ.get("KVROUTE_DATABASE_URL")
    if not url:
        raise SystemExit("set KVROUTE_DATABASE_URL to the database to migrate")
    asyncio.run(_run_from_url(url))


main()
