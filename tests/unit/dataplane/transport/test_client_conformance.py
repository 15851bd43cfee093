"""One behaviour suite for any upstream pool behind the seam: the own one and aiohttp's.

Against a scripted replica on a loopback socket: a whole answer, a body read as its
pieces arrive, repeated response headers kept apart, keep-alive reuse, a kept-alive
connection the replica closed replaced unseen, and the three failures the proxy tells
apart (``ConnectionFailed`` before any response byte, ``ResponseBroken`` mid-body,
``TimeoutError`` for a silent replica).
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import pytest

from dataplane.transport.client import ConnectionFailed, ConnectionPool, ResponseBroken
from dataplane.transport.interface import UpstreamPool
from tests.unit.dataplane.transport.adapters import AiohttpPool

READ_TIMEOUT_S = 0.3
POOLS: dict[str, Callable[[], UpstreamPool]] = {
    "own": lambda: ConnectionPool(connect_timeout_s=2.0, read_timeout_s=READ_TIMEOUT_S),
    "aiohttp": lambda: AiohttpPool(connect_timeout_s=2.0, read_timeout_s=READ_TIMEOUT_S),
}
Script = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


class Replica:
    """A loopback server that runs ``script`` on each connection and counts them."""

    def __init__(self, script: Script) -> None:
        self.script = script
        self.connections = 0
        self.url = ""

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            await self.script(reader, writer)
        finally:
            writer.close()


@asynccontextmanager
async def replica_and_pool(kind: str, script: Script) -> AsyncIterator[tuple[Replica, Any]]:
    replica = Replica(script)
    server = await asyncio.start_server(replica._serve, "127.0.0.1", 0)
    replica.url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    pool: UpstreamPool = POOLS[kind]()
    try:
        yield replica, pool
    finally:
        pool.close()
        if isinstance(pool, AiohttpPool):
            await pool.aclose()
        server.close()
        await server.wait_closed()


async def read_head(reader: asyncio.StreamReader) -> bytes:
    return await reader.readuntil(b"\r\n\r\n")


def answering(*answers: bytes) -> Script:
    """Read a request's head and write the next answer, for each answer in turn."""

    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        for answer in answers:
            await read_head(reader)
            writer.write(answer)
            await writer.drain()
        await reader.read()  # until the client closes

    return script


async def read_whole_twice(pool: UpstreamPool, url: str) -> None:
    """Two requests in turn, each answered "hello" and read to its end."""
    for _ in range(2):
        response = await pool.request("GET", f"{url}/", b"", [])
        assert await response.read() == b"hello"
        response.release()


OK = b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\nset-cookie: a=1\r\nset-cookie: b=2\r\n\r\nhello"


@pytest.mark.parametrize("kind", POOLS)
async def test_a_whole_answer_is_read_with_its_repeated_headers_apart(kind: str) -> None:
    async with replica_and_pool(kind, answering(OK)) as (replica, pool):
        response = await pool.request("GET", f"{replica.url}/v1/models", b"", [])
        assert response.status == 200
        assert [v for k, v in response.headers if k == b"set-cookie"] == [b"a=1", b"b=2"]
        assert response.header(b"content-length") == b"5"
        assert await response.read() == b"hello"
        response.release()


@pytest.mark.parametrize("kind", POOLS)
async def test_a_chunked_body_arrives_piece_by_piece(kind: str) -> None:
    second = asyncio.Event()

    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_head(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n4\r\nfirs\r\n")
        await second.wait()  # the second piece only once the first was read
        writer.write(b"3\r\ntwo\r\n0\r\n\r\n")
        await reader.read()

    async with replica_and_pool(kind, script) as (replica, pool):
        response = await pool.request("POST", f"{replica.url}/v1/completions", b"{}", [])
        assert await response.read_chunk() == b"firs"
        second.set()
        assert await response.read() == b"two"
        response.release()


@pytest.mark.parametrize("kind", POOLS)
async def test_a_kept_alive_connection_is_reused(kind: str) -> None:
    async with replica_and_pool(kind, answering(OK, OK)) as (replica, pool):
        await read_whole_twice(pool, replica.url)
        assert replica.connections == 1


@pytest.mark.parametrize("kind", POOLS)
async def test_a_connection_the_replica_closed_is_replaced_unseen(kind: str) -> None:
    async def once(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_head(reader)
        writer.write(OK)  # keep-alive promised, then closed (the replica restarted)
        await writer.drain()

    async with replica_and_pool(kind, once) as (replica, pool):
        await read_whole_twice(pool, replica.url)
        assert replica.connections == 2


@pytest.mark.parametrize("kind", POOLS)
async def test_a_refused_connect_is_connection_failed(kind: str) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # bound, not listening: connections are refused
        async with replica_and_pool(kind, answering()) as (_, pool):
            with pytest.raises(ConnectionFailed):
                await pool.request("GET", f"http://127.0.0.1:{port}/", b"", [])


@pytest.mark.parametrize("kind", POOLS)
async def test_a_silent_replica_is_a_timeout(kind: str) -> None:
    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read()

    async with replica_and_pool(kind, silent) as (replica, pool):
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(pool.request("GET", f"{replica.url}/", b"", []), 5)


@pytest.mark.parametrize("kind", POOLS)
async def test_a_body_cut_short_is_response_broken(kind: str) -> None:
    async def cut(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_head(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\nonly ten b")

    async with replica_and_pool(kind, cut) as (replica, pool):
        response = await pool.request("GET", f"{replica.url}/", b"", [])
        with pytest.raises(ResponseBroken):
            await response.read()
        response.close()
