"""The proxy's HTTP face: a raw ASGI app (uvicorn + httptools, no framework on the path).

| method | path | what |
|---|---|---|
| POST | ``/v1/chat/completions``, ``/v1/completions`` | routed (``exchange.py``), SSE relayed |
| GET | ``/v1/models`` | the union of what routable replicas serve |
| any | other ``/v1/*`` | to the least-loaded replica of the body's or query's ``model`` |
| GET | ``/healthz`` | 200 while the process serves |
| GET | ``/readyz`` | 200 when some replica is routable and the state is usable; details as JSON |
| GET | ``/metrics`` | Prometheus (``metrics.py``) |

A handler is parse -> select -> stream. ``x-request-id`` is kept (or created) and sent
both ways; ``traceparent`` is forwarded. A client that disconnects cancels its handler,
which closes the upstream connection at once (the engine aborts the request). Every
refusal is an :class:`~dataplane.http_errors.ApiError` in OpenAI's shape; an exception
the proxy did not expect is logged and answered 500 (the fuzz test keeps it from
happening).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import time
import uuid
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qs

import msgspec
from opentelemetry.trace import Span

from dataplane.exchange import Attempt, Dispatcher, Exchange
from dataplane.fleet_state import FleetState
from dataplane.http_client import ConnectionFailed, ResponseBroken
from dataplane.http_errors import (
    ApiError,
    BadRequest,
    MethodNotAllowed,
    NotFound,
    PayloadTooLarge,
    StreamBroken,
    Unauthorized,
)
from dataplane.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from dataplane.metrics import ProxyMetrics
from dataplane.openai_request import InferenceRequest, Kind, decode_object, parse_inference
from dataplane.relay import SseRelay, usage_of
from dataplane.routing import Prepared, Router
from dataplane.tracing import Tracing, describe, traceparent_of
from kvcore.pb import routing_pb2

log = logging.getLogger("dataplane")


class ClientGone(Exception):
    """The client disconnected: stop working for it, answer nothing."""


Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]
JSON = b"application/json"
INFERENCE: dict[str, Kind] = {"/v1/chat/completions": "chat", "/v1/completions": "completion"}
THREAD_PROMPT_CHARS = 256 * 1024  # longer prompts are tokenized off the event loop
_DROP_UPSTREAM = frozenset(
    {"host", "content-length", "connection", "keep-alive", "transfer-encoding", "te",
     "upgrade", "accept-encoding", "proxy-authorization", "proxy-connection", "expect"}
)  # fmt: skip
_encode = msgspec.json.encode


@dataclass(frozen=True, slots=True)
class AppOptions:
    max_body_bytes: int
    auth: bool
    debug_headers: bool
    static: bool
    state_max_age_s: float


class ProxyApp:
    """The ASGI callable; built by ``service.py`` with its parts."""

    def __init__(
        self,
        options: AppOptions,
        fleet: FleetState,
        router: Router,
        dispatcher: Dispatcher,
        metrics: ProxyMetrics,
        readiness: Callable[[], dict[str, Any]] | None = None,
        tracing: Tracing | None = None,
    ) -> None:
        self.options = options
        self.fleet = fleet
        self.router = router
        self.dispatcher = dispatcher
        self.metrics = metrics
        self.readiness = readiness
        self.tracing = tracing

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}
        request_id = headers.get("x-request-id") or uuid.uuid4().hex
        response = _Responder(send, request_id)
        try:
            await self._dispatch(scope, receive, response, headers)
        except ApiError as exc:
            await response.error(exc)
        except ClientGone:
            return
        except Exception:
            log.exception("unexpected error", extra={"path": scope["path"], "id": request_id})
            await response.error(ApiError("internal error in the proxy"))

    async def _dispatch(
        self, scope: Scope, receive: Receive, response: _Responder, headers: dict[str, str]
    ) -> None:
        path, method = scope["path"], scope["method"]
        kind = INFERENCE.get(path)
        if kind is not None:
            _allow(method, "POST", path)
            await self._inference(scope, receive, response, headers, kind)
        elif path == "/v1/models":
            _allow(method, "GET", path)
            self._authenticate(headers)
            await response.json(self._models())
        elif path.startswith("/v1/"):
            await self._forward(scope, receive, response, headers)
        elif path == "/healthz":
            await response.json({"status": "ok"})
        elif path == "/readyz":
            detail = self._ready()
            await response.json(detail, 200 if detail["ready"] else 503)
        elif path == "/metrics":
            await response.send(200, self.metrics.render(), METRICS_CONTENT_TYPE)
        else:
            raise NotFound(f"No route {path}.")

    # -- inference -----------------------------------------------------------------

    async def _inference(
        self,
        scope: Scope,
        receive: Receive,
        response: _Responder,
        headers: dict[str, str],
        kind: Kind,
    ) -> None:
        raw = await _read_body(receive, headers, self.options.max_body_bytes)
        api_key = self._authenticate(headers)
        request = parse_inference(raw, kind)
        if self.tracing is None:
            await self._routed(scope, receive, response, headers, request, api_key, None)
            return
        with self.tracing.request(headers, response.id) as span:
            await self._routed(scope, receive, response, headers, request, api_key, span)

    async def _routed(
        self,
        scope: Scope,
        receive: Receive,
        response: _Responder,
        headers: dict[str, str],
        request: InferenceRequest,
        api_key: routing_pb2.ApiKey | None,
        span: Span | None,
    ) -> None:
        started = time.perf_counter()
        prepared = await self._prepare(request, scope["path"], headers, api_key, response.id)
        self.metrics.decided(prepared.workload.strategy, time.perf_counter() - started)
        body = request.upstream_body(
            include_usage=request.stream and not request.wants_usage,
            cache_salt=prepared.upstream_salt,
        )
        upstream_headers = self._upstream_headers(headers, response.id, span)
        exchange = Exchange(request, prepared)
        try:
            await _until_disconnect(
                receive, self._exchange(exchange, scope, response, body, upstream_headers)
            )
        except ClientGone:
            exchange.outcome = "cancelled"
            raise
        except ApiError:
            if exchange.outcome == "ok":
                exchange.outcome = "upstream_error"
            raise
        except Exception:
            exchange.outcome = "upstream_error"
            raise
        finally:
            self.dispatcher.finish(exchange)
            if span is not None:
                describe(span, _span_attributes(exchange), failed=exchange.outcome != "ok")

    async def _prepare(
        self,
        request: Any,
        path: str,
        headers: dict[str, str],
        api_key: routing_pb2.ApiKey | None,
        request_id: str,
    ) -> Prepared:
        spec = self.router.tokenizer_spec(request.model)
        large = len(request.raw) > THREAD_PROMPT_CHARS
        if large or not self.router.tokenizers.loaded(spec):
            return await asyncio.to_thread(
                self.router.prepare,
                request,
                path=path,
                headers=headers,
                api_key=api_key,
                request_id=request_id,
            )
        return self.router.prepare(
            request, path=path, headers=headers, api_key=api_key, request_id=request_id
        )

    async def _exchange(
        self,
        exchange: Exchange,
        scope: Scope,
        response: _Responder,
        body: bytes,
        upstream_headers: list[tuple[str, str]],
    ) -> None:
        attempt = await self.dispatcher.send(exchange, scope["path"], body, upstream_headers)
        exchange.attempt = attempt
        extra = self._debug_headers(exchange.prepared, attempt)
        opened = attempt.opened
        if not opened.streaming:
            exchange.usage = usage_of(opened.first)
            opened.release()
            await response.send(opened.status, opened.first, headers=opened.headers + extra)
            return
        relay = SseRelay(strip_usage=exchange.request.stream and not exchange.request.wants_usage)
        try:
            await response.start(opened.status, opened.headers + extra)
            await response.chunk(relay.feed(opened.first))
            async for chunk in opened.rest():
                await response.chunk(relay.feed(chunk))
            await response.chunk(relay.flush())
        except (ConnectionFailed, ResponseBroken, TimeoutError) as exc:
            opened.close()
            raise StreamBroken(f"The replica broke off the stream: {exc}") from None
        except BaseException:
            opened.close()
            raise
        opened.release()
        exchange.usage = relay.usage
        await response.end()

    def _upstream_headers(
        self, headers: Mapping[str, str], request_id: str, span: Span | None = None
    ) -> list[tuple[str, str]]:
        out = [
            (k, v)
            for k, v in headers.items()
            if k not in _DROP_UPSTREAM and not (self.options.auth and k == "authorization")
        ]
        if span is not None and (traceparent := traceparent_of(span)) is not None:
            out = [(k, v) for k, v in out if k != "traceparent"]
            out.append(("traceparent", traceparent))
        out.append(("accept-encoding", "identity"))
        if "x-request-id" not in headers:
            out.append(("x-request-id", request_id))
        return out

    def _debug_headers(self, prepared: Prepared, attempt: Attempt) -> list[tuple[bytes, bytes]]:
        if not self.options.debug_headers:
            return []
        blocks = len(prepared.block_keys)
        matched = attempt.predicted // prepared.block_size
        return [
            (b"x-kvroute-replica", attempt.endpoint.replica_id.encode()),
            (b"x-kvroute-workload", prepared.workload.name.encode()),
            (b"x-kvroute-prefix-blocks", f"{matched}/{blocks}".encode()),
            (b"x-kvroute-decision", attempt.decision.summary().encode("ascii", "replace")),
        ]

    # -- auth ----------------------------------------------------------------------

    def _authenticate(self, headers: Mapping[str, str]) -> routing_pb2.ApiKey | None:
        if not self.options.auth:
            return None
        scheme, _, token = headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            raise Unauthorized("Missing bearer API key.", code="invalid_api_key")
        digest = hashlib.sha256(token.strip().encode()).hexdigest()
        key = self.fleet.api_keys().get(digest)
        if key is None or (key.scopes and "inference" not in key.scopes):
            raise Unauthorized("Incorrect API key provided.", code="invalid_api_key")
        return key

    # -- other routes ----------------------------------------------------------------

    def _models(self) -> dict[str, Any]:
        cards = [
            {"id": name, "object": "model", "created": 0, "owned_by": "kvroute"}
            for name in self.fleet.served_models()
        ]
        return {"object": "list", "data": cards}

    async def _forward(
        self, scope: Scope, receive: Receive, response: _Responder, headers: dict[str, str]
    ) -> None:
        """Any other /v1/* route: to the least-loaded replica serving the model."""
        raw = await _read_body(receive, headers, self.options.max_body_bytes)
        self._authenticate(headers)
        model = _model_of(scope, raw)
        ordinal = self.router.least_loaded(model)
        endpoint = self.dispatcher.fleet.endpoint(ordinal) if ordinal is not None else None
        if endpoint is None:
            raise NotFound(f"The model `{model}` does not exist.", "model", "model_not_found")
        query = scope.get("query_string", b"").decode("latin-1")
        url = endpoint.base_url + scope["path"] + (f"?{query}" if query else "")
        upstream = self.dispatcher.upstream
        opened = await upstream.open(
            scope["method"], url, raw, self._upstream_headers(headers, response.id)
        )
        try:
            await response.start(opened.status, opened.headers)
            await response.chunk(opened.first)
            async for chunk in opened.rest():
                await response.chunk(chunk)
        finally:
            opened.close()
        await response.end()

    def _ready(self) -> dict[str, Any]:
        models = self.fleet.served_models()
        age = self.fleet.age_s()
        fresh = self.options.static or age <= self.options.state_max_age_s
        detail: dict[str, Any] = {
            "ready": bool(models) and (self.options.static or age != float("inf")),
            "models": models,
            "replicas": len(self.fleet.endpoints()),
            "state_age_s": None if self.options.static or age == float("inf") else round(age, 3),
            "state_fresh": fresh,
        }
        if self.readiness is not None:
            detail.update(self.readiness())
        return detail


def _span_attributes(exchange: Exchange) -> dict[str, Any]:
    prepared, attempt, usage = exchange.prepared, exchange.attempt, exchange.usage
    values: dict[str, Any] = {
        "kvroute.workload": prepared.workload.name,
        "kvroute.strategy": prepared.workload.strategy,
        "kvroute.model": prepared.model,
        "kvroute.prefix_blocks.total": len(prepared.block_keys),
        "kvroute.attempts": len(exchange.tried),
        "kvroute.outcome": exchange.outcome,
        "kvroute.cached_tokens.measured": None if usage is None else usage.cached_tokens,
    }
    if attempt is not None:
        values["kvroute.replica"] = attempt.endpoint.replica_id
        values["kvroute.prefix_blocks.matched"] = attempt.predicted // prepared.block_size
        values["kvroute.cached_tokens.predicted"] = attempt.predicted
        values["http.response.status_code"] = attempt.opened.status
    return values


def _allow(method: str, allowed: str, path: str) -> None:
    if method != allowed:
        raise MethodNotAllowed(f"{method} is not allowed on {path}; use {allowed}.")


def _model_of(scope: Scope, raw: bytes) -> str:
    if raw:
        with contextlib.suppress(BadRequest):
            model = decode_object(raw).get("model")
            if isinstance(model, str) and model:
                return model
    query = parse_qs(scope.get("query_string", b"").decode("latin-1"))
    values = query.get("model")
    if values:
        return str(values[0])
    raise BadRequest("'model' is required to route this request.", "model")


async def _read_body(receive: Receive, headers: Mapping[str, str], limit: int) -> bytes:
    length = headers.get("content-length", "")
    if length.isdigit() and int(length) > limit:
        raise PayloadTooLarge(f"The request body is larger than {limit} bytes.")
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientGone
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise PayloadTooLarge(f"The request body is larger than {limit} bytes.")
        chunks.append(chunk)
        if not message.get("more_body", False):
            return chunks[0] if len(chunks) == 1 else b"".join(chunks)


async def _until_disconnect(receive: Receive, work: Awaitable[None]) -> None:
    """Run ``work`` in this task; cancel it the moment the client disconnects."""
    task = asyncio.current_task()
    assert task is not None
    gone = False

    def on_message(message: asyncio.Future[dict[str, Any]]) -> None:
        nonlocal gone
        if message.cancelled() or message.exception() is not None:
            return
        if message.result()["type"] == "http.disconnect":
            gone = True
            task.cancel()

    watcher = asyncio.ensure_future(receive())
    watcher.add_done_callback(on_message)
    try:
        await work
    except asyncio.CancelledError:
        if gone:
            task.uncancel()
            raise ClientGone from None
        raise
    finally:
        watcher.remove_done_callback(on_message)
        watcher.cancel()


class _Responder:
    """Sends the response: once started, errors can no longer change the status."""

    __slots__ = ("_send", "id", "started")

    def __init__(self, send: Send, request_id: str) -> None:
        self._send = send
        self.id = request_id
        self.started = False

    async def start(self, status: int, headers: list[tuple[bytes, bytes]]) -> None:
        headers = [*headers, (b"x-request-id", self.id.encode("latin-1"))]
        self.started = True
        await self._send({"type": "http.response.start", "status": status, "headers": headers})

    async def chunk(self, data: bytes) -> None:
        if data:
            await self._send({"type": "http.response.body", "body": data, "more_body": True})

    async def end(self) -> None:
        await self._send({"type": "http.response.body", "body": b"", "more_body": False})

    async def send(
        self,
        status: int,
        body: bytes,
        content_type: bytes = JSON,
        headers: list[tuple[bytes, bytes]] | None = None,
    ) -> None:
        if headers is None:
            headers = [(b"content-type", content_type)]
        headers = [*headers, (b"content-length", str(len(body)).encode())]
        await self.start(status, headers)
        await self._send({"type": "http.response.body", "body": body, "more_body": False})

    async def json(self, obj: Any, status: int = 200) -> None:
        await self.send(status, _encode(obj))

    async def error(self, exc: ApiError) -> None:
        if self.started:  # the status is out: end the stream with an error event
            log.warning("stream ended by an error", extra={"id": self.id, "error": exc.message})
            with contextlib.suppress(Exception):
                await self.chunk(b"data: " + exc.encode() + b"\n\n")
                await self.end()
            return
        body = exc.encode()
        headers = [(b"content-type", JSON), *exc.headers]
        await self.send(exc.status, body, headers=headers)
