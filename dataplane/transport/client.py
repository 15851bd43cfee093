"""A lean HTTP/1.1 client for the replicas: asyncio protocol + httptools' parser.

Measured side by side (``python -m bench.proxy --floors``, docs/architecture.md), a bare
pass-through proxy adds about half the latency with this kind of client as with aiohttp's
``ClientSession``, whose per-request machinery (request and response objects, tracing
hooks, cookie jar, timers) costs more than the proxy's routing. The proxy needs little
of it: keep-alive connections per replica, one request at a time per connection, bodies
as bytes, and a response read as its parts arrive (status and headers, then each body
piece, de-chunked by httptools).

An ``https://`` URL is spoken to over TLS (port 443 unless given), its certificate
checked against the pool's ``ssl_context`` (the system's trust store unless given).
Connections are reused last-in first-out; one the replica closed while idle is dropped.
A request on a reused connection that breaks before any response byte is sent again once
on a new connection (the replica may have closed it just as it was reused). Errors::

    ConnectionFailed (OSError)     could not connect, or the connection broke before the
                                   response's first byte
    ResponseBroken (OSError)       the connection broke or the parser failed mid-response
    TimeoutError                   connect or read deadline passed

A read deadline bounds each wait for a replica's next bytes. The waits of a pool share one
loop timer (:class:`ReadDeadlines`) rather than arming and cancelling one each: with one
timeout, deadlines fall in the order the waits began, so the timer only ever needs the
oldest wait still pending.
"""

from __future__ import annotations

import asyncio
import ssl
from collections import deque
from collections.abc import Sequence
from urllib.parse import urlsplit

import httptools
from mypy_extensions import mypyc_attr

MAX_TARGETS = 4096  # URLs whose parsed form is remembered


@mypyc_attr(native_class=False)  # compiled (dataplane/native.py): a plain exception class
class ConnectionFailed(OSError):
    """Nothing of a response arrived: connecting failed or the connection broke first."""


@mypyc_attr(native_class=False)
class ResponseBroken(OSError):
    """The response started but did not end properly."""


class _Connection(asyncio.Protocol):
    """One keep-alive connection; the response being read is kept in its fields."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.closed = False
        self.peer: tuple[str, int] = ("", 0)
        self.error: Exception | None = None
        self._waiter: asyncio.Future[None] | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self.reset()

    def reset(self) -> None:
        self.started = False  # any byte of the response arrived
        self.headers: list[tuple[bytes, bytes]] = []
        self.headers_done = False
        self.keep_alive = False
        self.body: deque[bytes] = deque()
        self.complete = False

    # -- asyncio.Protocol ------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's is no subclass
        self.loop = asyncio.get_running_loop()  # asked once: it makes a getpid() call

    def data_received(self, data: bytes) -> None:
        self.started = True
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self.error = ResponseBroken(f"malformed response: {exc}")
            self.close()
        self._wake()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if not self.complete and self.error is None:
            kind = ResponseBroken if self.started else ConnectionFailed
            self.error = kind(f"connection closed by the replica{f': {exc}' if exc else ''}")
        self._wake()

    # -- httptools callbacks -----------------------------------------------------------

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name.lower(), value))

    def on_headers_complete(self) -> None:
        self.headers_done = True
        self.keep_alive = self.parser.should_keep_alive()  # the parser forgets it at the end

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        self.complete = True

    # -- waiting -------------------------------------------------------------------------

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def wait(self, deadlines: ReadDeadlines) -> None:
        """Until something new arrives (or the connection fails, or the deadline passes);
        raises its error."""
        if self.error is not None:
            raise self.error
        waiter = self._waiter = deadlines.waiter(self.loop)
        try:
            await waiter
        finally:
            self._waiter = None
            deadlines.pending -= 1
        error = self._error()  # not `self.error`: compiled, its narrowing above would hold
        if error is not None:
            raise error

    def _error(self) -> Exception | None:
        return self.error

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()


class ReadDeadlines:
    """Read deadlines of ``timeout_s`` on one loop timer, armed for the oldest wait still
    pending. Waits that ended are dropped when the timer reaches them, or all at once when
    they outnumber the pending ones (so a long wait at the front keeps no pile behind it)."""

    __slots__ = ("_loop", "_timer", "_waits", "pending", "timeout_s")

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self.pending = 0  # waits begun and not yet ended (each ``wait`` ends its own)
        self._waits: deque[tuple[float, asyncio.Future[None]]] = deque()
        self._timer: asyncio.TimerHandle | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def waiter(self, loop: asyncio.AbstractEventLoop | None = None) -> asyncio.Future[None]:
        """A future of ``loop`` (the running one) that fails with :class:`TimeoutError`
        once ``timeout_s`` has passed unless it was set first; the caller decrements
        :attr:`pending` when done with it."""
        loop = loop or asyncio.get_running_loop()
        if loop is not self._loop:  # first use, or a new loop: the old one's timer is gone
            self._loop, self._timer, self._waits, self.pending = loop, None, deque(), 0
        waiter = loop.create_future()
        waits = self._waits
        deadline = loop.time() + self.timeout_s
        waits.append((deadline, waiter))
        self.pending += 1
        if self._timer is None:
            self._timer = loop.call_at(deadline, self._expire)
        elif len(waits) > 64 and len(waits) > 4 * self.pending:
            self._waits = deque(wait for wait in waits if not wait[1].done())
        return waiter

    def __len__(self) -> int:
        """Waits remembered: the pending ones and those ended but not yet dropped."""
        return len(self._waits)

    def _expire(self) -> None:
        assert self._loop is not None
        now = self._loop.time()
        waits = self._waits
        while waits:
            deadline, waiter = waits[0]
            if not waiter.done():
                if deadline > now:
                    self._timer = self._loop.call_at(deadline, self._expire)
                    return
                waiter.set_exception(TimeoutError("the replica did not answer in time"))
            waits.popleft()
        self._timer = None


class Response:
    """A response being read; give it back with :meth:`release` or :meth:`close`."""

    def __init__(self, pool: ConnectionPool, connection: _Connection) -> None:
        self._pool = pool
        self._connection = connection
        self.status = connection.parser.get_status_code()
        self.headers = connection.headers

    def header(self, name: bytes) -> bytes | None:
        for key, value in self.headers:
            if key == name:
                return value
        return None

    async def read_chunk(self) -> bytes:
        """The next body piece as it arrives; ``b""`` once the body ended."""
        connection = self._connection
        while not connection.body:
            if connection.complete:
                return b""
            if connection.closed and connection.error is None:
                return b""
            await connection.wait(self._pool.deadlines)
        return connection.body.popleft()

    def read_now(self) -> bytes | None:
        """The whole (rest of the) body if it has all arrived (a short answer usually
        comes with its head), else ``None``: then :meth:`read` it."""
        connection = self._connection
        if not connection.complete:
            return None
        body = connection.body
        if len(body) <= 1:
            return body.popleft() if body else b""
        whole = b"".join(body)
        body.clear()
        return whole

    async def read(self) -> bytes:
        """The whole (rest of the) body."""
        parts = []
        while chunk := await self.read_chunk():
            parts.append(chunk)
        return parts[0] if len(parts) == 1 else b"".join(parts)

    def release(self) -> None:
        """Back to the pool if the response was read to its end, else closed."""
        connection = self._connection
        if connection.complete and not connection.closed and connection.keep_alive:
            connection.reset()
            self._pool.put(connection)
        else:
            connection.close()

    def close(self) -> None:
        """Drop the connection (the replica sees the request cancelled)."""
        self._connection.close()


@mypyc_attr(allow_interpreted_subclasses=True)  # in-memory replicas build on it
class ConnectionPool:
    """Keep-alive connections to every replica, by ``host:port``."""

    def __init__(
        self,
        connect_timeout_s: float,
        read_timeout_s: float,
        max_idle: int = 64,
        ssl_context: ssl.SSLContext | None = None,
    ):
        self.connect_timeout_s = connect_timeout_s
        self.deadlines = ReadDeadlines(read_timeout_s)  # every wait's read deadline
        self.max_idle = max_idle
        self.ssl_context = ssl_context  # for https:// peers (None: the system's trust)
        self._idle: dict[tuple[str, int], list[_Connection]] = {}
        self._targets: dict[str, tuple[tuple[str, int], str]] = {}
        self._tls_peers: set[tuple[str, int]] = set()  # peers named by https:// URLs

    def put(self, connection: _Connection) -> None:
        idle = self._idle.setdefault(connection.peer, [])
        if len(idle) < self.max_idle:
            idle.append(connection)
        else:
            connection.close()

    def close(self) -> None:
        for idle in self._idle.values():
            for connection in idle:
                connection.close()
        self._idle.clear()

    def send(
        self, method: str, url: str, body: bytes, headers: Sequence[tuple[str, str]]
    ) -> Sending:
        """Write the request at once on an idle kept-alive connection to the URL's peer
        (with none idle, :meth:`Sending.response` connects first, then writes)."""
        target = self._targets.get(url)
        if target is None:
            target = self._target(url)
        peer, request_line = target
        head = _head(method, request_line, body, headers)
        connection = self._reusable(peer)
        if connection is not None:
            _write(connection, head, body)
        return Sending(self, peer, head, body, connection)

    async def request(
        self, method: str, url: str, body: bytes, headers: Sequence[tuple[str, str]]
    ) -> Response:
        """Send and wait for the status and headers; see the module's errors."""
        return await self.send(method, url, body, headers).response()

    def _target(self, url: str) -> tuple[tuple[str, int], str]:
        """``url``'s peer and the request line's target with the host header (remembered:
        the proxy sends to few distinct URLs)."""
        parts = urlsplit(url)
        path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        tls = parts.scheme == "https"
        peer = (parts.hostname or "", parts.port or (443 if tls else 80))
        if tls:
            self._tls_peers.add(peer)
        target = (peer, f" {path} HTTP/1.1\r\nhost: {parts.netloc}\r\n")
        if len(self._targets) >= MAX_TARGETS:
            self._targets.clear()
        self._targets[url] = target
        return target

    def _reusable(self, peer: tuple[str, int]) -> _Connection | None:
        idle = self._idle.get(peer)
        while idle:
            connection = idle.pop()
            if not connection.closed:
                return connection
        return None

    async def _connect(self, host: str, port: int) -> _Connection:
        loop = asyncio.get_running_loop()
        tls: ssl.SSLContext | None = None
        if (host, port) in self._tls_peers:
            if self.ssl_context is None:
                self.ssl_context = ssl.create_default_context()
            tls = self.ssl_context
        try:
            async with asyncio.timeout(self.connect_timeout_s):
                _, connection = await loop.create_connection(
                    _Connection, host, port, ssl=tls, server_hostname=host if tls else None
                )
        except TimeoutError:
            raise ConnectionFailed(f"connecting to {host}:{port} timed out") from None
        except OSError as exc:
            raise ConnectionFailed(
                f"cannot connect to {host}:{port}: {exc.strerror or exc}"
            ) from None
        connection.peer = (host, port)
        return connection

    async def _response_head(self, connection: _Connection) -> Response:
        """Wait for the status and headers of the request written on ``connection``."""
        try:
            while not connection.headers_done:
                await connection.wait(self.deadlines)
        except BaseException:
            connection.close()
            raise
        return Response(self, connection)


class Sending:
    """A request written (or to be written once connected); await :meth:`response`, or
    :meth:`close` it."""

    __slots__ = ("_body", "_connection", "_head", "_peer", "_pool")

    def __init__(
        self,
        pool: ConnectionPool,
        peer: tuple[str, int],
        head: bytes,
        body: bytes,
        connection: _Connection | None,
    ) -> None:
        self._pool = pool
        self._peer = peer
        self._head = head
        self._body = body
        self._connection = connection  # the kept-alive connection it was written on

    async def response(self) -> Response:
        """The status and headers; see the module's errors. A kept-alive connection that
        breaks before any response byte is replaced once, unseen."""
        pool = self._pool
        connection = self._connection
        if connection is not None:
            try:
                while not connection.headers_done:
                    await connection.wait(pool.deadlines)
                return Response(pool, connection)
            except ConnectionFailed:
                connection.close()  # broke before any response byte: once more, anew
            except BaseException:
                connection.close()
                raise
        connection = self._connection = await pool._connect(*self._peer)
        _write(connection, self._head, self._body)
        return await pool._response_head(connection)

    def close(self) -> None:
        """Drop the connection the request was written on (its response is not wanted)."""
        if self._connection is not None:
            self._connection.close()


def _write(connection: _Connection, head: bytes, body: bytes) -> None:
    assert connection.transport is not None
    if len(body) < 65536:
        connection.transport.write(head + body)
    else:
        connection.transport.write(head)
        connection.transport.write(body)


def _head(method: str, target: str, body: bytes, headers: Sequence[tuple[str, str]]) -> bytes:
    lines = [method, target]
    if body or method in ("POST", "PUT", "PATCH"):
        lines.append(f"content-length: {len(body)}\r\n")
    for name, value in headers:
        lines += (name, ": ", value, "\r\n")
    lines.append("\r\n")
    return "".join(lines).encode("latin-1")
