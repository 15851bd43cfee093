"""The proxy's HTTP client to the replicas: one aiohttp keep-alive pool per worker.

aiohttp's ``ClientSession`` was the fastest streaming client measured here (see
docs/architecture.md, "Proxy stack"). Bodies are passed through as bytes: no automatic
decompression, ``accept-encoding: identity`` upstream, nothing re-chunked.

:meth:`Upstream.open` sends one request and waits for its first body bytes (the whole
body for a non-streaming answer), so every failure before anything could reach the
client is a :class:`Retriable` the caller can retry elsewhere: a connection that fails or
breaks, or a 502/503. Errors::

    DataplaneError
    └── UpstreamError              a replica did not answer usefully
        └── Retriable              nothing reached the client yet: try another replica
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

import aiohttp

from dataplane.errors import DataplaneError

RETRY_STATUSES = frozenset({502, 503})
_NOT_RELAYED = frozenset(
    {
        b"connection", b"keep-alive", b"proxy-authenticate", b"proxy-authorization", b"te",
        b"trailer", b"transfer-encoding", b"upgrade", b"content-length", b"date", b"server",
        b"x-request-id",
    }
)  # fmt: skip


class UpstreamError(DataplaneError):
    """A replica failed to answer."""


class Retriable(UpstreamError):
    """A failure before any byte reached the client; ``reason`` labels the retry."""

    def __init__(self, message: str, reason: str) -> None:
        super().__init__(message)
        self.reason = reason


@dataclass(slots=True)
class Opened:
    """A replica's answer whose first bytes have arrived."""

    response: aiohttp.ClientResponse
    status: int
    headers: list[tuple[bytes, bytes]]
    first: bytes  # the whole body unless ``streaming``
    streaming: bool
    ttfb_s: float

    async def rest(self) -> AsyncIterator[bytes]:
        """The body after ``first``, chunk by chunk as it arrives."""
        if not self.streaming:
            return
        async for chunk in self.response.content.iter_any():
            yield chunk

    def close(self) -> None:
        """Drop the connection (a stream cut short: the engine sees the disconnect)."""
        self.response.close()

    def release(self) -> None:
        """Give a fully read connection back to the pool."""
        self.response.release()


class Upstream:
    """Keep-alive connections to every replica; ``start()`` before use."""

    def __init__(self, connect_timeout_s: float, read_timeout_s: float) -> None:
        self._timeout = aiohttp.ClientTimeout(
            total=None, sock_connect=connect_timeout_s, sock_read=read_timeout_s
        )
        self._session: aiohttp.ClientSession | None = None

    async def start(self) -> None:
        connector = aiohttp.TCPConnector(limit=0, ttl_dns_cache=300, keepalive_timeout=30)
        self._session = aiohttp.ClientSession(
            connector=connector,
            timeout=self._timeout,
            auto_decompress=False,
            skip_auto_headers=("User-Agent", "Content-Type"),
        )

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def open(
        self, method: str, url: str, body: bytes, headers: Sequence[tuple[str, str]]
    ) -> Opened:
        """Send; return once the first bytes arrived. Raises :class:`Retriable`."""
        assert self._session is not None, "Upstream.start() was not awaited"
        started = time.perf_counter()
        try:
            response = await self._session.request(
                method, url, data=body or None, headers=headers, allow_redirects=False
            )
        except (aiohttp.ClientConnectionError, TimeoutError) as exc:
            raise Retriable(f"cannot reach {url}: {_describe(exc)}", _reason(exc)) from exc
        try:
            return await self._first_bytes(response, started)
        except BaseException:
            response.close()
            raise

    async def _first_bytes(self, response: aiohttp.ClientResponse, started: float) -> Opened:
        if response.status in RETRY_STATUSES:
            raise Retriable(f"replica answered {response.status}", f"status_{response.status}")
        streaming = response.content_type == "text/event-stream"
        try:
            first = await (response.content.readany() if streaming else response.read())
        except (aiohttp.ClientPayloadError, aiohttp.ClientConnectionError, TimeoutError) as exc:
            raise Retriable(f"replica broke off: {_describe(exc)}", "disconnect") from exc
        if streaming and not first:
            raise Retriable("replica ended the stream before any event", "disconnect")
        headers = [(k.lower(), v) for k, v in response.raw_headers if k.lower() not in _NOT_RELAYED]
        ttfb = time.perf_counter() - started
        return Opened(response, response.status, headers, first, streaming, ttfb)


def _reason(exc: BaseException) -> str:
    if isinstance(exc, aiohttp.ServerDisconnectedError | aiohttp.ClientOSError) and not (
        isinstance(exc, aiohttp.ClientConnectorError)
    ):
        return "disconnect"
    return "connect"


def _describe(exc: BaseException) -> str:
    if isinstance(exc, TimeoutError | asyncio.TimeoutError):
        return "timed out"
    return str(exc) or type(exc).__name__
