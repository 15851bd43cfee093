"""Requests to the replicas, read up to their first body bytes so failures can be retried.

The connections are ``transport.client.ConnectionPool``'s (chosen by measurement over aiohttp,
see docs/architecture.md, "Proxy stack"). Bodies are passed through as bytes: nothing
decompressed (``accept-encoding: identity`` upstream), nothing re-chunked.

:meth:`Upstream.open` sends one request and waits for its first body bytes (the whole
body for a non-streaming answer), so every failure before anything could reach the
client is a :class:`Retriable` the caller can retry elsewhere: a connection that fails or
breaks, or a 502/503. :meth:`Upstream.send` is its first half: the request is written at
once on a kept-alive connection, and the caller does what need not delay that write
before it awaits :meth:`Pending.opened`. Errors::

    DataplaneError
    └── UpstreamError              a replica did not answer usefully
        └── Retriable              nothing reached the client yet: try another replica
"""

from __future__ import annotations

import ssl
import time
from collections.abc import Sequence
from dataclasses import dataclass
from urllib.parse import urlsplit

from mypy_extensions import mypyc_attr

from dataplane.errors import DataplaneError
from dataplane.transport.client import (
    ConnectionFailed,
    ConnectionPool,
    Response,
    ResponseBroken,
    Sending,
)

RETRY_STATUSES = frozenset({502, 503})
_NOT_RELAYED = frozenset(
    {
        b"connection", b"keep-alive", b"proxy-authenticate", b"proxy-authorization", b"te",
        b"trailer", b"transfer-encoding", b"upgrade", b"content-length", b"date", b"server",
        b"x-request-id",
        # the engines' own CORS answer (vLLM's allows any origin): the proxy's is the one
        b"access-control-allow-origin", b"access-control-allow-credentials",
        b"access-control-allow-methods", b"access-control-allow-headers",
        b"access-control-expose-headers", b"access-control-max-age",
        b"access-control-allow-private-network",
    }
)  # fmt: skip


@mypyc_attr(native_class=False)  # compiled, a plain class: see dataplane/native.py
class UpstreamError(DataplaneError):
    """A replica failed to answer."""


@mypyc_attr(native_class=False)
class Retriable(UpstreamError):
    """A failure before any byte reached the client; ``reason`` labels the retry."""

    def __init__(self, message: str, reason: str) -> None:
        super().__init__(message)
        self.reason = reason


@dataclass(slots=True)
class Opened:
    """A replica's answer whose first bytes have arrived."""

    response: Response
    status: int
    headers: list[tuple[bytes, bytes]]
    first: bytes  # the whole body unless ``streaming``
    streaming: bool
    ttfb_s: float

    def __init__(  # written out: one per request (see dataplane/native.py)
        self,
        response: Response,
        status: int,
        headers: list[tuple[bytes, bytes]],
        first: bytes,
        streaming: bool,
        ttfb_s: float,
    ) -> None:
        self.response = response
        self.status = status
        self.headers = headers
        self.first = first
        self.streaming = streaming
        self.ttfb_s = ttfb_s

    async def next_chunk(self) -> bytes:
        """The body after ``first``, chunk by chunk as it arrives; ``b""`` at its end
        (at once unless ``streaming``). A method, not an async generator: mypyc compiles
        none."""
        if not self.streaming:
            return b""
        return await self.response.read_chunk()

    def close(self) -> None:
        """Drop the connection (a stream cut short: the engine sees the disconnect)."""
        self.response.close()

    def release(self) -> None:
        """Give a fully read connection back to the pool."""
        self.response.release()


class Upstream:
    """Keep-alive connections to every replica (``transport.client.ConnectionPool``)."""

    def __init__(
        self,
        connect_timeout_s: float,
        read_timeout_s: float,
        ssl_context: ssl.SSLContext | None = None,
    ) -> None:
        self.pool = ConnectionPool(connect_timeout_s, read_timeout_s, ssl_context=ssl_context)

    async def start(self) -> None:
        """Nothing to open ahead: connections are made on first use."""

    async def aclose(self) -> None:
        self.pool.close()

    def send(
        self, method: str, url: str, body: bytes, headers: Sequence[tuple[str, str]]
    ) -> Pending:
        """Send: written at once on a kept-alive connection (else once connected); await
        :meth:`Pending.opened` for the answer."""
        started = time.perf_counter()
        return Pending(self.pool.send(method, url, body, headers), url, started)

    async def open(
        self, method: str, url: str, body: bytes, headers: Sequence[tuple[str, str]]
    ) -> Opened:
        """Send; return once the first bytes arrived. Raises :class:`Retriable`."""
        return await self.send(method, url, body, headers).opened()


class Pending:
    """A request sent to a replica, its answer not yet read."""

    __slots__ = ("_sending", "_started", "_url")

    def __init__(self, sending: Sending, url: str, started: float) -> None:
        self._sending = sending
        self._url = url
        self._started = started

    async def opened(self) -> Opened:
        """Once the answer's first bytes arrived. Raises :class:`Retriable`."""
        try:
            response = await self._sending.response()
        except (ConnectionFailed, ResponseBroken, TimeoutError) as exc:
            raise Retriable(f"cannot reach {self._url}: {_describe(exc)}", _reason(exc)) from exc
        try:
            return await _first_bytes(response, self._started, self._url)
        except BaseException:
            response.close()
            raise

    def close(self) -> None:
        """Drop the request (its answer is not wanted)."""
        self._sending.close()


async def _first_bytes(response: Response, started: float, url: str) -> Opened:
    if response.status in RETRY_STATUSES:
        raise Retriable(f"replica answered {response.status}", f"status_{response.status}")
    content_type = response.header(b"content-type") or b""
    streaming = content_type.startswith(b"text/event-stream")
    try:
        first = None if streaming else response.read_now()
        if first is None:
            first = await (response.read_chunk() if streaming else response.read())
    except (ConnectionFailed, ResponseBroken, TimeoutError) as exc:
        raise Retriable(f"replica broke off: {_describe(exc)}", _reason(exc)) from exc
    if streaming and not first:
        raise Retriable("replica ended the stream before any event", "disconnect")
    headers = [(k, v) for k, v in response.headers if k not in _NOT_RELAYED]
    if response.header(b"location") is not None:
        headers = _off_the_replica(headers, url)
    ttfb = time.perf_counter() - started
    return Opened(response, response.status, headers, first, streaming, ttfb)


def _off_the_replica(headers: list[tuple[bytes, bytes]], url: str) -> list[tuple[bytes, bytes]]:
    """``headers`` with a ``Location`` on the replica itself made a path, which the client
    resolves against the proxy's address. (vLLM's FastAPI redirects a path with a
    trailing slash too many or too few to the route's own, built from the ``Host`` the
    proxy sent: the replica's address, which the client must never be sent to.)"""
    parts = urlsplit(url)
    origin = f"{parts.scheme}://{parts.netloc}".encode("latin-1")
    relayed = []
    for name, value in headers:
        if name == b"location" and value.startswith(origin):
            rest = value[len(origin) :]
            if not rest or rest[:1] in (b"/", b"?"):
                value = rest if rest[:1] == b"/" else b"/" + rest
        relayed.append((name, value))
    return relayed


def _reason(exc: BaseException) -> str:
    """A retry's reason label for a failure before the first bytes."""
    if isinstance(exc, TimeoutError):
        return "timeout"
    return "connect" if isinstance(exc, ConnectionFailed) else "disconnect"


def _describe(exc: BaseException) -> str:
    if isinstance(exc, TimeoutError):
        return "timed out"
    return str(exc) or type(exc).__name__
