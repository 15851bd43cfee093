"""One behaviour suite for any server behind the seam: the own one and uvicorn's.

What a client of the proxy notices, over real loopback sockets: the request reaches the
handler as sent, whole and streamed answers arrive, keep-alive, repeated headers joined,
a handler's error is a 500. Where the own server is stricter by design (a body cap, a
second ``authorization`` refused, a hang-up cancelling the handler), uvicorn's result is
marked ``xfail`` with the reason: what swapping the server would lose.
"""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import pytest

from dataplane.transport.interface import Handler, Server, ServerRequest, ServerResponse
from dataplane.transport.server import HttpServer
from tests.unit.dataplane.test_http_server import Answer, Client, post
from tests.unit.dataplane.transport.adapters import UvicornServer

LIMIT = 4096
SERVERS: dict[str, Callable[[Handler], Server]] = {
    "own": lambda handler: HttpServer(handler, max_body_bytes=LIMIT),
    "uvicorn": lambda handler: UvicornServer(handler, max_body_bytes=LIMIT),
}
STRICTER = "the own server is stricter by design here"


def stricter(reason: str) -> Any:
    """uvicorn is expected to fail: the own server does this and the library does not."""
    return [
        "own",
        pytest.param("uvicorn", marks=pytest.mark.xfail(reason=reason, strict=True)),
    ]


class Recorder:
    """Answers what it got as JSON; ``/stream`` answers three pieces; ``/boom`` raises;
    ``/hold`` waits until cancelled."""

    def __init__(self) -> None:
        self.cancelled = asyncio.Event()
        self.holding = asyncio.Event()

    async def __call__(self, request: ServerRequest, response: ServerResponse) -> None:
        if request.path == "/stream":
            response.start(200, [(b"content-type", b"text/event-stream")])
            for i in range(3):
                await response.write(b"data: %d\n\n" % i)
            response.end()
        elif request.path == "/boom":
            raise ValueError("a bug in the handler")
        elif request.path == "/hold":
            await self._hold()
        else:
            seen = {
                "method": request.method,
                "path": request.path,
                "query": request.query,
                "body": request.body.decode(),
                "tag": request.headers.get("x-tag"),
            }
            response.send(200, [(b"content-type", b"application/json")], json.dumps(seen).encode())

    async def _hold(self) -> None:
        self.holding.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            self.cancelled.set()
            raise


@asynccontextmanager
async def serving(kind: str, handler: Handler) -> AsyncIterator[Callable[[], Awaitable[Client]]]:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    server = SERVERS[kind](handler)
    await server.start(sock)
    port = sock.getsockname()[1]
    clients: list[Client] = []

    async def connect() -> Client:
        clients.append(Client(*await asyncio.open_connection("127.0.0.1", port)))
        return clients[-1]

    try:
        yield connect
    finally:
        for client in clients:
            client.writer.close()
            await client.writer.wait_closed()
        await server.aclose(grace_s=1.0)
        sock.close()


async def answer_to(kind: str, request: bytes) -> Answer:
    """The answer to one request on a new connection to a server of ``kind``."""
    async with serving(kind, Recorder()) as connect:
        client = await connect()
        await client.send(request)
        return await client.answer()


def get(path: str, *extra: str) -> bytes:
    return ("\r\n".join([f"GET {path} HTTP/1.1", "host: t", *extra]) + "\r\n\r\n").encode()


@pytest.mark.parametrize("kind", SERVERS)
async def test_a_request_reaches_the_handler_as_sent(kind: str) -> None:
    answer = await answer_to(kind, get("/v1/models?limit=2"))
    assert answer.status == 200
    assert answer.headers["content-length"] == str(len(answer.body))
    seen = json.loads(answer.body)
    assert (seen["method"], seen["path"], seen["query"]) == ("GET", "/v1/models", "limit=2")


@pytest.mark.parametrize("kind", SERVERS)
async def test_bodies_by_length_and_chunked_reach_the_handler_whole(kind: str) -> None:
    async with serving(kind, Recorder()) as connect:
        client = await connect()
        await client.send(post("/v1/completions", b'{"prompt": "hi"}'))
        assert json.loads((await client.answer()).body)["body"] == '{"prompt": "hi"}'
        chunked = b"POST /c HTTP/1.1\r\nhost: t\r\ntransfer-encoding: chunked\r\n\r\n"
        await client.send(chunked + b"3\r\nabc\r\n2\r\nde\r\n0\r\n\r\n")
        assert json.loads((await client.answer()).body)["body"] == "abcde"


@pytest.mark.parametrize("kind", SERVERS)
async def test_a_stream_arrives_whole_and_the_connection_is_kept(kind: str) -> None:
    async with serving(kind, Recorder()) as connect:
        client = await connect()
        await client.send(get("/stream"))
        answer = await client.answer()
        assert answer.headers["transfer-encoding"] == "chunked"
        assert answer.body == b"data: 0\n\ndata: 1\n\ndata: 2\n\n"
        await client.send(get("/after"))
        assert json.loads((await client.answer()).body)["path"] == "/after"


@pytest.mark.parametrize("kind", SERVERS)
async def test_a_repeated_header_reaches_the_handler_joined(kind: str) -> None:
    answer = await answer_to(kind, get("/", "x-tag: a", "x-tag: b"))
    assert json.loads(answer.body)["tag"] == "a, b"


@pytest.mark.parametrize("kind", SERVERS)
async def test_a_handler_error_is_a_500(kind: str) -> None:
    assert (await answer_to(kind, get("/boom"))).status == 500


@pytest.mark.parametrize(
    "kind", stricter("uvicorn passes a second authorization line on (RFC 9110 allows a 400)")
)
async def test_a_second_authorization_is_a_400(kind: str) -> None:
    second = get("/", "authorization: Bearer a", "authorization: Bearer b")
    assert (await answer_to(kind, second)).status == 400


@pytest.mark.parametrize("kind", stricter("uvicorn has no request body cap"))
async def test_a_body_over_the_cap_is_a_413(kind: str) -> None:
    assert (await answer_to(kind, post("/v1/completions", b"x" * (LIMIT + 1)))).status == 413


@pytest.mark.parametrize(
    "kind", stricter("uvicorn tells a hang-up to receive(), it does not cancel the app")
)
async def test_a_hang_up_cancels_the_handler(kind: str) -> None:
    recorder = Recorder()
    async with serving(kind, recorder) as connect:
        client = await connect()
        await client.send(get("/hold"))
        await asyncio.wait_for(recorder.holding.wait(), 5)
        client.writer.close()
        await asyncio.wait_for(recorder.cancelled.wait(), 2)
