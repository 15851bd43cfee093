"""The seam between the proxy and its transport: what the app and the upstream code use.

The server side: a :data:`Handler` gets a :class:`ServerRequest` (its body read whole,
headers by lower-case name) and answers through a :class:`ServerResponse` (a whole body
with ``send``, or ``start``, ``write``/``put`` pieces, ``end``); a :class:`Server` serves
a handler on listening sockets. The client side: an :class:`UpstreamPool` ``send``s a
request and hands back a :class:`Sending`, whose ``response`` is an
:class:`UpstreamResponse` read piece by piece; its failures are
``transport.client``'s ``ConnectionFailed`` (before any response byte),
``ResponseBroken`` (mid-response) and ``TimeoutError``.

The proxy's compiled modules name the concrete classes (``server.Request``,
``client.ConnectionPool``): mypyc reads their attributes directly, where a protocol
would cost a lookup per access. These protocols are what those classes promise, what
an alternative must provide, and what tests/unit/dataplane/transport/ checks both
against.
"""

from __future__ import annotations

import socket
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Protocol

Headers = list[tuple[bytes, bytes]]  # lower-case names, in order, repeats kept


class ServerRequest(Protocol):
    method: str
    path: str  # as sent, percent escapes kept
    query: str
    headers: dict[str, str]  # by lower-case name; a repeated header's values joined ", "
    body: bytes
    keep_alive: bool
    http_1_0: bool


class ServerResponse(Protocol):
    started: bool
    finished: bool
    closes: bool  # the connection closes after this response

    def send(self, status: int, headers: Headers, body: bytes) -> None: ...
    def start(self, status: int, headers: Headers) -> None: ...
    async def write(self, data: bytes) -> None: ...
    def put(self, data: bytes) -> bool: ...  # False: the client's buffer is full, drain
    async def drain(self) -> None: ...
    def end(self, last: bytes = b"") -> None: ...


Handler = Callable[[ServerRequest, ServerResponse], Awaitable[None]]


class Server(Protocol):
    async def start(self, sock: socket.socket) -> None: ...
    async def aclose(self, grace_s: float = 30.0) -> None: ...


class UpstreamResponse(Protocol):
    status: int
    headers: Headers

    def header(self, name: bytes) -> bytes | None: ...
    async def read_chunk(self) -> bytes: ...  # b"" once the body ended
    def read_now(self) -> bytes | None: ...  # the rest if all arrived, else None
    async def read(self) -> bytes: ...
    def release(self) -> None: ...  # read to its end: the connection may be reused
    def close(self) -> None: ...  # drop the connection: the replica sees a cancel


class Sending(Protocol):
    async def response(self) -> UpstreamResponse: ...
    def close(self) -> None: ...


class UpstreamPool(Protocol):
    def send(
        self, method: str, url: str, body: bytes, headers: Sequence[tuple[str, str]]
    ) -> Sending: ...
    async def request(
        self, method: str, url: str, body: bytes, headers: Sequence[tuple[str, str]]
    ) -> UpstreamResponse: ...
    def close(self) -> None: ...


if TYPE_CHECKING:  # the own transport keeps these promises: mypy checks it here
    from dataplane.transport import client, server

    _request: type[ServerRequest] = server.Request
    _response: type[ServerResponse] = server.Response
    _server: type[Server] = server.HttpServer
    _answer: type[UpstreamResponse] = client.Response
    _sending: type[Sending] = client.Sending
    _pool: type[UpstreamPool] = client.ConnectionPool
