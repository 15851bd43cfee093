"""The floor of a Python proxy on this stack: pass each request through, no routing at all.

``python -m bench.passthrough UPSTREAM_URL PORT CLIENT [SERVER]`` serves, with
``SERVER`` ``uvicorn`` (the default), a raw ASGI app on uvicorn + uvloop + httptools
that forwards every request body to ``UPSTREAM_URL`` with ``CLIENT`` (``aiohttp``: a
keep-alive ``ClientSession``; ``raw``: one keep-alive HTTP/1.1 connection per concurrent
request over asyncio streams, Content-Length bodies only) and answers with the
upstream's body; with ``SERVER`` ``own``, kvroute-proxy's own stack does the same
(``dataplane.transport.server`` on uvloop, ``dataplane.transport.client``; ``CLIENT`` is ignored);
with ``SERVER`` ``relay``, a thread per client connection copies bytes both ways between
it and its own upstream connection, blocked in ``poll`` (no HTTP, no event loop: what one
more hop on loopback costs any proxy on this machine). ``bench.proxy`` starts it to
measure how much of the proxy's added latency is the hop, the server and client stack,
and kvroute's own work, and to compare client libraries side by side. Not a product: no
streaming, no errors.
"""

from __future__ import annotations

import asyncio
import select
import socket
import sys
import threading
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
import uvicorn
import uvloop

from bench.enginesim_capacity import _read_response, _request
from dataplane.transport.client import ConnectionPool
from dataplane.transport.server import HttpServer, Request, Response

Send = Callable[[dict[str, Any]], Awaitable[None]]
Receive = Callable[[], Awaitable[dict[str, Any]]]


class RawPool:
    """Idle keep-alive connections to one host, reused last-in first-out."""

    def __init__(self, url: str) -> None:
        self.host, port = url.removeprefix("http://").rsplit(":", 1)
        self.port = int(port)
        self.idle: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []

    async def post(self, path: str, body: bytes) -> tuple[int, bytes]:
        reader, writer = self.idle.pop() if self.idle else await self._connect()
        writer.write(_request(self.host, path, body))
        status, answer = await _read_response(reader)
        self.idle.append((reader, writer))
        return status, answer

    async def _connect(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        reader, writer = await asyncio.open_connection(self.host, self.port)
        writer.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return reader, writer


def make_app(upstream: str, client: str) -> Callable[[dict[str, Any], Receive, Send], Any]:
    state: dict[str, Any] = {}

    async def forward(path: str, body: bytes) -> tuple[int, bytes]:
        if client == "raw":
            pool: RawPool = state.setdefault("pool", RawPool(upstream))
            return await pool.post(path, body)
        session = state.get("session")
        if session is None:
            session = state["session"] = aiohttp.ClientSession(auto_decompress=False)
        async with session.post(
            upstream + path, data=body, headers={"content-type": "application/json"}
        ) as response:
            return response.status, await response.read()

    async def app(scope: dict[str, Any], receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        status, answer = await forward(scope["path"], body)
        headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(answer))]
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": answer})

    return app


def make_handler(upstream: str) -> Callable[[Request, Response], Awaitable[None]]:
    """kvroute-proxy's own server and client with nothing between them."""
    pool = ConnectionPool(connect_timeout_s=2, read_timeout_s=60)
    headers = [("content-type", "application/json")]

    async def handler(request: Request, response: Response) -> None:
        answer = await pool.request("POST", upstream + request.path, request.body, headers)
        body = await answer.read()
        answer.release()
        response.send(answer.status, [(b"content-type", b"application/json")], body)

    return handler


def relay(upstream: str, listener: socket.socket) -> None:
    """Accept forever; each client connection gets a thread and its own upstream one."""
    host, port = upstream.removeprefix("http://").rsplit(":", 1)
    while True:
        conn, _ = listener.accept()
        target = socket.create_connection((host, int(port)))
        threading.Thread(target=_copy_both_ways, args=(conn, target), daemon=True).start()


def _copy_both_ways(a: socket.socket, b: socket.socket) -> None:
    peers = {a.fileno(): (a, b), b.fileno(): (b, a)}
    poller = select.poll()
    for sock in (a, b):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        poller.register(sock, select.POLLIN)
    with a, b:
        while True:
            for fd, _ in poller.poll():
                source, sink = peers[fd]
                data = source.recv(1 << 16)
                if not data:
                    return
                sink.sendall(data)


async def serve(upstream: str, port: int, client: str, server_name: str) -> None:
    sock = _listen(port)
    if server_name == "own":
        own = HttpServer(make_handler(upstream), max_body_bytes=1 << 20)
        await own.start(sock)
        print(f"passthrough ready http=http://127.0.0.1:{sock.getsockname()[1]}", flush=True)
        await asyncio.Event().wait()  # until the benchmark terminates the process
    config = uvicorn.Config(
        make_app(upstream, client), lifespan="off", http="httptools", loop="none",
        log_level="warning", access_log=False,
    )  # fmt: skip
    server = uvicorn.Server(config)
    print(f"passthrough ready http=http://127.0.0.1:{sock.getsockname()[1]}", flush=True)
    await server.serve(sockets=[sock])


def _listen(port: int) -> socket.socket:
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", port))
    sock.listen(2048)
    return sock


if __name__ == "__main__":
    server_name = sys.argv[4] if len(sys.argv) > 4 else "uvicorn"
    if server_name == "relay":
        listener = _listen(int(sys.argv[2]))
        print(f"passthrough ready http=http://127.0.0.1:{listener.getsockname()[1]}", flush=True)
        relay(sys.argv[1], listener)
    uvloop.run(serve(sys.argv[1], int(sys.argv[2]), sys.argv[3], server_name))
