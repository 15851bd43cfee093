"""ASGI middleware of the admin API: the body size limit, then spans and metrics.

Both wrap the application rather than living in handlers: a body over the limit is
refused with 413 before any handler reads it (by its declared length, or as it streams
in), and every request gets an OpenTelemetry span named after its route template and a
count and latency in the registry.
"""

from __future__ import annotations

import json
import time
from typing import Any

from opentelemetry import trace
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from controlplane.records.metrics import RecordsMetrics

MAX_BODY_BYTES = 1024 * 1024


class BodyTooLarge(Exception):
    pass


class BodyLimit:
    """Refuse request bodies over ``limit`` bytes with 413."""

    def __init__(self, app: ASGIApp, limit: int = MAX_BODY_BYTES) -> None:
        self.app = app
        self.limit = limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > self.limit):
            await _too_large(send, self.limit)
            return
        seen = 0
        started = False

        async def limited_receive() -> Message:
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > self.limit:
                raise BodyTooLarge
            return message

        async def tracking_send(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, limited_receive, tracking_send)
        except BodyTooLarge:
            if not started:
                await _too_large(send, self.limit)


async def _too_large(send: Send, limit: int) -> None:
    body = json.dumps({"detail": f"request body over {limit} bytes"}).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body))]
    await send({"type": "http.response.start", "status": 413, "headers": headers})
    await send({"type": "http.response.body", "body": body})


class Observe:
    """A span per request (named ``METHOD /route/{template}``) and request metrics."""

    def __init__(
        self, app: ASGIApp, metrics: RecordsMetrics, tracer_provider: Any | None = None
    ) -> None:
        self.app = app
        self.metrics = metrics
        self.tracer = trace.get_tracer(
            "kvroute.controlplane.admin", tracer_provider=tracer_provider
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        method = scope["method"]
        status = 500
        start = time.perf_counter()

        async def recording_send(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        with self.tracer.start_as_current_span(f"{method} admin") as span:
            try:
                await self.app(scope, receive, recording_send)
            finally:
                route = _route(scope)
                span.update_name(f"{method} {route}")
                span.set_attribute("http.request.method", method)
                span.set_attribute("http.route", route)
                span.set_attribute("http.response.status_code", status)
                self.metrics.admin_requests.labels(method, route, str(status)).inc()
                self.metrics.admin_latency.labels(method, route).observe(
                    time.perf_counter() - start
                )


def _route(scope: Scope) -> str:
    route = scope.get("route")
    path = getattr(route, "path", None)
    return path if isinstance(path, str) else "unmatched"
