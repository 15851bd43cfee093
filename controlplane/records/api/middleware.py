"""ASGI middleware of the admin API: the body size limit, spans and metrics, then the
bodies no route can read.

They wrap the application rather than living in handlers: a body over the limit is
refused with 413 before any handler reads it (by its declared length, or as it streams
in); every request gets an OpenTelemetry span named after its route template and a
count and latency in the registry; and a write's body must be JSON in UTF-8 that says
nothing JSON cannot say back (:class:`JsonBodies`), so that no route, and no 422 that
quotes the input, meets bytes it cannot decode or encode.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Iterator
from email.message import Message as MimeHeader
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
    await _answer(send, 413, f"request body over {limit} bytes")


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


class JsonBodies:
    """A write's non-empty body: 415 unless it is sent as JSON (``application/json``,
    ``*+json``, or no content type), 400 naming the problem unless it is UTF-8 and,
    where it parses, holds no lone surrogate and no number beyond a float. What does not
    parse is left to the route (FastAPI's 422 ``json_invalid``)."""

    WRITES = frozenset({"POST", "PUT", "PATCH"})

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] not in self.WRITES:
            await self.app(scope, receive, send)
            return
        body, rest = await _whole_body(receive)
        refusal = _refusal(body, dict(scope["headers"]).get(b"content-type")) if body else None
        if refusal is not None:
            await _answer(send, *refusal)
            return
        await self.app(scope, _replay(body, rest, receive), send)


async def _whole_body(receive: Receive) -> tuple[bytes, list[Message]]:
    """The request's body, and any message that came after it (a disconnect)."""
    parts: list[bytes] = []
    while True:
        message = await receive()
        if message["type"] != "http.request":
            return b"".join(parts), [message]
        parts.append(message.get("body", b""))
        if not message.get("more_body", False):
            return b"".join(parts), []


def _replay(body: bytes, rest: list[Message], receive: Receive) -> Receive:
    """``receive`` for the app: the body read already, then what the client sends."""
    sent = False

    async def replayed() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return rest.pop(0) if rest else await receive()

    return replayed


def _refusal(body: bytes, content_type: bytes | None) -> tuple[int, str] | None:
    if content_type is not None and not _is_json(content_type.decode("latin-1")):
        return 415, "send the body as JSON, with content-type: application/json"
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as exc:
        return 400, f"the body is not UTF-8: byte 0x{body[exc.start]:02x} at offset {exc.start}"
    try:
        value = json.loads(text, parse_float=_finite, parse_constant=_no_constant)
    except _NotJson as exc:
        return 400, f"the body's JSON holds {exc}, which JSON cannot carry"
    except (ValueError, RecursionError):
        return None  # not JSON: the route says so
    for item in _strings(value):
        try:
            item.encode("utf-8")
        except UnicodeEncodeError:
            return (
                400,
                "the body's JSON holds a lone surrogate (a \\ud800-\\udfff escape alone), not text",
            )
    return None


class _NotJson(ValueError):
    pass


def _finite(literal: str) -> float:
    number = float(literal)
    if not math.isfinite(number):
        raise _NotJson(f"the number {literal[:40]}, beyond a float")
    return number


def _no_constant(literal: str) -> float:
    raise _NotJson(literal)


def _strings(value: Any) -> Iterator[str]:
    """Every string in a parsed JSON value, keys too."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            yield item
        elif isinstance(item, dict):
            yield from item.keys()
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)


def _is_json(content_type: str) -> bool:
    header = MimeHeader()
    header["content-type"] = content_type
    subtype = header.get_content_subtype()
    return header.get_content_maintype() == "application" and (
        subtype == "json" or subtype.endswith("+json")
    )


async def _answer(send: Send, status: int, detail: str) -> None:
    body = json.dumps({"detail": detail}).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body))]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
