"""The proxy's HTTP face: the handler ``dataplane.transport.server`` runs for every request.

| method | path | what |
|---|---|---|
| POST | ``/v1/chat/completions``, ``/v1/completions`` | routed (``exchange.py``), SSE relayed |
| POST, PUT | ``/generate`` | SGLang's own, routed as a completion of ``text`` or ``input_ids`` |
| GET | ``/v1/models`` | the union of what routable replicas serve, as the engines list it |
| any | other ``/v1/*`` | to the least-loaded replica of the body's or query's ``model`` |
| any | ``ENGINE_ROUTES`` | the engines' own routes outside ``/v1`` (``/tokenize``...), the same |
| GET | ``/healthz`` | 200 while the process serves |
| GET | ``/readyz`` | 200 when some replica is routable and the state is usable; details as JSON |
| GET | ``/metrics`` | Prometheus (``metrics.py``); on ``--metrics-port`` instead when set |
| OPTIONS | any | a CORS preflight, when origins are allowed (``transport/cors.py``) |

A handler is parse -> select -> stream. ``x-request-id`` is kept (or created: a random
per-process prefix and a counter, cheaper than a UUID) and sent both ways;
``traceparent`` is forwarded. A client that disconnects cancels its handler (the server
sees the connection go), which closes the upstream connection at once (the engine aborts
the request). Every refusal is an :class:`~dataplane.http_errors.ApiError` in OpenAI's
shape; an exception the proxy did not expect is logged and answered 500 (the fuzz test
keeps it from happening).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import itertools
import logging
import secrets
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qs, unquote

import msgspec
from opentelemetry.trace import Span

from dataplane.exchange import Attempt, Dispatcher, Exchange
from dataplane.fleet.state import FleetState
from dataplane.http_errors import (
    ApiError,
    BadRequest,
    MethodNotAllowed,
    NotFound,
    StreamBroken,
    Unauthorized,
)
from dataplane.lora import ROUTES as LORA_ROUTES
from dataplane.lora import LoraPlacement
from dataplane.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from dataplane.metrics import ProxyMetrics
from dataplane.model_cards import ModelCards, own_card
from dataplane.openai_request import InferenceRequest, Kind, decode_object, parse_inference
from dataplane.relay import GenerateRelay, SseRelay, generate_usage_of, usage_of
from dataplane.routing import Prepared, Router
from dataplane.tracing import Tracing, describe, traceparent_of
from dataplane.transport.client import ConnectionFailed, ResponseBroken
from dataplane.transport.cors import Cors
from dataplane.transport.server import Request, Response
from kvcore.pb import routing_pb2
from kvcore.tenancy import own_namespace, tenant_salt
from kvcore.workload.classify import WORKLOAD_HEADER

log = logging.getLogger("dataplane")

JSON = b"application/json"
MODEL_PATH = "/v1/models/"  # + a model's id (which may hold slashes)
# vLLM's and SGLang's routes outside /v1 that answer about a model or run one (not their
# admin routes, such as a cache reset, which would act on one replica of many)
ENGINE_ROUTES = frozenset(
    {"/tokenize", "/detokenize", "/version", "/pooling", "/classify", "/score", "/rerank",
     "/v2/rerank", "/encode", "/get_model_info", "/model_info"}
)  # fmt: skip
INFERENCE: dict[str, Kind] = {
    "/v1/chat/completions": "chat",
    "/v1/completions": "completion",
    "/generate": "generate",  # SGLang's own
}
THREAD_PROMPT_CHARS = 256 * 1024  # longer prompts are tokenized off the event loop
_DROP_UPSTREAM = frozenset(
    {"host", "content-length", "connection", "keep-alive", "transfer-encoding", "te",
     "upgrade", "accept-encoding", "proxy-authorization", "proxy-connection", "expect"}
)  # fmt: skip
_encode = msgspec.json.encode
# request headers the proxy reads as one value: a second line of any is a 400 (the
# server's own, host and framing, are always)
SINGLE_HEADERS = frozenset(
    {"x-request-id", WORKLOAD_HEADER, "traceparent", "tracestate", "origin",
     "access-control-request-method"}
)  # fmt: skip


@dataclass(frozen=True, slots=True)
class AppOptions:
    max_body_bytes: int
    auth: bool
    debug_headers: bool
    static: bool
    state_max_age_s: float
    cors_allowed_origins: tuple[str, ...] = ()
    metrics_apart: bool = False  # /metrics is served on its own port, not with the API


class RequestIds:
    """``x-request-id`` values: 32 hex digits, a random per-process half and a counter."""

    def __init__(self) -> None:
        self._prefix = secrets.token_bytes(8)
        self._counter = itertools.count(1)

    def next(self) -> str:
        # bytes' hex(), not an f-string's format spec: a sixth of the cost
        return (self._prefix + next(self._counter).to_bytes(8, "big")).hex()


class ProxyApp:
    """The request handler; built by ``service.py`` with its parts."""

    def __init__(
        self,
        options: AppOptions,
        fleet: FleetState,
        router: Router,
        dispatcher: Dispatcher,
        metrics: ProxyMetrics,
        readiness: Callable[[], dict[str, Any]] | None = None,
        tracing: Tracing | None = None,
        scrape: Callable[[], Awaitable[bytes]] | None = None,
        cards: ModelCards | None = None,
        lora: LoraPlacement | None = None,
    ) -> None:
        self.options = options
        self.fleet = fleet
        self.router = router
        self.dispatcher = dispatcher
        self.metrics = metrics
        self.readiness = readiness
        self.tracing = tracing
        self.scrape = scrape  # the whole proxy's metrics, where it has several workers
        self.cards = cards  # the engines' model cards (else the proxy's own)
        self.lora = lora  # LoRA adapters loaded on demand and the pool's load routes
        self.cors = Cors(options.cors_allowed_origins) if options.cors_allowed_origins else None
        self._ids = RequestIds()
        tenant_header = router.defaults.tenant_header
        # what the server refuses to see twice in one request, for this handler
        self.single_headers = SINGLE_HEADERS | ({tenant_header} if tenant_header else set())

    async def __call__(self, request: Request, response: Response) -> None:
        request_id = request.headers.get("x-request-id") or self._ids.next()
        if self.cors is None:
            reply = _Responder(response, request_id)
        else:
            reply = _Responder(response, request_id, self.cors.answer_headers(request.headers))
        try:
            kind = INFERENCE.get(request.path)
            if kind is None and "%" in request.path:  # as the engines' servers decode it
                kind = INFERENCE.get(unquote(request.path))
            # the hot path: few coroutines
            if kind is not None and (request.method == "POST" or _put_generate(request, kind)):
                api_key = self._authenticate(request.headers)
                inference = parse_inference(request.body, kind)
                if not inference.model:
                    inference.model = self._default_model()
                if self.tracing is None:
                    await self._routed(request, reply, inference, api_key, None)
                else:
                    await self._traced(request, reply, inference, api_key)
            else:
                await self._dispatch(request, reply)
        except ApiError as exc:
            reply.error(exc)
        except Exception:
            log.exception("unexpected error", extra={"path": request.path, "id": request_id})
            reply.error(ApiError("internal error in the proxy"))

    async def _dispatch(self, request: Request, response: _Responder) -> None:
        """Every route but inference, and inference asked with another method."""
        path, method = request.path, request.method
        if self.cors is not None and self.cors.is_preflight(method, request.headers):
            response.preflight(self.cors.preflight(request.headers))
        elif path in INFERENCE:
            _allow(method, "POST, PUT" if INFERENCE[path] == "generate" else "POST", path)
        elif path == "/v1/models":
            _allow(method, "GET", path)
            self._authenticate(request.headers)
            response.json(await self._models())
        elif path.startswith(MODEL_PATH):  # the OpenAI client's models.retrieve()
            _allow(method, "GET", path)
            self._authenticate(request.headers)
            response.json(await self._model(unquote(path[len(MODEL_PATH) :])))
        elif path in LORA_ROUTES and self.lora is not None:
            _allow(method, "POST", path)
            self._authenticate(request.headers)
            text = await self.lora.admin(path, request.body, request.headers)
            response.send(200, text.encode(), b"text/plain; charset=utf-8")
        elif path.startswith("/v1/") or path in ENGINE_ROUTES:
            await self._forward(request, response)
        elif path in ("/healthz", "/health"):  # /health: the engines' own, for their probes
            _allow(method, "GET", path)
            response.json({"status": "ok"})
        elif path == "/readyz":
            _allow(method, "GET", path)
            detail = self._ready()
            response.json(detail, 200 if detail["ready"] else 503)
        elif path == "/metrics" and not self.options.metrics_apart:
            await self._metrics(method, response)
        else:
            raise NotFound(f"No route {path}.")

    async def serve_metrics(self, request: Request, response: Response) -> None:
        """The handler of ``--metrics-port``: ``/metrics`` and ``/healthz``, nothing else."""
        reply = _Responder(response, self._ids.next())
        try:
            if request.path == "/metrics":
                await self._metrics(request.method, reply)
            elif request.path == "/healthz":
                _allow(request.method, "GET", request.path)
                reply.json({"status": "ok"})
            else:
                raise NotFound(f"No route {request.path} on the metrics port.")
        except ApiError as exc:
            reply.error(exc)

    async def _metrics(self, method: str, response: _Responder) -> None:
        _allow(method, "GET", "/metrics")
        body = self.metrics.render() if self.scrape is None else await self.scrape()
        response.send(200, body, METRICS_CONTENT_TYPE)

    # -- inference -----------------------------------------------------------------

    async def _traced(
        self,
        request: Request,
        response: _Responder,
        inference: InferenceRequest,
        api_key: routing_pb2.ApiKey | None,
    ) -> None:
        assert self.tracing is not None
        with self.tracing.request(request.headers, response.id) as span:
            await self._routed(request, response, inference, api_key, span)

    async def _routed(
        self,
        request: Request,
        response: _Responder,
        inference: InferenceRequest,
        api_key: routing_pb2.ApiKey | None,
        span: Span | None,
    ) -> None:
        started = time.perf_counter()
        lora = self.lora
        adapter_on = None
        if lora is not None and lora.known and lora.names_adapter(inference.model):
            workload = self.router.classify(inference, request.path, request.headers, api_key)
            adapter_on = await lora.place(inference.model, workload)
        if self._prepares_inline(inference):
            prepared = self.router.prepare(
                inference,
                path=request.path,
                headers=request.headers,
                api_key=api_key,
                request_id=response.id,
                # keyed when read here; a long prompt always is (never keyed on the loop)
                keys_read=self.options.debug_headers or span is not None,
                adapter_on=adapter_on,
            )
        else:
            prepared = await asyncio.to_thread(
                self.router.prepare,
                inference,
                path=request.path,
                headers=request.headers,
                api_key=api_key,
                request_id=response.id,
                adapter_on=adapter_on,
            )
        decision_s = time.perf_counter() - started
        body = inference.upstream_body(
            # explicit, so that every engine sends usage whichever way it reads the rest
            include_usage=inference.adds_usage,
            cache_salt=prepared.upstream_salt,
        )
        upstream_headers = self._upstream_headers(request.headers, response.id, span)
        exchange = Exchange(inference, prepared, decision_s)
        try:
            await self._exchange(exchange, request.path, response, body, upstream_headers)
        except asyncio.CancelledError:  # the client went away
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
            if lora is not None and prepared.lora_name:
                attempt = exchange.attempt
                lora.routed(prepared.lora_name, attempt.endpoint.ordinal if attempt else None)
            if span is not None:
                describe(span, _span_attributes(exchange), failed=exchange.outcome != "ok")

    def _prepares_inline(self, inference: InferenceRequest) -> bool:
        """Whether routing runs on the event loop: not for a long prompt, nor while the
        model's tokenizer is still to be loaded (file I/O)."""
        if len(inference.raw) > THREAD_PROMPT_CHARS:
            return False
        return self.router.tokenizers.loaded(self.router.tokenizer_spec(inference.model))

    async def _exchange(
        self,
        exchange: Exchange,
        path: str,
        response: _Responder,
        body: bytes,
        upstream_headers: list[tuple[str, str]],
    ) -> None:
        attempt = await self.dispatcher.send(exchange, path, body, upstream_headers)
        exchange.attempt = attempt
        extra = self._debug_headers(exchange.prepared, attempt)
        opened = attempt.opened
        if not opened.streaming:
            response.send_as_is(opened.status, opened.headers + extra if extra else opened.headers,
                                opened.first)  # fmt: skip
            # the client has its answer: the rest is bookkeeping
            self.dispatcher.answered(attempt)
            if exchange.request.kind == "generate":
                exchange.usage = generate_usage_of(opened.first)
            else:
                exchange.usage = usage_of(opened.first)
            opened.release()
            return
        request = exchange.request
        relay: SseRelay | GenerateRelay
        if request.kind == "generate":
            relay = GenerateRelay()
        else:
            strip = request.stream and not request.wants_usage(attempt.endpoint.engine_kind)
            relay = SseRelay(strip_usage=strip)
        try:
            response.start(opened.status, opened.headers + extra)
            full = response.put(relay.feed(opened.first))
            self.dispatcher.answered(attempt)
            if full:
                await response.drain()
            while chunk := await opened.next_chunk():
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
        response.end()

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
        key = self.fleet.catalogue.api_keys().get(digest)
        if key is None or (key.scopes and "inference" not in key.scopes):
            raise Unauthorized("Incorrect API key provided.", code="invalid_api_key")
        return key

    # -- other routes ----------------------------------------------------------------

    async def _models(self) -> dict[str, Any]:
        names = self.fleet.catalogue.served_models()
        cards = await self._cards(names)
        return {"object": "list", "data": [cards[name] for name in names]}

    async def _model(self, name: str) -> dict[str, Any]:
        """One model of :meth:`_models`, or OpenAI's 404 for a model no replica serves."""
        if name not in self.fleet.catalogue.served_models():
            raise NotFound(
                f"The model `{name}` does not exist or you do not have access to it.",
                "model",
                "model_not_found",
            )
        return (await self._cards([name]))[name]

    async def _cards(self, names: list[str]) -> dict[str, dict[str, Any]]:
        """A card per name: its least-loaded replica's (``model_cards.py``)."""
        asked: dict[str, str] = {}
        for name in names:
            ordinal = self.router.least_loaded(name)
            endpoint = self.fleet.replicas.endpoint(ordinal) if ordinal is not None else None
            if endpoint is not None:
                asked[name] = endpoint.base_url
        found = await self.cards.cards(asked) if self.cards is not None else {}
        return {name: found.get(name) or own_card(name) for name in names}

    async def _forward(self, request: Request, response: _Responder) -> None:
        """Any other /v1/* route, or an engine's own route: to the least-loaded replica
        serving the model."""
        api_key = self._authenticate(request.headers)
        fields = _json_fields(request.body)
        model = _model_of(fields, request.query) or self._default_model()
        ordinal = self.router.least_loaded(model)
        endpoint = self.dispatcher.fleet.replicas.endpoint(ordinal) if ordinal is not None else None
        if endpoint is None:
            raise NotFound(f"The model `{model}` does not exist.", "model", "model_not_found")
        query = request.query
        url = endpoint.base_url + request.path + (f"?{query}" if query else "")
        upstream = self.dispatcher.upstream
        headers = self._upstream_headers(request.headers, response.id)
        body = self._salted(request, fields, api_key)
        opened = await upstream.open(request.method, url, body, headers)
        try:
            response.start(opened.status, opened.headers)
            await response.chunk(opened.first)
            while chunk := await opened.next_chunk():
                await response.chunk(chunk)
        finally:
            opened.close()
        response.end()

    def _salted(
        self, request: Request, fields: dict[str, Any], api_key: routing_pb2.ApiKey | None
    ) -> bytes:
        """A forwarded body naming a cache namespace of its own (``/v1/responses``, a
        pooling route...) gets its tenant's salt for it, as inference does
        (``dataplane.routing``); any other body goes on as it came."""
        own = own_namespace(fields, isolating=False)
        if own is None:
            return request.body
        tenant = self.router.tenant_of(request.headers, api_key)
        fields = {**fields, "cache_salt": tenant_salt(tenant or "", own)}
        fields.pop("extra_key", None)
        return _encode(fields)

    def _default_model(self) -> str:
        """The model of a request that names none (no ``model``, null or empty): vLLM
        and SGLang then run the model they serve, so the proxy routes it to the fleet's
        only model and forwards the body as it came; 400 where that is ambiguous."""
        models = self.fleet.catalogue.base_models()
        if len(models) == 1:
            return models[0]
        if models:
            served = ", ".join(models)
            raise BadRequest(f"'model' is required: this proxy serves {served}.", "model")
        if self.fleet.catalogue.canonical_model("") is not None:
            return ""  # static replicas whose models are not known yet: they take any
        raise BadRequest("'model' is required: no replica has said which model it serves.",
                         "model")  # fmt: skip

    def _ready(self) -> dict[str, Any]:
        models = self.fleet.catalogue.served_models()
        age = self.fleet.replicas.age_s()
        fresh = self.options.static or age <= self.options.state_max_age_s
        endpoints = self.fleet.replicas.endpoints()
        detail: dict[str, Any] = {
            "ready": bool(models) and (self.options.static or age != float("inf")),
            "models": models,
            "replicas": len(endpoints),
            "roles": dict(Counter(e.role for e in endpoints)),  # disaggregated P/D
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


def _put_generate(request: Request, kind: Kind) -> bool:
    """SGLang's ``/generate`` takes PUT as POST (sent on as POST: SGLang takes both)."""
    return kind == "generate" and request.method == "PUT"


def _allow(method: str, allowed: str, path: str) -> None:
    if method != allowed and not (method == "HEAD" and allowed == "GET"):  # as Starlette
        raise MethodNotAllowed(
            f"{method} is not allowed on {path}; use {allowed}.",
            headers=((b"allow", b"GET, HEAD" if allowed == "GET" else allowed.encode()),),
        )


def _json_fields(body: bytes) -> dict[str, Any]:
    """A forwarded body's fields, if it is a JSON object (else none: the engine's to
    judge)."""
    if body:
        with contextlib.suppress(BadRequest):
            return decode_object(body)
    return {}


def _model_of(fields: dict[str, Any], query: str) -> str:
    """The model a request other than inference names in its body or query; "" none."""
    model = fields.get("model")
    if isinstance(model, str) and model:
        return model
    values = parse_qs(query).get("model")
    return str(values[0]) if values else ""


class _Responder:
    """The server's :class:`Response` with this request's id (and, for a browser page on
    an allowed origin, the CORS headers) on every answer; once started, errors can no
    longer change the status."""

    __slots__ = ("_response", "_tail", "id")

    def __init__(
        self, response: Response, request_id: str, cors: list[tuple[bytes, bytes]] | None = None
    ) -> None:
        self._response = response
        self.id = request_id
        id_header = (b"x-request-id", request_id.encode("latin-1"))
        self._tail = [id_header, *cors] if cors else [id_header]

    def start(self, status: int, headers: list[tuple[bytes, bytes]]) -> None:
        self._response.start(status, headers + self._tail)

    async def chunk(self, data: bytes) -> None:
        if data:
            await self._response.write(data)

    def put(self, data: bytes) -> bool:
        """Write a piece now; True when the client's buffer is full (then :meth:`drain`)."""
        return self._response.put(data) if data else False

    async def drain(self) -> None:
        await self._response.drain()

    def end(self) -> None:
        self._response.end()

    def send_as_is(self, status: int, headers: list[tuple[bytes, bytes]], body: bytes) -> None:
        """A replica's whole answer, with its own headers."""
        self._response.send(status, headers + self._tail, body)

    def send(self, status: int, body: bytes, content_type: bytes = JSON) -> None:
        self._response.send(status, [(b"content-type", content_type), *self._tail], body)

    def preflight(self, headers: list[tuple[bytes, bytes]]) -> None:
        """A CORS preflight allowed: 200, no body."""
        self._response.send(200, headers + self._tail, b"")

    def json(self, obj: Any, status: int = 200) -> None:
        self.send(status, _encode(obj))

    def error(self, exc: ApiError) -> None:
        if self._response.started:  # the status is out: end the stream with an error event
            if self._response.finished:
                return
            log.warning("stream ended by an error", extra={"id": self.id, "error": exc.message})
            self._response.end(b"data: " + exc.encode() + b"\n\n")
            return
        headers = [(b"content-type", JSON), *exc.headers, *self._tail]
        self._response.send(exc.status, headers, exc.encode())
