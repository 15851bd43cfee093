"""The order of a request's work: its upstream request is written before the bookkeeping
routing leaves behind, and its answer is written to the client before the bookkeeping the
answer leaves behind; none of that bookkeeping is lost, not even when the client hangs
up as soon as it has its answer.

The proxy runs whole (``ProxyService`` behind its ``HttpServer``) on in-memory
transports: the client's and the replicas' writes, and the calls of interest to the
fleet state and the metrics, are logged in one list in the order they happen.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from typing import Any, TypeVar
from unittest import mock

import pytest

from bench.proxy_path import MemoryTransport
from dataplane import service as service_module
from dataplane.breaker import CircuitBreakers
from dataplane.fleet.inflight import Inflight
from dataplane.fleet.state import FleetState
from dataplane.metrics import ProxyMetrics
from dataplane.service import ProxyService
from dataplane.settings import ProxySettings
from dataplane.transport.client import ConnectionPool, _Connection
from dataplane.transport.server import HttpServer

T = TypeVar("T")
MODEL = "m"
REPLICAS = ["http://10.0.0.1:8000", "http://10.0.0.2:8000"]


def json_reply(cached: int, extra_headers: bytes = b"") -> bytes:
    """A replica's whole completion; ``extra_headers`` are raw header lines (CRLF-ended)."""
    body = json.dumps({
        "id": "cmpl-1", "object": "text_completion", "model": MODEL,
        "choices": [{"index": 0, "text": " hi", "finish_reason": "length"}],
        "usage": {"prompt_tokens": 7, "completion_tokens": 1, "total_tokens": 8,
                  "prompt_tokens_details": {"cached_tokens": cached}},
    }).encode()  # fmt: skip
    head = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n"
    return head % len(body) + extra_headers + b"\r\n" + body


def _sse_reply(cached: int) -> bytes:
    text = {"choices": [{"index": 0, "text": " hi"}]}
    details = {"cached_tokens": cached}
    usage = {"choices": [], "usage": {"prompt_tokens": 7, "prompt_tokens_details": details}}
    events = b"".join(b"data: %s\n\n" % json.dumps(e).encode() for e in (text, usage))
    events += b"data: [DONE]\n\n"
    head = (
        b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
    )
    return head + b"%x\r\n%s\r\n0\r\n\r\n" % (len(events), events)


class _Replicas(ConnectionPool):
    """Replicas that answer ``reply`` on the loop's next turn, as over a socket."""

    def __init__(self, log: list[str], reply: bytes) -> None:
        super().__init__(2.0, 60.0)
        self.log = log
        self.reply = reply
        self.connects = 0

    async def _connect(self, host: str, port: int) -> _Connection:
        self.connects += 1
        connection = _Connection()
        loop = asyncio.get_running_loop()

        def answer() -> None:
            self.log.append("reply arrives")
            connection.data_received(self.reply)

        def on_write(_: bytes) -> None:
            self.log.append("upstream write")
            loop.call_soon(answer)

        connection.connection_made(MemoryTransport(on_write))  # type: ignore[arg-type]
        connection.peer = (host, port)
        return connection


def logged_subclass(cls: type[T], names: list[str], log: list[str]) -> type[T]:
    """A subclass of ``cls`` whose methods ``names`` append their name to ``log`` first."""

    def logged(name: str) -> Callable[..., Any]:
        method = getattr(cls, name)

        def call(self: Any, *args: Any, **kwargs: Any) -> Any:
            log.append(name)
            return method(self, *args, **kwargs)

        return call

    return type(f"Logged{cls.__name__}", (cls,), {name: logged(name) for name in names})


class Proxy:
    """A static round-robin proxy of two in-memory replicas, its calls logged;
    ``options`` are more of its settings."""

    def __init__(self, reply: bytes, **options: Any) -> None:
        settings = {"static_replicas": REPLICAS, "static_strategy": "round_robin", **options}
        self.log: list[str] = []
        # calls are logged by subclasses: the classes may be compiled (dataplane/native.py),
        # and a compiled object's methods cannot be replaced
        inflight = logged_subclass(Inflight, ["on_sent", "on_first_byte", "on_done"], self.log)

        class Fleet(FleetState):
            def __init__(self, **kwargs: Any) -> None:
                super().__init__(inflight=inflight, **kwargs)

        metrics = logged_subclass(ProxyMetrics, ["decided", "first_byte", "count"], self.log)
        breakers = logged_subclass(CircuitBreakers, ["on_success"], self.log)
        with (
            mock.patch.object(service_module, "FleetState", Fleet),
            mock.patch.object(service_module, "ProxyMetrics", metrics),
            mock.patch.object(service_module, "CircuitBreakers", breakers),
        ):
            self.service = ProxyService(ProxySettings.model_validate(settings))
        for endpoint in self.service.fleet.replicas.endpoints():
            self.service.fleet.set_served_names(endpoint.ordinal, [MODEL])
        self.server = HttpServer(self.service.app, max_body_bytes=1 << 20)
        self.replicas = _Replicas(self.log, reply)
        self.service.upstream.pool = self.replicas

    def client(self, on_write: Callable[[bytes], None]) -> Any:
        """A new client connection; its writes go to ``on_write``."""
        connection = self.server.protocol()
        connection.connection_made(MemoryTransport(on_write))  # type: ignore[arg-type]
        return connection

    async def ask(
        self,
        body: dict[str, Any] | None,
        *,
        hang_up: bool = False,
        method: str = "POST",
        headers: dict[str, str] | None = None,
    ) -> bytes:
        """Send one completion (or, with no ``body``, a bodiless ``method``); with
        ``hang_up`` the client's connection is lost as soon as the first answer bytes are
        written to it (within that very write)."""
        answered: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()

        def on_write(data: bytes) -> None:
            self.log.append("client write")
            if not answered.done():
                answered.set_result(data)
            if hang_up:
                client.connection_lost(None)

        client = self.client(on_write)
        raw = (
            b"" if body is None else json.dumps({"model": MODEL, "max_tokens": 1, **body}).encode()
        )
        lines = "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items()).encode()
        client.data_received(
            b"%s /v1/completions HTTP/1.1\r\nhost: proxy\r\ncontent-type: application/json"
            b"\r\n%scontent-length: %d\r\n\r\n%s" % (method.encode(), lines, len(raw), raw)
        )
        return await answered

    def counted(self, outcome: str) -> float:
        values = self.service.metrics.requests.values
        return sum(v for (_, _, out), v in values.items() if out == outcome)

    def measured_requests(self) -> float:
        return sum(self.service.metrics.measured_requests.values.values())

    def measured_cached(self) -> float:
        return sum(self.service.metrics.measured.values.values())


async def test_the_upstream_write_and_the_client_write_come_before_the_bookkeeping() -> None:
    proxy = Proxy(json_reply(cached=3))
    await proxy.ask({"prompt": "hello"})
    await proxy.ask({"prompt": "hello"})  # each replica has a kept-alive connection now
    proxy.log.clear()
    answer = await proxy.ask({"prompt": "hello there"})
    assert answer.startswith(b"HTTP/1.1 200")
    assert proxy.log == [
        "upstream write", "decided", "on_sent",  # all before the reply is awaited
        "reply arrives", "client write",
        "on_first_byte", "on_success", "first_byte", "on_done", "count",
    ]  # fmt: skip
    assert proxy.counted("ok") == 3
    assert (proxy.measured_requests(), proxy.measured_cached()) == (3, 9)
    assert proxy.service.fleet.inflight.total() == 0
    assert sum(sum(row[:-1]) for row in proxy.service.metrics.ttfb.rows.values()) == 3


async def test_a_client_gone_right_after_its_answer_is_still_counted_in_full() -> None:
    proxy = Proxy(json_reply(cached=5))
    answer = await proxy.ask({"prompt": "hello there"}, hang_up=True)
    assert answer.startswith(b"HTTP/1.1 200")
    await asyncio.sleep(0)  # the cancellation the hang-up asked for is delivered
    assert proxy.counted("ok") == 1
    assert proxy.counted("cancelled") == 0
    assert (proxy.measured_requests(), proxy.measured_cached()) == (1, 5)
    assert proxy.service.fleet.inflight.total() == 0
    assert "on_first_byte" in proxy.log
    await proxy.ask({"prompt": "hello again"})
    await proxy.ask({"prompt": "and again"})
    assert proxy.replicas.connects == 2  # both replicas' connections went back to the pool


async def test_a_stream_is_settled_after_its_first_event_is_written_before_any_wait() -> None:
    proxy = Proxy(_sse_reply(cached=2))
    full = asyncio.Event()
    connections: list[Any] = []

    def on_write(data: bytes) -> None:
        proxy.log.append("client write")
        if not full.is_set():  # the client's buffer fills with the first piece
            full.set()
            connections[0].pause_writing()

    connections.append(proxy.client(on_write))
    raw = json.dumps({"model": MODEL, "prompt": "hi", "stream": True}).encode()
    connections[0].data_received(
        b"POST /v1/completions HTTP/1.1\r\nhost: proxy\r\ncontent-length: %d\r\n\r\n%s"
        % (len(raw), raw)
    )
    await full.wait()
    for _ in range(3):
        await asyncio.sleep(0)
    # the proxy waits for the slow client with the first byte already settled
    assert proxy.log[-4:] == ["client write", "on_first_byte", "on_success", "first_byte"]
    assert proxy.service.fleet.inflight.total() == 1
    connections[0].resume_writing()
    for _ in range(3):
        await asyncio.sleep(0)
    assert proxy.log[-2:] == ["on_done", "count"]
    assert proxy.counted("ok") == 1
    assert (proxy.measured_requests(), proxy.measured_cached()) == (1, 2)


@pytest.mark.parametrize("held_out", [True, False])
async def test_a_request_no_replica_takes_still_counts_its_decision(held_out: bool) -> None:
    proxy = Proxy(json_reply(cached=0))
    breakers = proxy.service.dispatcher.breakers
    if held_out:  # every replica's breaker is open: nothing is written
        for endpoint in proxy.service.fleet.replicas.endpoints():
            for _ in range(breakers.failures):
                breakers.on_failure(endpoint.replica_id, endpoint.ordinal, time.monotonic())
    else:  # every replica answers 503
        proxy.replicas.reply = b"HTTP/1.1 503 Service Unavailable\r\ncontent-length: 0\r\n\r\n"
    answer = await proxy.ask({"prompt": "hello there"})
    assert answer.startswith(b"HTTP/1.1 503")
    assert proxy.log.count("decided") == 1
    assert proxy.counted("no_replica") == 1
    assert proxy.service.fleet.inflight.total() == 0
