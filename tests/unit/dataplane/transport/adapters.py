"""The alternatives behind the transport seam: uvicorn serving a handler, aiohttp as a pool.

Test-only (the proxy never imports them): each is the smallest honest wrapper that
gives :mod:`dataplane.transport.interface`'s shape, so the conformance suite shows what
swapping the own server or client for these would change. They add nothing the
library lacks (no body cap, no header checks): where the own transport is stricter by
design, the suite marks the difference.
"""

from __future__ import annotations

import socket
from collections.abc import Sequence
from typing import Any

import aiohttp
import uvicorn

from dataplane.transport.client import ConnectionFailed, ResponseBroken
from dataplane.transport.interface import Handler, Headers

Scope = dict[str, Any]


class AsgiRequest:
    """A request as the handler sees it, from an ASGI scope and its whole body."""

    def __init__(self, scope: Scope, body: bytes) -> None:
        self.method: str = scope["method"]
        self.path: str = scope["raw_path"].decode("latin-1").partition("?")[0]
        self.query: str = scope["query_string"].decode("latin-1")
        joined: dict[str, str] = {}
        for name, value in scope["headers"]:
            key, text = name.decode("latin-1"), value.decode("latin-1")
            joined[key] = f"{joined[key]}, {text}" if key in joined else text
        self.headers = joined
        self.body = body
        self.http_1_0 = scope["http_version"] == "1.0"
        self.keep_alive = "close" not in joined.get("connection", "").lower()


class AsgiResponse:
    """The handler's answer as ASGI messages: queued by the synchronous calls, sent by
    the next await (or when the handler returns)."""

    def __init__(self, send: Any, request: AsgiRequest) -> None:
        self._send = send
        self._queued: list[dict[str, Any]] = []
        self.closes = not request.keep_alive
        self.started = False
        self.finished = False

    def send(self, status: int, headers: Headers, body: bytes) -> None:
        self.start(status, [*headers, (b"content-length", b"%d" % len(body))])
        self.end(body)

    def start(self, status: int, headers: Headers) -> None:
        self.started = True
        self._queued.append({"type": "http.response.start", "status": status, "headers": headers})

    async def write(self, data: bytes) -> None:
        self.put(data)
        await self.drain()

    def put(self, data: bytes) -> bool:
        self._queued.append({"type": "http.response.body", "body": data, "more_body": True})
        return True

    async def drain(self) -> None:
        queued, self._queued = self._queued, []
        for message in queued:
            await self._send(message)

    def end(self, last: bytes = b"") -> None:
        self.finished = True
        self._queued.append({"type": "http.response.body", "body": last, "more_body": False})


class UvicornServer:
    """A handler served by uvicorn (its httptools protocol) through a small ASGI app."""

    def __init__(self, handler: Handler, *, max_body_bytes: int, keep_alive_s: float = 75.0):
        self.handler = handler
        self.max_body_bytes = max_body_bytes  # not enforced: uvicorn has no such cap
        config = uvicorn.Config(
            self._app,
            lifespan="off",
            http="httptools",
            interface="asgi3",
            log_level="critical",
            access_log=False,
            timeout_keep_alive=max(1, int(keep_alive_s)),
        )
        config.load()
        self._server = uvicorn.Server(config)
        self._server.lifespan = config.lifespan_class(config)
        self._sockets: list[socket.socket] = []

    async def start(self, sock: socket.socket) -> None:
        self._sockets.append(sock)
        await self._server.startup(sockets=[sock])

    async def aclose(self, grace_s: float = 30.0) -> None:
        self._server.config.timeout_graceful_shutdown = int(grace_s) or None
        await self._server.shutdown(sockets=self._sockets)

    async def _app(self, scope: Scope, receive: Any, send: Any) -> None:
        parts = []
        while True:
            message = await receive()
            parts.append(message.get("body", b""))
            if not message.get("more_body"):
                break
        request = AsgiRequest(scope, b"".join(parts))
        response = AsgiResponse(send, request)
        await self.handler(request, response)
        await response.drain()


class AiohttpResponse:
    def __init__(self, response: aiohttp.ClientResponse) -> None:
        self._response = response
        self.status = response.status
        self.headers = [(name.lower(), value) for name, value in response.raw_headers]

    def header(self, name: bytes) -> bytes | None:
        return next((value for key, value in self.headers if key == name), None)

    async def read_chunk(self) -> bytes:
        try:
            return await self._response.content.readany()
        except aiohttp.ClientPayloadError as exc:
            raise ResponseBroken(str(exc)) from exc

    def read_now(self) -> bytes | None:
        return None  # always allowed: the caller then awaits read()

    async def read(self) -> bytes:
        parts = []
        while chunk := await self.read_chunk():
            parts.append(chunk)
        return b"".join(parts)

    def release(self) -> None:
        self._response.release()

    def close(self) -> None:
        self._response.close()


class AiohttpSending:
    def __init__(self, session: aiohttp.ClientSession, request: tuple[Any, ...]) -> None:
        self._session = session
        self._request = request
        self._response: aiohttp.ClientResponse | None = None

    async def response(self) -> AiohttpResponse:
        method, url, body, headers = self._request
        try:
            self._response = await self._session.request(
                method, url, data=body, headers=list(headers), skip_auto_headers=("User-Agent",)
            )
        except aiohttp.ServerTimeoutError as exc:
            raise TimeoutError(str(exc)) from exc
        except (aiohttp.ClientConnectionError, aiohttp.ClientOSError) as exc:
            raise ConnectionFailed(str(exc)) from exc
        return AiohttpResponse(self._response)

    def close(self) -> None:
        if self._response is not None:
            self._response.close()


class AiohttpPool:
    """An ``aiohttp.ClientSession`` as the upstream pool; :meth:`aclose` after use."""

    def __init__(self, connect_timeout_s: float, read_timeout_s: float) -> None:
        timeout = aiohttp.ClientTimeout(sock_connect=connect_timeout_s, sock_read=read_timeout_s)
        self._session = aiohttp.ClientSession(timeout=timeout, auto_decompress=False)

    def send(
        self, method: str, url: str, body: bytes, headers: Sequence[tuple[str, str]]
    ) -> AiohttpSending:
        return AiohttpSending(self._session, (method, url, body, headers))

    async def request(
        self, method: str, url: str, body: bytes, headers: Sequence[tuple[str, str]]
    ) -> AiohttpResponse:
        return await self.send(method, url, body, headers).response()

    def close(self) -> None:
        """Nothing to do at once: the session's connections close in :meth:`aclose`."""

    async def aclose(self) -> None:
        await self._session.close()
