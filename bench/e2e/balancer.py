"""A TCP round-robin balancer: the stand-in for a Kubernetes Service (an L4 balancer).

Each new client connection goes to the next backend in turn and its bytes are copied
both ways until either side closes; nothing is parsed, so HTTP keep-alive connections
stay on one backend as they would behind a real L4 balancer. It exists so the benchmark
can put several router instances behind one address, the deployment kvroute is built
for, and measure what that does to each router's cache affinity.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools

_CHUNK = 64 * 1024


class RoundRobinBalancer:
    """Listens on 127.0.0.1 (a free port unless given) and spreads connections."""

    def __init__(self, backends: list[tuple[str, int]], port: int = 0) -> None:
        if not backends:
            raise ValueError("a balancer needs at least one backend")
        self.backends = backends
        self._next = itertools.cycle(range(len(backends)))
        self._port = port
        self._server: asyncio.Server | None = None
        self._pipes: set[asyncio.Task[None]] = set()
        self.connections = [0] * len(backends)

    @property
    def url(self) -> str:
        assert self._server is not None, "start() first"
        port = self._server.sockets[0].getsockname()[1]
        return f"http://127.0.0.1:{port}"

    async def start(self) -> RoundRobinBalancer:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", self._port)
        return self

    async def aclose(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
        for pipe in list(self._pipes):
            pipe.cancel()
        await asyncio.gather(*self._pipes, return_exceptions=True)

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        index = next(self._next)
        self.connections[index] += 1
        host, port = self.backends[index]
        try:
            up_reader, up_writer = await asyncio.open_connection(host, port)
        except OSError:
            writer.close()
            return
        both = (
            asyncio.ensure_future(_copy(reader, up_writer)),
            asyncio.ensure_future(_copy(up_reader, writer)),
        )
        self._pipes.update(both)
        try:
            await asyncio.gather(*both, return_exceptions=True)
        finally:
            self._pipes.difference_update(both)


async def _copy(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while chunk := await reader.read(_CHUNK):
            writer.write(chunk)
            await writer.drain()
    except (ConnectionError, asyncio.CancelledError):
        pass
    finally:
        with contextlib.suppress(Exception):
            writer.close()
