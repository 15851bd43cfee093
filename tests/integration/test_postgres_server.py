"""The postgres_server fixture runs a real PostgreSQL: transactions commit or roll back."""

from __future__ import annotations

import pytest
import sqlalchemy as sa
from sqlalchemy.ext.asyncio import create_async_engine

from kvroute.servers import PostgresServer

pytestmark = pytest.mark.integration


async def test_a_failed_transaction_leaves_nothing_and_a_committed_one_stays(
    postgres_server: PostgresServer,
) -> None:
    engine = create_async_engine(postgres_server.url())
    try:
        async with engine.begin() as conn:
            await conn.execute(sa.text("CREATE TABLE audit (id serial PRIMARY KEY, action text)"))

        with pytest.raises(sa.exc.IntegrityError):
            async with engine.begin() as conn:
                await conn.execute(sa.text("INSERT INTO audit (action) VALUES ('lost')"))
                await conn.execute(sa.text("INSERT INTO audit (id, action) VALUES (1, 'dup')"))

        async with engine.begin() as conn:
            await conn.execute(sa.text("INSERT INTO audit (action) VALUES ('kept')"))

        async with engine.connect() as conn:
            rows = (await conn.execute(sa.text("SELECT action FROM audit"))).scalars().all()
            version = (await conn.execute(sa.text("SHOW server_version"))).scalar_one()
        assert rows == ["kept"]
        assert int(version.split(".")[0]) >= 13
    finally:
        await engine.dispose()
