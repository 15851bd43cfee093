"""The proxy's own HTTP/1.1 server: one asyncio protocol per connection on httptools.

Why not uvicorn: the proxy adds a hop to every request, so the server's own cost per
request is a large share of the latency budget. uvicorn builds an ASGI scope, message
dicts and a task wrapper per request and writes a response's head and body in two
system calls; measured side by side (docs/architecture.md, "Proxy stack"), a
pass-through on this server adds about 0.7x the latency and CPU of one on uvicorn. It
serves only what the proxy needs:

- keep-alive (HTTP/1.1's default; ``Connection: close`` and HTTP/1.0 honoured); a
  connection that completes no request for ``keep_alive_s`` is closed;
- request bodies by ``Content-Length`` or chunked, read whole before the handler runs,
  at most ``max_body_bytes`` (else 413, and the connection closes: the rest is not read);
  ``Expect: 100-continue`` is answered before the body is read;
- pipelined requests answered in order, one at a time (reading pauses while
  ``MAX_PIPELINED`` wait);
- a response with a body is one write (head and body together); a stream is chunked
  (to an HTTP/1.0 request, which cannot take chunks (RFC 9112), its bytes as they come,
  ended by closing the connection), and :meth:`Response.write` waits while the client's
  socket buffer is full (``pause_writing``), so a slow client holds the upstream back
  instead of filling memory;
- a client that disconnects cancels its request's handler at once (``connection_lost``),
  which closes the upstream connection: the engine aborts the request;
- ``Upgrade`` is ignored (the answer is HTTP/1.1, as RFC 9110 allows);
- every answer has a ``date`` (RFC 9110's, formatted once a second), first after the
  status line as uvicorn and hyper write it;
- a malformed request (a parser error, a head over ``MAX_HEAD_BYTES``, an HTTP/0.9
  request line, a second ``host``, ``authorization``, ``content-length`` or
  ``transfer-encoding`` line or of any header in ``single_headers``: RFC 9110/9112, and
  a front proxy may have read the other value) gets a 4xx in OpenAI's error shape; any
  other repeated header reaches the handler joined with ", " (RFC 9110, 5.3), never
  collapsed to one value;
- a refused request's answer is followed by a lingering close (as nginx's): the server
  stops writing, reads on and discards for up to ``LINGER_S``, so a client still
  sending a body (one over ``max_body_bytes``, sent chunked) finishes and reads its 413
  instead of a reset (at most ``MAX_LINGERING`` at once: beyond, a refusal closes at
  once, so a flood of refused connections holds no descriptors);
- a client that half-closes after pipelining requests (``printf ... | nc``) gets every
  answer, in order; an EOF while a lone request runs is a hang-up, as above;
- a request's head must arrive whole within ``header_timeout_s`` of its first byte (of
  the connection, for its first request), else 408 and close, whatever keep-alive says:
  a client dripping header bytes holds a connection no longer (nginx's
  ``client_header_timeout``);
- at most ``max_connections`` connections at once: one more is answered 503 with the
  reason and closed (0: no cap).

The handler is ``async def handler(request: Request, response: Response) -> None``; an
exception it lets out is logged and answered 500 if nothing was sent yet.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from collections import deque
from collections.abc import Awaitable, Callable
from email.utils import formatdate
from http import HTTPStatus
from typing import Any

import httptools

from dataplane.http_errors import (
    ApiError,
    BadRequest,
    HeadersTooLarge,
    PayloadTooLarge,
    RequestTimeout,
    ServiceUnavailable,
)

log = logging.getLogger("dataplane")

MAX_HEAD_BYTES = 64 * 1024  # request line and headers together
MAX_PIPELINED = 8  # requests read ahead of the one being answered
HEADER_TIMEOUT_S = 15.0
LINGER_S = 5.0  # a refused client's bytes read and dropped for up to this, then close
MAX_LINGERING = 1024  # refused connections lingering at once; more close at once (a flood)
# headers the server reads itself: more than one line of any is refused (RFC 9112)
SINGLE_HEADERS = frozenset({"host", "authorization", "content-length", "transfer-encoding"})
_STATUS_LINES = {s.value: b"HTTP/1.1 %d %s\r\n" % (s.value, s.phrase.encode()) for s in HTTPStatus}
_CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"
_CLOSE = b"connection: close\r\n"
_CHUNKED = b"transfer-encoding: chunked\r\n"
_LAST_CHUNK = b"0\r\n\r\n"
_JSON = b"application/json"


class Request:
    """One parsed request; ``headers`` by lower-case name (a repeated header's values
    joined with ", ")."""

    __slots__ = ("body", "headers", "http_1_0", "keep_alive", "method", "path", "query")

    def __init__(
        self, method: str, path: str, query: str, headers: dict[str, str], body: bytes
    ) -> None:
        self.method = method
        self.path = path
        self.query = query
        self.headers = headers
        self.body = body
        self.keep_alive = True
        self.http_1_0 = False


Handler = Callable[[Request, "Response"], Awaitable[None]]


class Response:
    """How a handler answers: :meth:`send` a whole body, or :meth:`start`, then
    :meth:`write` each piece (chunked) and :meth:`end`. Header names are lower-case bytes."""

    __slots__ = (
        "_connection",
        "_head",
        "_head_only",
        "_unchunked",
        "closes",
        "finished",
        "started",
    )

    def __init__(self, connection: _Connection, request: Request) -> None:
        self._connection = connection
        self.closes = not request.keep_alive  # the connection closes after it
        self._head_only = request.method == "HEAD"
        self._unchunked = request.http_1_0  # a stream to it: plain bytes, then close
        self._head = b""  # a stream's head, sent with its first piece
        self.started = False
        self.finished = False

    def send(self, status: int, headers: list[tuple[bytes, bytes]], body: bytes) -> None:
        """The whole response in one write (a ``content-length`` is added)."""
        self._begin()
        extra = b"content-length: %d\r\n" % len(body)
        head = _head(status, headers, extra + _CLOSE if self._must_close() else extra)
        self._connection.write(head if self._head_only else head + body)
        self.finished = True

    def start(self, status: int, headers: list[tuple[bytes, bytes]]) -> None:
        """Begin a streamed (chunked) response; nothing is written before the first piece.
        To an HTTP/1.0 request the pieces go unframed and the connection's close ends
        them."""
        self._begin()
        if self._unchunked:
            self.closes = True
            self._head = _head(status, headers, _CLOSE)
            return
        extra = _CHUNKED + _CLOSE if self._must_close() else _CHUNKED
        self._head = _head(status, headers, extra)

    async def write(self, data: bytes) -> None:
        """One piece of a started stream; waits while the client cannot take more."""
        if self.put(data):
            await self._connection.drain()

    def put(self, data: bytes) -> bool:
        """:meth:`write` without the wait: True when the client cannot take more now
        (then :meth:`drain` before the next piece)."""
        if not data or self._head_only:
            return False
        piece = data if self._unchunked else b"%x\r\n%b\r\n" % (len(data), data)
        if self._head:
            piece, self._head = self._head + piece, b""
        connection = self._connection
        connection.write(piece)
        return connection.paused

    async def drain(self) -> None:
        """Until the client can take more (or is gone)."""
        await self._connection.drain()

    def end(self, last: bytes = b"") -> None:
        """The end of a started stream, after ``last`` (written without waiting)."""
        if self._head_only:
            tail = b""
        elif self._unchunked:
            tail = last
        else:
            tail = b"%x\r\n%b\r\n" % (len(last), last) + _LAST_CHUNK if last else _LAST_CHUNK
        self._connection.write(self._head + tail)
        self._head = b""
        self.finished = True

    def _begin(self) -> None:
        if self.started:
            raise RuntimeError("the response was already started")
        self.started = True

    def _must_close(self) -> bool:
        self.closes = self.closes or self._connection.server.closing
        return self.closes


class _Clock:
    """Every answer's ``date`` header line (RFC 9110 asks an origin server for one; the
    engines' servers send one, which the proxy replaces with its own), formatted once a
    second."""

    def __init__(self) -> None:
        self.second = -1
        self.line = b""

    def date_line(self) -> bytes:
        now = int(time.time())
        if now != self.second:
            self.second = now
            self.line = b"date: %b\r\n" % formatdate(now, usegmt=True).encode()
        return self.line


_CLOCK = _Clock()


def _head(status: int, headers: list[tuple[bytes, bytes]], extra: bytes) -> bytes:
    line = _STATUS_LINES.get(status) or b"HTTP/1.1 %d Unknown\r\n" % status
    parts = [line, _CLOCK.date_line()]
    for name, value in headers:
        parts += (name, b": ", value, b"\r\n")
    parts += (extra, b"\r\n")
    return b"".join(parts)


def _error_bytes(exc: ApiError) -> bytes:
    body = exc.encode()
    headers = [(b"content-type", _JSON), *exc.headers]
    return _head(exc.status, headers, b"content-length: %d\r\n" % len(body) + _CLOSE) + body


class _Refused(Exception):
    """Raised inside a parser callback to stop reading a request that is refused."""


class _Connection(asyncio.Protocol):
    """One client connection: parses requests, runs one handler at a time."""

    def __init__(self, server: HttpServer) -> None:
        self.server = server
        self.parser = httptools.HttpRequestParser(self)
        self.transport: asyncio.Transport | None = None
        # the loop, asked once: asyncio.get_running_loop() makes a getpid() system call
        self.loop: asyncio.AbstractEventLoop | None = None
        self.task: asyncio.Task[None] | None = None
        self.waiting: deque[Request | ApiError] = deque()
        self.paused = False  # the client's socket buffer is full
        self.gone = False
        self._drained: asyncio.Future[None] | None = None
        self._reading = True
        self._broken = False  # a refused request: nothing more is parsed
        self._refusal: ApiError | None = None
        self._served = 0  # requests completed, for the idle check
        self._served_at_check = -1
        self._idle_timer: asyncio.TimerHandle | None = None
        self._in_head = False  # a request's head has begun and is not complete
        self._head_timer: asyncio.TimerHandle | None = None
        self._linger_timer: asyncio.TimerHandle | None = None
        self._client_done = False  # the client half-closed: answer what came, then close
        self._start_message()

    def _start_message(self) -> None:
        self._url = b""
        self._headers: dict[str, str] = {}
        self._head_bytes = 0
        self._body: list[bytes] = []
        self._body_bytes = 0

    # -- asyncio.Protocol ------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's is no subclass
        self.loop = asyncio.get_running_loop()
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        server = self.server
        if server.max_connections and len(server.connections) >= server.max_connections:
            self._refuse(server.over_capacity())
            return
        server.connections.add(self)
        self._check_idle()
        self._head_timer = self.loop.call_later(server.header_timeout_s, self._head_late)

    def connection_lost(self, exc: Exception | None) -> None:
        self.gone = True
        self.server.forget(self)
        if self._linger_timer is not None:
            self.server.lingering -= 1
        for timer in (self._idle_timer, self._head_timer, self._linger_timer):
            if timer is not None:
                timer.cancel()
        if self.task is not None:
            self.task.cancel()  # the handler stops; the upstream request is dropped
        if self._drained is not None and not self._drained.done():
            self._drained.set_result(None)

    def data_received(self, data: bytes) -> None:
        if self._broken:
            return
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade as upgrade:  # ignored, as RFC 9110 allows
            self.parser = httptools.HttpRequestParser(self)
            rest = data[upgrade.args[0] :]
            if rest:
                self.data_received(rest)
        except httptools.HttpParserError as exc:
            refusal = self._refusal or BadRequest(f"Malformed HTTP request: {exc}.")
            self._refuse(refusal)
            return
        if self._in_head and self._head_timer is None:  # a head split over reads
            assert self.loop is not None
            self._head_timer = self.loop.call_later(self.server.header_timeout_s, self._head_late)

    def eof_received(self) -> bool:
        """The client sends no more. Requests it pipelined are answered in order, then
        the connection closes; but an EOF while its only request runs is the client
        hanging up (as nginx and Go read it): the transport closes, so the handler is
        cancelled and the engine stops generating for nobody."""
        self._client_done = True
        if self.task is not None and not self.waiting:
            # abort, not close: a close waits to flush the unsent answer, which nobody
            # reads, and only then reports the connection lost (never, for a stream)
            assert self.transport is not None
            self.transport.abort()
            return False
        return not (self._broken or self.idle())  # False: the transport closes now

    def pause_writing(self) -> None:
        self.paused = True

    def resume_writing(self) -> None:
        self.paused = False
        if self._drained is not None and not self._drained.done():
            self._drained.set_result(None)

    # -- httptools callbacks -------------------------------------------------------------

    def on_message_begin(self) -> None:
        self._start_message()
        self._in_head = True

    def on_url(self, url: bytes) -> None:
        self._url += url
        self._head_bytes += len(url)
        if self._head_bytes > MAX_HEAD_BYTES:
            self._head_too_large()

    def on_header(self, name: bytes, value: bytes) -> None:
        self._head_bytes += len(name) + len(value)
        if self._head_bytes > MAX_HEAD_BYTES:
            self._head_too_large()
        key, text, headers = name.decode("latin-1").lower(), value.decode("latin-1"), self._headers
        if key in headers:
            text = self._repeated(key, headers[key], text)
        headers[key] = text

    def _repeated(self, name: str, before: str, value: str) -> str:
        """A header's second line: refused if the server or handler reads it as one
        value, else joined to the first (a cookie with "; ", RFC 9113's way)."""
        if name in self.server.single_headers:
            self._refusal = BadRequest(
                f"The request has more than one {name} header; send it once.", name,
                "repeated_header",
            )  # fmt: skip
            raise _Refused
        return f"{before}{'; ' if name == 'cookie' else ', '}{value}"

    def on_headers_complete(self) -> None:
        self._in_head = False
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None
        length = self._headers.get("content-length", "")
        limit = self.server.max_body_bytes
        if length.isdigit() and int(length) > limit:
            self._refusal = PayloadTooLarge(f"The request body is larger than {limit} bytes.")
            raise _Refused
        idle = self.task is None and not self.waiting
        if idle and self._headers.get("expect", "").lower() == "100-continue":
            self.write(_CONTINUE)

    def on_body(self, body: bytes) -> None:
        self._body_bytes += len(body)
        if self._body_bytes > self.server.max_body_bytes:
            limit = self.server.max_body_bytes
            self._refusal = PayloadTooLarge(f"The request body is larger than {limit} bytes.")
            raise _Refused
        self._body.append(body)

    def on_message_complete(self) -> None:
        body = self._body[0] if len(self._body) == 1 else b"".join(self._body)
        path, query = _split_url(self._url)
        method = self.parser.get_method().decode("ascii")
        version = self.parser.get_http_version()
        if version == "0.9":  # llhttp reads a request line without a version so
            self._refusal = BadRequest("HTTP/0.9 requests are not served; use HTTP/1.1.")
            raise _Refused
        request = Request(method, path, query, self._headers, body)
        request.keep_alive = self.parser.should_keep_alive()
        request.http_1_0 = version == "1.0"
        self._served += 1
        self._enqueue(request)

    def _head_too_large(self) -> None:
        self._refusal = HeadersTooLarge(
            f"The request line and headers are larger than {MAX_HEAD_BYTES} bytes."
        )
        raise _Refused

    # -- one request at a time -----------------------------------------------------------

    def _enqueue(self, item: Request | ApiError) -> None:
        self.waiting.append(item)
        if len(self.waiting) >= MAX_PIPELINED and self._reading and self.transport is not None:
            self._reading = False
            self.transport.pause_reading()
        if self.task is None:
            self._next()

    def _refuse(self, exc: ApiError) -> None:
        self._broken = True
        self._enqueue(exc)

    def _head_late(self) -> None:
        """The header deadline: a head begun and not complete gets 408; a connection
        that sent nothing at all is closed."""
        self._head_timer = None
        if self._broken or self.gone:
            return
        if self._in_head:
            limit = self.server.header_timeout_s
            self._refuse(RequestTimeout(f"The request's headers took over {limit:g} s to arrive."))
        elif self._served == 0 and self.idle():
            self.close()

    def _next(self) -> None:
        if self.gone:
            return
        if not self.waiting:
            if self._client_done:
                self.close()
            return
        item = self.waiting.popleft()
        resume = not (self._reading or self._broken or self._client_done)
        if resume and len(self.waiting) < MAX_PIPELINED:
            self._reading = True
            assert self.transport is not None
            self.transport.resume_reading()
        if isinstance(item, ApiError):  # a refused request: answer, then hang up
            self.write(_error_bytes(item))
            self._linger()
            return
        assert self.loop is not None  # requests come after connection_made
        self.task = self.loop.create_task(self._run(item))

    async def _run(self, request: Request) -> None:
        response = Response(self, request)
        try:
            await self.server.handler(request, response)
        except asyncio.CancelledError:
            pass  # the client went away, or the server stops: nothing more to send
        except Exception:
            log.exception("unexpected error", extra={"path": request.path})
            if not response.started:
                response.send(500, [(b"content-type", _JSON)], _INTERNAL)
        self.task = None
        if not response.finished or response.closes or self.server.closing:
            self.close()
        else:
            self._next()

    # -- writing -------------------------------------------------------------------------

    def write(self, data: bytes) -> None:
        if not self.gone and self.transport is not None:
            self.transport.write(data)

    async def drain(self) -> None:
        """Until the client's socket buffer has room again (or the connection is gone)."""
        while self.paused and not self.gone:
            self._drained = asyncio.get_running_loop().create_future()
            await self._drained

    def close(self) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.close()

    def _linger(self) -> None:
        """Close after a refusal without resetting a client still sending: write no
        more (FIN after the answer), read and drop what comes (``_broken``) until the
        client closes or ``LINGER_S``. Closing with its bytes unread would send a reset,
        which may destroy the answer before the client reads it."""
        transport, server = self.transport, self.server
        if (
            transport is None
            or transport.is_closing()
            or self._client_done
            or not transport.can_write_eof()
            or server.lingering >= MAX_LINGERING
        ):
            self.close()
            return
        transport.write_eof()
        server.lingering += 1
        if not self._reading:
            self._reading = True
            transport.resume_reading()
        assert self.loop is not None
        self._linger_timer = self.loop.call_later(LINGER_S, self.close)

    def idle(self) -> bool:
        return self.task is None and not self.waiting

    def _check_idle(self) -> None:
        """Close a connection that completed no request in ``keep_alive_s``."""
        if self.gone:
            return
        if self.idle() and self._served == self._served_at_check:
            self.close()
            return
        self._served_at_check = self._served
        loop = asyncio.get_running_loop()
        self._idle_timer = loop.call_later(self.server.keep_alive_s, self._check_idle)


_INTERNAL = ApiError("internal error in the proxy").encode()


def _split_url(url: bytes) -> tuple[str, str]:
    """Path and query of an origin-form (``/p?q``) or absolute-form target."""
    if not url.startswith(b"/"):
        parsed: Any = httptools.parse_url(url)  # Any: its stub says bytes, it may be None
        path: bytes = parsed.path or b"/"
        query: bytes = parsed.query or b""
        return path.decode("latin-1"), query.decode("latin-1")
    path, _, query = url.partition(b"?")
    return path.decode("latin-1"), query.decode("latin-1")


class HttpServer:
    """Serves ``handler`` on listening sockets until :meth:`aclose`."""

    def __init__(
        self,
        handler: Handler,
        *,
        max_body_bytes: int,
        keep_alive_s: float = 75.0,
        header_timeout_s: float = HEADER_TIMEOUT_S,
        max_connections: int = 0,
        single_headers: frozenset[str] = frozenset(),
    ) -> None:
        self.handler = handler
        self.max_body_bytes = max_body_bytes
        self.keep_alive_s = keep_alive_s
        self.header_timeout_s = header_timeout_s
        self.max_connections = max_connections
        # the server's own and the handler's (``single_headers``): one line each
        self.single_headers = SINGLE_HEADERS | single_headers
        self.connections: set[_Connection] = set()
        self.lingering = 0  # refused connections reading on before they close
        self.closing = False
        self._servers: list[asyncio.Server] = []
        self._all_gone: asyncio.Future[None] | None = None

    async def start(self, sock: socket.socket) -> None:
        """Accept connections on ``sock`` (bound and listening)."""
        loop = asyncio.get_running_loop()
        server = await loop.create_server(self.protocol, sock=sock, backlog=4096)
        self._servers.append(server)

    def protocol(self) -> asyncio.Protocol:
        """A new connection's protocol (what the listening socket makes per client)."""
        return _Connection(self)

    def over_capacity(self) -> ApiError:
        """What a connection beyond ``max_connections`` is told."""
        return ServiceUnavailable(
            f"The proxy is serving its limit of {self.max_connections} connections; retry "
            "shortly or on another proxy.",
            code="too_many_connections",
            headers=((b"retry-after", b"1"),),
        )

    def forget(self, connection: _Connection) -> None:
        self.connections.discard(connection)
        if not self.connections and self._all_gone is not None and not self._all_gone.done():
            self._all_gone.set_result(None)

    async def aclose(self, grace_s: float = 30.0) -> None:
        """Stop accepting; let requests in progress finish for up to ``grace_s``, then
        drop them; close keep-alive connections as they become idle."""
        self.closing = True
        for server in self._servers:
            server.close()
        for connection in list(self.connections):
            if connection.idle():
                connection.close()
        if self.connections:
            self._all_gone = asyncio.get_running_loop().create_future()
            try:
                await asyncio.wait_for(asyncio.shield(self._all_gone), grace_s)
            except TimeoutError:
                for connection in list(self.connections):
                    connection.close()
        for server in self._servers:
            await server.wait_closed()
        self._servers.clear()
