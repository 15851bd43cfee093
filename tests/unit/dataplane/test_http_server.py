"""The proxy's HTTP/1.1 server, spoken to over real loopback sockets.

What a client notices: keep-alive, bodies by length or chunked, pipelined requests
answered in order, streams that wait for a slow reader, a disconnect that stops the
handler at once, and every malformed request refused with a 4xx in OpenAI's shape.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import time
from collections.abc import AsyncIterator, Callable, Coroutine
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from email.utils import parsedate_to_datetime
from typing import Any

import httptools
import pytest
import uvloop

from dataplane.transport import server as http_server
from dataplane.transport.server import MAX_HEAD_BYTES, HttpServer, Request, Response

LIMIT = 4096
JSON = [(b"content-type", b"application/json")]


def on_both_loops(test: Callable[[], Coroutine[Any, Any, None]]) -> Callable[[str], None]:
    """The test on uvloop (what the proxy runs on) and on asyncio's own loop."""

    @pytest.mark.parametrize("loop", ["uvloop", "asyncio"])
    def run(loop: str) -> None:
        (uvloop.run if loop == "uvloop" else asyncio.run)(test())

    run.__name__, run.__doc__ = test.__name__, test.__doc__
    return run


LOOP_CLOCK_GRAIN_S = 0.002  # libuv's now: whole milliseconds, read once per iteration


@dataclass
class Answer:
    status: int
    headers: dict[str, str]
    body: bytes


@dataclass
class Client:
    """A raw connection; answers are parsed with httptools as they arrive."""

    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter
    answers: list[Answer] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._parser = httptools.HttpResponseParser(self)
        self._headers: dict[str, str] = {}
        self._body: list[bytes] = []

    def on_header(self, name: bytes, value: bytes) -> None:
        self._headers[name.decode().lower()] = value.decode()

    def on_body(self, body: bytes) -> None:
        self._body.append(body)

    def on_message_complete(self) -> None:
        status = self._parser.get_status_code()
        self.answers.append(Answer(status, self._headers, b"".join(self._body)))
        self._headers, self._body = {}, []

    async def send(self, data: bytes) -> None:
        self.writer.write(data)
        await self.writer.drain()

    async def answer(self) -> Answer:
        while not self.answers:
            data = await asyncio.wait_for(self.reader.read(65536), 10)
            assert data, "the server closed the connection without an answer"
            self._parser.feed_data(data)
        return self.answers.pop(0)

    async def closed_by_server(self) -> bool:
        rest = await asyncio.wait_for(self.reader.read(), 10)
        if rest:
            self._parser.feed_data(rest)
        return True


def post(path: str, body: bytes, *extra: str) -> bytes:
    head = [f"POST {path} HTTP/1.1", "host: t", f"content-length: {len(body)}", *extra]
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body


class Echo:
    """Handler: answers the method, path, query and body it got, as JSON."""

    def __init__(self) -> None:
        self.cancelled = asyncio.Event()
        self.stream_started = asyncio.Event()
        self.pieces_written = 0
        self.finished = asyncio.Event()

    async def __call__(self, request: Request, response: Response) -> None:
        if request.path == "/stream":
            await self._stream(response, int(request.query or "3"))
            return
        if request.path == "/boom":
            raise ValueError("a bug in the handler")
        answer = {
            "method": request.method,
            "path": request.path,
            "query": request.query,
            "body": request.body.decode(),
            "agent": request.headers.get("user-agent"),
        }
        response.send(200, JSON, json.dumps(answer).encode())

    async def _stream(self, response: Response, pieces: int) -> None:
        response.start(200, [(b"content-type", b"text/event-stream")])
        try:
            for i in range(pieces):
                await response.write(b"data: %d %s\n\n" % (i, b"x" * 65536))
                self.pieces_written += 1
                self.stream_started.set()
            response.end()
            self.finished.set()
        except asyncio.CancelledError:
            self.cancelled.set()
            raise


@asynccontextmanager
async def serving(
    handler: Any, keep_alive_s: float = 75.0, **limits: Any
) -> AsyncIterator[tuple[HttpServer, Any]]:
    """``handler`` served on a free port, with the server's ``limits`` (header
    deadline, connection cap) if given; yields the server and a way to connect."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    server = HttpServer(handler, max_body_bytes=LIMIT, keep_alive_s=keep_alive_s, **limits)
    await server.start(sock)
    port = sock.getsockname()[1]
    clients: list[Client] = []

    async def connect() -> Client:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        clients.append(Client(reader, writer))
        return clients[-1]

    try:
        yield server, connect
    finally:
        for client in clients:
            client.writer.close()
            with contextlib.suppress(OSError):
                await client.writer.wait_closed()
        await server.aclose(grace_s=1)


def body_of(answer: Answer) -> Any:
    return json.loads(answer.body)


@on_both_loops
async def test_one_connection_serves_request_after_request() -> None:
    async with serving(Echo()) as (_, connect):
        client = await connect()
        for i in range(3):
            await client.send(post(f"/v1/x?n={i}", b'{"i": %d}' % i))
            answer = await client.answer()
            assert answer.status == 200
            assert body_of(answer) == {"method": "POST", "path": "/v1/x", "query": f"n={i}",
                                       "body": f'{{"i": {i}}}', "agent": None}  # fmt: skip
            assert "connection" not in answer.headers


@on_both_loops
async def test_every_answer_is_dated_as_http_asks() -> None:
    """A whole answer, a stream and a refusal each carry RFC 9110's ``date``: now, in
    the IMF-fixdate form."""
    async with serving(Echo()) as (_, connect):
        client = await connect()
        await client.send(post("/v1/x", b"{}"))
        await client.send(post("/stream?1", b""))
        await client.send(post("/v1/x", b"x" * (LIMIT + 1)))
        for status in (200, 200, 413):
            answer = await client.answer()
            assert answer.status == status
            dated = parsedate_to_datetime(answer.headers["date"])
            assert answer.headers["date"].endswith(" GMT") and dated.tzinfo is not None
            assert abs(dated.timestamp() - time.time()) < 5


@on_both_loops
async def test_an_absolute_form_target_is_served_as_its_path_and_query() -> None:
    """HTTP/1.1 servers must accept ``POST http://host/path`` (RFC 9112, 3.2.2), as
    the engines' uvicorn does."""
    async with serving(Echo()) as (_, connect):
        client = await connect()
        for target, path, query in (
            ("http://t:8000/v1/x?n=1", "/v1/x", "n=1"),
            ("http://t:8000/v1/x", "/v1/x", ""),
            ("http://t:8000", "/", ""),
        ):
            await client.send(post(target, b"{}"))
            answer = await client.answer()
            assert answer.status == 200
            assert (body_of(answer)["path"], body_of(answer)["query"]) == (path, query)


@on_both_loops
async def test_a_chunked_request_body_reaches_the_handler_whole() -> None:
    async with serving(Echo()) as (_, connect):
        client = await connect()
        head = b"POST /v1/c HTTP/1.1\r\nhost: t\r\ntransfer-encoding: chunked\r\n\r\n"
        await client.send(head + b"5\r\nhello\r\n")
        await client.send(b"6\r\n world\r\n0\r\n\r\n")
        assert body_of(await client.answer())["body"] == "hello world"


@on_both_loops
async def test_pipelined_requests_are_answered_in_order() -> None:
    async with serving(Echo()) as (_, connect):
        client = await connect()
        await client.send(b"".join(post(f"/p{i}", b"%d" % i) for i in range(12)))
        paths = [body_of(await client.answer())["path"] for _ in range(12)]
        assert paths == [f"/p{i}" for i in range(12)]


@on_both_loops
async def test_a_malformed_request_gets_an_openai_shaped_400_and_the_connection_closes() -> None:
    async with serving(Echo()) as (_, connect):
        client = await connect()
        await client.send(b"POST /v1/x HTTP/1.1\r\nhost: t\r\ncontent-length: nope\r\n\r\n")
        answer = await client.answer()
        assert answer.status == 400
        assert body_of(answer)["error"]["type"] == "invalid_request_error"
        assert "Malformed HTTP request" in body_of(answer)["error"]["message"]
        assert answer.headers["connection"] == "close"
        assert await client.closed_by_server()


@on_both_loops
async def test_garbage_instead_of_http_is_refused_with_400() -> None:
    async with serving(Echo()) as (_, connect):
        client = await connect()
        await client.send(b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03 TLS hello\r\n\r\n")
        assert (await client.answer()).status == 400


@on_both_loops
async def test_a_body_over_the_limit_is_refused_413_before_it_is_read() -> None:
    async with serving(Echo()) as (_, connect):
        client = await connect()
        head = f"POST /v1/x HTTP/1.1\r\nhost: t\r\ncontent-length: {LIMIT + 1}\r\n\r\n"
        await client.send(head.encode())  # no body sent: the answer must not wait for it
        answer = await client.answer()
        assert answer.status == 413
        assert (
            body_of(answer)["error"]["message"] == f"The request body is larger than {LIMIT} bytes."
        )
        assert await client.closed_by_server()


@on_both_loops
async def test_a_chunked_body_over_the_limit_is_refused_413() -> None:
    async with serving(Echo()) as (_, connect):
        client = await connect()
        head = b"POST /v1/x HTTP/1.1\r\nhost: t\r\ntransfer-encoding: chunked\r\n\r\n"
        piece = b"x" * 1000
        await client.send(head + b"".join(b"3e8\r\n" + piece + b"\r\n" for _ in range(5)))
        assert (await client.answer()).status == 413


@on_both_loops
async def test_headers_over_the_limit_are_refused_431() -> None:
    async with serving(Echo()) as (_, connect):
        client = await connect()
        big = "x-big: " + "y" * (MAX_HEAD_BYTES + 10)
        await client.send(post("/v1/x", b"{}", big))
        answer = await client.answer()
        assert answer.status == 431
        assert body_of(answer)["error"]["type"] == "invalid_request_error"


@on_both_loops
async def test_expect_100_continue_is_answered_before_the_body_is_sent() -> None:
    async with serving(Echo()) as (_, connect):
        client = await connect()
        await client.send(
            b"POST /v1/x HTTP/1.1\r\nhost: t\r\ncontent-length: 2\r\nexpect: 100-continue\r\n\r\n"
        )
        interim = await asyncio.wait_for(client.reader.readuntil(b"\r\n\r\n"), 10)
        assert interim == b"HTTP/1.1 100 Continue\r\n\r\n"
        await client.send(b"{}")
        assert body_of(await client.answer())["body"] == "{}"


@on_both_loops
async def test_connection_close_and_http_1_0_end_the_connection_after_the_answer() -> None:
    async with serving(Echo()) as (_, connect):
        client = await connect()
        await client.send(post("/v1/x", b"{}", "connection: close"))
        answer = await client.answer()
        assert answer.status == 200 and answer.headers["connection"] == "close"
        assert await client.closed_by_server()
        client = await connect()
        await client.send(b"GET /v1/y HTTP/1.0\r\n\r\n")
        assert body_of(await client.answer())["path"] == "/v1/y"
        assert await client.closed_by_server()


@on_both_loops
async def test_an_upgrade_request_is_answered_as_plain_http() -> None:
    async with serving(Echo()) as (_, connect):
        client = await connect()
        await client.send(
            b"GET /a HTTP/1.1\r\nhost: t\r\nconnection: Upgrade, HTTP2-Settings\r\n"
            b"upgrade: h2c\r\nhttp2-settings: AAMAAABkAAQAAP__\r\n\r\n" + post("/b", b"{}")
        )
        assert body_of(await client.answer())["path"] == "/a"
        assert body_of(await client.answer())["path"] == "/b"


@on_both_loops
async def test_a_stream_arrives_chunk_by_chunk_and_the_connection_is_kept() -> None:
    async with serving(Echo()) as (_, connect):
        client = await connect()
        await client.send(b"GET /stream?3 HTTP/1.1\r\nhost: t\r\n\r\n")
        answer = await client.answer()
        assert answer.headers["transfer-encoding"] == "chunked"
        assert answer.body == b"".join(b"data: %d %s\n\n" % (i, b"x" * 65536) for i in range(3))
        await client.send(post("/after", b""))
        assert body_of(await client.answer())["path"] == "/after"


@on_both_loops
async def test_a_stream_to_http_1_0_comes_unchunked_and_ends_with_the_connection() -> None:
    """HTTP/1.0 has no chunked coding (RFC 9112 forbids sending it one): the pieces
    come as they are, and the server's close ends the body, keep-alive asked or not."""
    async with serving(Echo()) as (_, connect):
        for extra in (b"", b"connection: keep-alive\r\n"):
            client = await connect()
            await client.send(b"GET /stream?3 HTTP/1.0\r\n" + extra + b"\r\n")
            raw = await asyncio.wait_for(client.reader.read(), 10)  # up to the close
            head, _, body = raw.partition(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 200 ")
            assert b"transfer-encoding" not in head and b"connection: close" in head
            assert body == b"".join(b"data: %d %s\n\n" % (i, b"x" * 65536) for i in range(3))


@on_both_loops
async def test_a_slow_reader_holds_the_stream_back() -> None:
    echo = Echo()
    pieces = 512  # 32 MiB: far more than the socket buffers hold
    async with serving(echo) as (_, connect):
        client = await connect()
        await client.send(f"GET /stream?{pieces} HTTP/1.1\r\nhost: t\r\n\r\n".encode())
        await echo.stream_started.wait()
        done, _ = await asyncio.wait([asyncio.ensure_future(echo.finished.wait())], timeout=0.5)
        assert not done, "the handler wrote 32 MiB to a client that read nothing"
        assert echo.pieces_written < pieces
        answer = await client.answer()  # now read it all: the handler resumes and ends
        assert len(answer.body) == pieces * (65536 + 9) + sum(len(str(i)) for i in range(pieces))
        assert echo.finished.is_set()


@on_both_loops
async def test_a_client_that_disconnects_mid_stream_cancels_the_handler_at_once() -> None:
    echo = Echo()
    async with serving(echo) as (_, connect):
        client = await connect()
        await client.send(b"GET /stream?100000 HTTP/1.1\r\nhost: t\r\n\r\n")
        await echo.stream_started.wait()
        client.writer.transport.abort()
        await asyncio.wait_for(echo.cancelled.wait(), 10)
        assert not echo.finished.is_set()


@on_both_loops
async def test_a_handler_bug_is_a_500_in_openai_shape_and_the_connection_survives() -> None:
    async with serving(Echo()) as (_, connect):
        client = await connect()
        await client.send(post("/boom", b""))
        answer = await client.answer()
        assert answer.status == 500
        assert body_of(answer)["error"]["message"] == "internal error in the proxy"
        await client.send(post("/after", b""))
        assert (await client.answer()).status == 200


@on_both_loops
async def test_an_idle_connection_is_closed_after_the_keep_alive_time() -> None:
    async with serving(Echo(), keep_alive_s=0.05) as (_, connect):
        client = await connect()
        await client.send(post("/v1/x", b""))
        assert (await client.answer()).status == 200
        assert await client.closed_by_server()


@on_both_loops
async def test_closing_the_server_lets_a_request_in_progress_finish() -> None:
    echo = Echo()
    async with serving(echo) as (server, connect):
        client = await connect()
        await client.send(b"GET /stream?64 HTTP/1.1\r\nhost: t\r\n\r\n")
        await echo.stream_started.wait()
        closing = asyncio.ensure_future(server.aclose(grace_s=10))
        answer = await client.answer()
        await closing
        assert len(answer.body) > 64 * 65536 and echo.finished.is_set()
        assert answer.headers.get("connection") != "close"  # the head was out before
        assert await client.closed_by_server()


# -- what an attacker or a careless client sends (issue 42 item 3, issue 46 item 4) ----


@on_both_loops
async def test_a_repeated_header_the_server_reads_is_refused_400() -> None:
    """RFC 9112 asks a 400 for two ``host`` lines; two ``authorization`` (or framing)
    values are an ambiguity a front proxy may have resolved the other way."""
    async with serving(Echo()) as (_, connect):
        for name, first, second in (
            ("host", "a", "b"),
            ("authorization", "Bearer one", "Bearer two"),
            ("content-length", "2", "2"),
            ("transfer-encoding", "chunked", "chunked"),
            ("Authorization", "Bearer one", "Bearer one"),
        ):
            framing = "" if name.endswith(("length", "encoding")) else "content-length: 0\r\n"
            head = f"POST /v1/x HTTP/1.1\r\n{framing}{name}: {first}\r\n{name}: {second}\r\n"
            client = await connect()
            await client.send(head.encode() + b"\r\n0\r\n\r\n")
            answer = await client.answer()
            assert answer.status == 400, name
            assert name.lower() in body_of(answer)["error"]["message"].lower()
            assert await client.closed_by_server()


@on_both_loops
async def test_a_header_the_handler_reads_is_refused_when_repeated() -> None:
    async with serving(Echo()) as (server, connect):
        server.single_headers |= {"x-tenant"}
        client = await connect()
        await client.send(post("/v1/x", b"{}", "x-tenant: a", "x-tenant: b"))
        answer = await client.answer()
        assert answer.status == 400 and "x-tenant" in body_of(answer)["error"]["message"]


@on_both_loops
async def test_other_repeated_headers_reach_the_handler_joined_not_collapsed() -> None:
    async with serving(Echo()) as (_, connect):
        client = await connect()
        await client.send(post("/v1/x", b"{}", "user-agent: one", "user-agent: two"))
        assert body_of(await client.answer())["agent"] == "one, two"


@on_both_loops
async def test_an_http_0_9_request_is_refused_not_served() -> None:
    async with serving(Echo()) as (_, connect):
        client = await connect()
        await client.send(b"GET /v1/x\r\n\r\n")
        raw = await asyncio.wait_for(client.reader.read(), 10)  # up to the close
        assert raw.startswith(b"HTTP/1.1 400 "), raw[:40]
        assert b"HTTP/0.9" in raw


@on_both_loops
async def test_three_pipelined_requests_then_the_clients_eof_get_three_answers() -> None:
    """``printf 'GET..GET..GET..' | nc``: the client half-closes after sending; every
    request it sent is still answered, in order, then the server closes."""
    async with serving(Echo()) as (_, connect):
        client = await connect()
        await client.send(b"".join(post(f"/p{i}", b"%d" % i) for i in range(3)))
        client.writer.write_eof()
        paths = [body_of(await client.answer())["path"] for _ in range(3)]
        assert paths == ["/p0", "/p1", "/p2"]
        assert await client.closed_by_server()


@on_both_loops
async def test_a_clients_eof_while_its_lone_request_runs_cancels_it_as_a_client_gone() -> None:
    """A client that closes its side while its only request runs is gone (as nginx takes
    it): the handler is cancelled at once, so the engine stops, rather than answered."""
    echo = Echo()
    async with serving(echo) as (_, connect):
        client = await connect()
        await client.send(b"GET /stream?100000 HTTP/1.1\r\nhost: t\r\n\r\n")
        await echo.stream_started.wait()
        client.writer.write_eof()
        await asyncio.wait_for(echo.cancelled.wait(), 10)
        assert not echo.finished.is_set()


@on_both_loops
async def test_a_body_over_the_limit_still_being_sent_gets_its_413_not_a_reset() -> None:
    """A chunked upload (no declared length) of 2 MiB against a 4 KiB limit: the client
    sends it all before it reads, as most clients do; the server answers 413 and reads
    on (discarding) until the client is done, so the upload ends and the 413 is read."""
    async with serving(Echo()) as (_, connect):
        client = await connect()
        head = b"POST /v1/x HTTP/1.1\r\nhost: t\r\ntransfer-encoding: chunked\r\n\r\n"
        piece = b"10000\r\n" + b"x" * 65536 + b"\r\n"
        await client.send(head + piece * 32 + b"0\r\n\r\n")  # raises on a reset
        answer = await client.answer()
        assert answer.status == 413 and answer.headers["connection"] == "close"
        assert await client.closed_by_server()


def test_beyond_max_lingering_a_refused_connection_closes_at_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A flood of refused connections cannot hold descriptors for LINGER_S each: past
    MAX_LINGERING, a refusal closes at once (the client reads its answer, then the end)."""
    monkeypatch.setattr(http_server, "MAX_LINGERING", 0)

    async def refused() -> None:
        async with serving(Echo()) as (server, connect):
            client = await connect()
            head = f"POST /v1/x HTTP/1.1\r\nhost: t\r\ncontent-length: {LIMIT + 1}\r\n\r\n"
            await client.send(head.encode())  # and keeps its side open, sending nothing
            raw = await asyncio.wait_for(client.reader.read(), 10)  # the answer, then FIN
            assert raw.startswith(b"HTTP/1.1 413 ")
            for _ in range(100):  # the close reaches the server's bookkeeping
                if not server.connections:
                    break
                await asyncio.sleep(0.01)
            assert not server.connections, "the refused connection still holds its socket"

    uvloop.run(refused())


@on_both_loops
async def test_a_client_dripping_its_head_is_cut_at_the_header_deadline() -> None:
    """One header byte every 20 ms keeps the connection busy forever without a deadline
    of its own; keep-alive (75 s) does not cut it. The server answers 408 and closes."""
    async with serving(Echo(), header_timeout_s=0.3) as (_, connect):
        started = time.monotonic()  # before the connection, whose accept starts the deadline
        client = await connect()
        await client.send(b"GET /v1/x HTTP/1.1\r\nhost: t\r\n")

        async def drip() -> None:
            with contextlib.suppress(OSError):
                while True:
                    await client.send(b"x")
                    await asyncio.sleep(0.02)  # the client's pace, what is tested

        dripping = asyncio.ensure_future(drip())
        try:
            raw = await asyncio.wait_for(client.reader.read(), 10)  # up to the close
        finally:
            dripping.cancel()
        assert raw.startswith(b"HTTP/1.1 408 "), raw[:40]
        # not before the deadline, to the loop clock's grain: uvloop (libuv) reads its
        # clock once per loop iteration, in whole milliseconds, so its timers may end a
        # fraction of a millisecond before the wall clock says (CI saw 0.29985 s)
        assert 0.3 - LOOP_CLOCK_GRAIN_S <= time.monotonic() - started < 3


@on_both_loops
async def test_a_connection_that_sends_nothing_is_closed_at_the_header_deadline() -> None:
    async with serving(Echo(), header_timeout_s=0.2) as (_, connect):
        client = await connect()
        assert await asyncio.wait_for(client.reader.read(), 10) == b""


@on_both_loops
async def test_the_header_deadline_does_not_cut_a_request_being_served() -> None:
    async with serving(Echo(), header_timeout_s=0.2) as (_, connect):
        client = await connect()
        await client.send(b"GET /stream?40 HTTP/1.1\r\nhost: t\r\n\r\n")
        await asyncio.sleep(0.4)  # past the deadline, reading nothing: the stream waits
        answer = await client.answer()
        assert answer.status == 200 and len(answer.body) > 40 * 65536


@on_both_loops
async def test_connections_beyond_the_cap_are_refused_503_with_a_reason() -> None:
    async with serving(Echo(), max_connections=2) as (_, connect):
        held = [await connect() for _ in range(2)]
        for client in held:  # both are open on the server's side
            await client.send(post("/v1/x", b"{}"))
            assert (await client.answer()).status == 200
        extra = await connect()
        await extra.send(post("/v1/x", b"{}"))
        answer = await extra.answer()
        assert answer.status == 503 and answer.headers["connection"] == "close"
        assert "2 connections" in body_of(answer)["error"]["message"]
        assert answer.headers["retry-after"] == "1"
        held[0].writer.close()
        assert await held[0].closed_by_server()
        for _ in range(100):  # the server sees the close on its next turn
            again = await connect()
            await again.send(post("/v1/x", b"{}"))
            if (await again.answer()).status == 200:
                break
        else:
            raise AssertionError("a freed connection slot was never taken again")
