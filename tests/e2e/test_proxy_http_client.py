"""The proxy's client to the replicas keeps connections alive and survives stale ones."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from dataplane.transport.client import ConnectionFailed, ConnectionPool
from tests.unit.enginesim.simproc import SimProcess

pytestmark = pytest.mark.e2e

BODY = b'{"prompt": "Hello there", "max_tokens": 3}'
HEADERS = [("content-type", "application/json")]


@pytest.fixture(scope="module")
def sim() -> Iterator[SimProcess]:
    with SimProcess("--instant", "--replay-endpoint=") as sim:
        yield sim


async def complete(pool: ConnectionPool, url: str) -> tuple[int, bytes, int]:
    response = await pool.request("POST", f"{url}/v1/completions", BODY, HEADERS)
    body = await response.read()
    connection = id(response._connection)
    response.release()
    return response.status, body, connection


async def test_one_connection_serves_request_after_request(sim: SimProcess) -> None:
    pool = ConnectionPool(2.0, 30.0)
    answers = [await complete(pool, sim.url) for _ in range(5)]
    assert {status for status, _, _ in answers} == {200}
    assert all(b'"completion_tokens":3' in body for _, body, _ in answers)
    assert len({connection for _, _, connection in answers}) == 1
    pool.close()


async def test_a_connection_the_replica_closed_is_replaced_unseen(sim: SimProcess) -> None:
    pool = ConnectionPool(2.0, 30.0)
    _, _, first = await complete(pool, sim.url)
    (idle,) = pool._idle.values()
    assert idle[0].transport is not None
    idle[0].transport.abort()  # as if the replica had timed the idle connection out
    status, _, second = await complete(pool, sim.url)
    assert status == 200 and second != first
    pool.close()


async def test_nobody_listening_is_a_connect_failure() -> None:
    pool = ConnectionPool(2.0, 30.0)
    with pytest.raises(ConnectionFailed, match="cannot connect"):
        await pool.request("POST", "http://127.0.0.1:9/v1/completions", BODY, HEADERS)
