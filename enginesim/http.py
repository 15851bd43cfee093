"""The HTTP face of the engine: a raw ASGI app with vLLM's and SGLang's routes.

Raw ASGI on uvicorn + httptools because one ``--instant`` process must serve thousands
of requests a second on a small machine (see ``bench/enginesim_capacity.py``). Routes:

| method | path | what |
|---|---|---|
| POST | ``/v1/completions``, ``/v1/chat/completions`` | OpenAI API, SSE when ``stream`` |
| POST PUT | ``/generate`` (SGLang mode only) | SGLang's native API (``sglang_generate.py``) |
| GET | ``/v1/models`` | the model and its adapters (SGLang mode: also ``/v1/models/{model}``) |
| POST | ``/v1/load_lora_adapter``, ``/v1/unload_lora_adapter`` | adapters (``lora_api.py``) |
| GET | ``/health``, ``/ping`` | 200 while serving |
| POST | ``/tokenize`` (SGLang mode: also ``/v1/tokenize``) | ``{prompt}`` or ``{messages}`` → ids |
| POST | ``/reset_prefix_cache`` (SGLang: ``/flush_cache``, GET too) | drop the cache if idle |
| GET | ``/metrics`` | Prometheus, engine names (``metrics.py``) |
| GET | ``/server_info``, ``/model_info`` (and ``/get_`` aliases) | SGLang router probes |
| GET | ``/get_load``, ``/load`` | queue load (SGLang, vLLM) |
| GET | ``/kv_event_sources`` | vLLM 0.33's event endpoint discovery, ``{rank: KVEventsConfig}`` |
| POST | ``/v1/completions/render``, ``/v1/chat/completions/render`` | token ids of a request |
| GET | ``/version`` | simulator version |
| GET POST DELETE | ``/sim/faults`` | fault injection (``faults.py``), loopback clients only |
| GET | ``/sim/state`` | cached block ids and load, loopback clients only |
| POST | ``/sim/kv_pull`` | a decode engine reads the KV blocks held for it (``pd.py``) |

A route's path with a trailing slash too many or too few is redirected (307) to the
route's own URL, as the engines' FastAPI apps do. Every error is answered in OpenAI's
shape (``protocol.py``); an unexpected exception in a handler is logged and answered 500
without touching the engine's state. With ``--event-format sglang`` the two inference
routes answer by SGLang's rules instead (``sglang_serving.py``, ``sglang_api.py``: its
ids, ``n`` and batches, usage, stream order and error shape), and SGLang's native
``/generate`` is served too (``sglang_generate.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import os
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any
from urllib.parse import quote

import msgspec

from enginesim import protocol as p
from enginesim import sglang_api as sg
from enginesim import sglang_rids as sr
from enginesim.choices import DISCONNECTED, Choices
from enginesim.engine import Engine
from enginesim.errors import RequestRejected
from enginesim.faults import CRASH_EXIT_CODE, FaultUpdate
from enginesim.lora_api import VLLM_LOAD_PATH, VLLM_UNLOAD_PATH, Adapters, LoraAnswer, Route
from enginesim.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from enginesim.pd import PULL_PATH, KvLoadFailed, RemotePrefill
from enginesim.request import LoraTag, SimRequest
from enginesim.settings import SimSettings
from enginesim.sglang_generate import GenerateAnswer, NativeGenerate
from enginesim.sglang_serving import Answer, SglangServing
from enginesim.tokens import PromptTokenizer
from kvcore.tokenize import TokenizerError

log = logging.getLogger(__name__)
MAX_BODY_BYTES = 64 * 1024 * 1024
THREAD_TOKENIZE_CHARS = 8192
VERSION = "kvroute-sim 0.1.0"
JSON = b"application/json"
EVENT_STREAM = b"text/event-stream; charset=utf-8"  # Starlette adds the charset to text/*
_encode = msgspec.json.encode
_URL_SAFE = ":/%#?=@[]!$&'()*+,;"  # what Starlette's RedirectResponse leaves unquoted
_LOOPBACK = ("127.", "::1", "::ffff:127.")

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]


@dataclass
class Request:
    method: str
    path: str
    body: bytes
    client_host: str
    headers: list[tuple[bytes, bytes]]  # the ASGI scope's

    def header(self, name: bytes) -> str | None:
        """The first value of header ``name`` (lower case, as the server gives names),
        decoded as latin-1, as Starlette's ``Headers.get`` reads it."""
        for key, value in self.headers:
            if key == name:
                return value.decode("latin-1")
        return None


@dataclass
class Response:
    status: int
    body: bytes
    content_type: bytes = JSON
    after: Callable[[], None] | None = None
    headers: tuple[tuple[bytes, bytes], ...] = ()  # before content-length, as Starlette's


@dataclass
class EventStream:
    chunks: AsyncIterator[bytes]
    choices: Choices


Result = Response | EventStream
Handler = Callable[[Request], Awaitable[Result]]


def _redirect(url: bytes) -> Handler:
    """Starlette's answer (both engines' servers are FastAPI apps) to a path that is a
    route's but for a trailing slash, whatever the method: 307 to the route's own."""

    async def redirect(_: Request) -> Result:
        return Response(307, b"", content_type=b"", headers=((b"location", url),))

    return redirect


def _refusal(status: HTTPStatus, allow: Sequence[str] = ()) -> Handler:
    """FastAPI's own answer to a path no route serves (404) or a method its route does
    not take (405, with ``allow``): both engines register their error handlers for
    FastAPI's ``HTTPException``, which Starlette's router does not raise, so these reach
    FastAPI's default handler, ``{"detail": <the status phrase>}``. A ``HEAD`` is a 405
    too: FastAPI's routes, unlike Starlette's, do not add it to a ``GET``."""
    body = _encode({"detail": status.phrase})
    headers = ((b"allow", ", ".join(allow).encode()),) if allow else ()

    async def refuse(_: Request) -> Result:
        return Response(status, body, headers=headers)

    return refuse


def _url(scope: Scope, path: str) -> bytes:
    """The request's URL with ``path`` as Starlette builds a redirect's: the scheme, the
    ``Host`` header (else the server's address), the path, the query, quoted whole."""
    host = next((v.decode("latin-1") for k, v in scope["headers"] if k == b"host"), None)
    if host is None:
        server_host, port = scope.get("server") or ("127.0.0.1", 80)
        host = server_host if port == 80 else f"{server_host}:{port}"
    url = f"{scope.get('scheme', 'http')}://{host}{path}"
    query = scope.get("query_string", b"")
    if query:
        url += "?" + query.decode("latin-1")
    return quote(url, safe=_URL_SAFE).encode("latin-1")


def _model_permission(now: int) -> dict[str, Any]:
    """vLLM's ``ModelPermission()`` as its defaults make it."""
    return {
        "id": f"modelperm-{uuid.uuid4().hex}",
        "object": "model_permission",
        "created": now,
        "allow_create_engine": False,
        "allow_sampling": True,
        "allow_logprobs": True,
        "allow_search_indices": False,
        "allow_view": True,
        "allow_fine_tuning": False,
        "organization": "*",
        "group": None,
        "is_blocking": False,
    }


def json_response(obj: Any, status: int = 200) -> Response:
    return Response(status, _encode(obj))


def sse(obj: Any) -> bytes:
    return b"data: " + _encode(obj) + b"\n\n"


class SimApp:
    def __init__(self, settings: SimSettings, engine: Engine, tokenizer: PromptTokenizer):
        self.settings = settings
        self.engine = engine
        self.tokenizer = tokenizer
        self.sglang = SglangServing(self) if settings.event_format == "sglang" else None
        self.native = NativeGenerate(self.sglang) if self.sglang is not None else None
        self.adapters = Adapters(settings, engine)
        self._engine_ids = itertools.count()  # what keeps engine request ids unique
        self.routes: dict[str, dict[str, Handler]] = {}
        self._register()

    def _register(self) -> None:
        info: dict[str, Handler] = {"GET": self.server_info}
        table: dict[str, dict[str, Handler]] = {
            "/v1/completions": {"POST": self.completions},
            "/v1/chat/completions": {"POST": self.chat_completions},
            "/v1/models": {"GET": self.models},
            "/health": {"GET": self.health},
            "/ping": {"GET": self.health},
            "/tokenize": {"POST": self.tokenize},
            "/reset_prefix_cache": {"POST": self.reset_prefix_cache},
            "/metrics": {"GET": self.metrics},
            "/server_info": info,
            "/get_server_info": info,
            "/model_info": {"GET": self.model_info},
            "/get_model_info": {"GET": self.model_info},
            "/get_load": {"GET": self.get_load},
            "/load": {"GET": self.vllm_load},
            "/kv_event_sources": {"GET": self.kv_event_sources},
            "/v1/completions/render": {"POST": self.render_completion},
            "/v1/chat/completions/render": {"POST": self.render_chat},
            "/version": {"GET": self.version},
            "/sim/faults": {"GET": self.faults, "POST": self.faults, "DELETE": self.faults},
            "/sim/state": {"GET": self.state},
            PULL_PATH: {"POST": self.kv_pull},
        }
        if self.sglang is not None:  # SGLang serves both paths with one handler
            table["/v1/tokenize"] = table["/tokenize"]
            del table["/reset_prefix_cache"]  # vLLM's name; SGLang's is /flush_cache
            table["/flush_cache"] = {"GET": self.flush_cache, "POST": self.flush_cache}
            table["/generate"] = {"POST": self.generate, "PUT": self.generate}
        for path, route in self.adapters.routes().items():
            table[path] = {"POST": _adapter_handler(route)}
        self.routes.update(table)

    # -- ASGI ----------------------------------------------------------------------------

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        try:
            handler = self._route(scope)
            client = scope.get("client") or ("", 0)
            body = await _read_body(receive)
            request = Request(scope["method"], scope["path"], body, client[0], scope["headers"])
            if request.path in _JSON_BODY_PATHS and handler is self._served(request):
                _check_json_media(request, self.sglang is not None)
            result = await handler(request)
        except p.ApiError as exc:
            result = json_response(self._error_body(scope["path"], exc), exc.status)
        except Exception:
            log.exception("unexpected error answering %s %s", scope["method"], scope["path"])
            result = json_response(p.ApiError("internal error").body(), 500)
        if isinstance(result, EventStream):
            await self._stream(result, receive, send)
        else:
            await _send_response(result, send)

    def _error_body(self, path: str, exc: p.ApiError) -> dict[str, Any]:
        refused = isinstance(exc, p.MediaTypeRefused)  # SGLang's validation handler's, anywhere
        if self.sglang is not None and (path in _INFERENCE_PATHS or refused):
            return sg.error_body(exc)
        return exc.body()

    def _served(self, request: Request) -> Handler | None:
        """The route's own handler of the request's method, if it has one."""
        return self.routes.get(request.path, {}).get(request.method)

    def _route(self, scope: Scope) -> Handler:
        methods = self.routes.get(scope["path"])
        if methods is None and self.sglang is not None and scope["path"].startswith(_MODEL_PATH):
            methods = {"GET": self.retrieve_model}  # SGLang's /v1/models/{model:path}
        if methods is None:
            path = scope["path"]
            other = path[:-1] if path.endswith("/") else path + "/"
            if path != "/" and other in self.routes:
                return _redirect(_url(scope, other))
            return _refusal(HTTPStatus.NOT_FOUND)
        handler = methods.get(scope["method"])
        if handler is None:
            return _refusal(HTTPStatus.METHOD_NOT_ALLOWED, list(methods))
        return handler

    async def _stream(self, stream: EventStream, receive: Receive, send: Send) -> None:
        headers = [(b"content-type", EVENT_STREAM)]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        watcher = asyncio.create_task(self._watch_disconnect(stream.choices, receive))
        try:
            async for chunk in stream.chunks:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
        except sg.BrokenStream:  # as SGLang's server: uvicorn closes the connection
            for handle in stream.choices.handles:
                self.engine.abort(handle)
            raise
        except Exception:  # the status is sent: end the stream with an error event
            log.exception("unexpected error while streaming %s", stream.choices.request_id)
            for handle in stream.choices.handles:
                self.engine.abort(handle)
            error = sse(p.ApiError("internal error").body()) + b"data: [DONE]\n\n"
            await send({"type": "http.response.body", "body": error, "more_body": True})
        finally:
            watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watcher
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def _watch_disconnect(self, choices: Choices, receive: Receive) -> None:
        while (await receive())["type"] != "http.disconnect":
            continue
        for handle in choices.handles:
            if not handle.done:
                self.engine.abort(handle)
                handle.error = DISCONNECTED
                handle.notify()

    # -- inference -------------------------------------------------------------------------

    async def completions(self, request: Request) -> Result:
        body = p.decode_completion(request.body)
        if self.sglang is not None:
            return _result(await self.sglang.completions(body))
        try:  # vLLM's request validators, before the rest, the last defined first
            given = p.completion_prompts(body, p.MAX_COMPLETION_PROMPTS)
            usage = p.stream_usage(body)
        except p.RequestValidatorError as exc:
            raise exc.with_body(request.body) from None
        rid = _answer_id("cmpl", request, body)
        prompts = await self.prompt_ids(given)
        try:
            choices = await self._submit(rid, prompts, body, ids_given=isinstance(given[0], list))
        except (p.EngineInputError, KvLoadFailed) as exc:  # raised once vLLM's stream began
            if not body.stream:
                raise
            return _stream_error(rid, exc)
        if body.stream:
            return EventStream(self._completion_chunks(choices, usage), choices)
        await choices.until_done()
        texts = choices.texts(self.tokenizer.text_of)
        rid, model = choices.request_id, self._answer_model(choices)
        answer = p.completion_batch_body(rid, model, texts, choices.final_usage())
        return json_response(self._with_transfer(answer, choices))

    async def chat_completions(self, request: Request) -> Result:
        if self.sglang is not None:
            sglang_body = p.decode_body(request.body, sg.ChatRequest)
            override = request.header(sr.OVERRIDE_HEADER)
            return _result(await self.sglang.chat(sglang_body, override))
        body = p.decode_body(request.body, p.ChatRequest)
        try:  # checked first, as vLLM's request validators run
            usage = p.stream_usage(body)
        except p.RequestValidatorError as exc:
            raise exc.with_body(request.body) from None
        rid = _answer_id("chatcmpl", request, body)
        prompt = await self.chat_prompt_ids(body.messages, body.tools, body.add_generation_prompt)
        if body.max_completion_tokens is not None and body.max_tokens is None:
            body.max_tokens = body.max_completion_tokens
        try:
            choices = await self._submit(rid, [prompt], body)
        except KvLoadFailed as exc:
            if not body.stream:
                raise
            return _stream_error(rid, exc)
        if body.stream:
            return EventStream(self._chat_chunks(choices, usage), choices)
        await choices.until_done()
        texts = choices.texts(self.tokenizer.text_of)
        rid, model = choices.request_id, self._answer_model(choices)
        answer = p.chat_body(rid, model, texts, choices.final_usage())
        return json_response(self._with_transfer(answer, choices))

    def _with_transfer(self, answer: dict[str, Any], choices: Choices) -> dict[str, Any]:
        """vLLM's answer to a prefill for a remote decode carries the transfer's
        ``kv_transfer_params`` (``pd.py``)."""
        if choices.handles and choices.handles[0].req.hold_kv:
            answer["kv_transfer_params"] = self.engine.transfers.params_of(choices.handles[0].req)
        return answer

    async def _submit(
        self, rid: str, prompts: list[list[int]], body: p._Sampling, *, ids_given: bool = False
    ) -> Choices:
        """One engine request per prompt and sample of the answer ``rid``, checked in
        vLLM's order: the model, each prompt's length (rendering), the sampling parameters
        (serving), then the token ids of prompts given as ids (the engine's input
        processor, which runs when the request's generator is first read:
        ``EngineInputError``)."""
        lora = self.check_model(body.model)
        p.check_salt(body.cache_salt)
        max_tokens = body.max_tokens or p.DEFAULT_MAX_TOKENS
        try:
            for prompt in prompts:
                self.engine.check(len(prompt), max_tokens)
        except RequestRejected as exc:
            raise p.BadRequest(str(exc)) from exc
        n = p.check_sampling(body.n, body.temperature)
        if ids_given:
            for prompt in prompts:
                p.check_token_ids(prompt, self.tokenizer.max_token_id)
        if self.engine.faults.should_fail():
            raise p.InjectedFailure("Injected failure (kvroute-sim fault).")
        hold, remote = _transfer_role(body.kv_transfer_params)
        chat = isinstance(body, p.ChatRequest)
        reqs = []
        for i, prompt in enumerate(prompts):
            external, unique = rid if chat else f"{rid}-{i}", next(self._engine_ids)
            for j in range(n):
                req_id = _engine_request_id(external, unique, j, n)
                req = SimRequest(
                    req_id, prompt, max_tokens, body.cache_salt, hold_kv=hold, lora=lora
                )
                reqs.append(req)
        if remote is not None:  # a decode: its prompt read before it is queued
            loaded = await self.engine.read_prefill(remote, reqs[0])
            for req in reqs:
                req.loaded = loaded
        try:
            handles = await self.engine.submit_all(reqs, stream=body.stream)
        except RequestRejected as exc:
            raise p.BadRequest(str(exc)) from exc
        return Choices(rid, handles, n, reports_cached=not self.settings.no_cache_report)

    async def _completion_chunks(
        self, choices: Choices, usage: p.UsageAsked
    ) -> AsyncIterator[bytes]:
        rid, model = choices.request_id, self._answer_model(choices)
        generated = [0] * len(choices.handles)  # each choice's tokens so far
        async for delta in choices.deltas(self.tokenizer.text_of):
            if delta is None:
                yield sse(p.ApiError("engine restarted").body())
                break
            choice, pieces, last = delta
            prompt = len(choices.handles[choice].req.prompt)
            for i, piece in enumerate(pieces):
                finish = "length" if last and i == len(pieces) - 1 else None
                generated[choice] += 1
                use = p.running_usage(prompt, generated[choice]) if usage.continuous else None
                yield sse(p.completion_body(rid, model, piece, use, finish, choice))
        else:
            if usage.final:
                yield sse(p.usage_chunk(rid, model, "text_completion", choices.stream_usage()))
        yield b"data: [DONE]\n\n"

    async def _chat_chunks(self, choices: Choices, usage: p.UsageAsked) -> AsyncIterator[bytes]:
        rid, model = choices.request_id, self._answer_model(choices)
        prompt = len(choices.handles[0].req.prompt) if choices.handles else 0
        generated = [0] * len(choices.handles)  # each choice's tokens so far
        roles = []  # no comprehension: no cells in this frame
        for j in range(choices.n):
            start = {"role": "assistant", "content": ""}
            use = p.running_usage(prompt, 0) if usage.continuous else None
            roles.append(sse(p.chat_chunk(rid, model, start, None, use, j)))
        async for delta in choices.deltas(self.tokenizer.text_of):
            if delta is None:
                yield sse(p.ApiError("engine restarted").body())
                break
            # as vLLM and SGLang: the roles come with the first output, after prefill; as
            # vLLM, one event per choice
            for role in roles:
                yield role
            roles = []
            choice, pieces, last = delta
            for i, piece in enumerate(pieces):
                finish = "length" if last and i == len(pieces) - 1 else None
                generated[choice] += 1
                use = p.running_usage(prompt, generated[choice]) if usage.continuous else None
                yield sse(p.chat_chunk(rid, model, {"content": piece}, finish, use, choice))
        else:
            if usage.final:
                totals = choices.stream_usage()
                yield sse(p.usage_chunk(rid, model, "chat.completion.chunk", totals))
        yield b"data: [DONE]\n\n"

    async def generate(self, request: Request) -> Result:
        """SGLang's native ``/generate`` (registered in SGLang mode only)."""
        assert self.native is not None
        return _result(await self.native.generate(request.body))

    # -- prompts ---------------------------------------------------------------------------

    async def prompt_ids(self, given: list[str | list[int]]) -> list[list[int]]:
        """The prompts of a completion request (a batch or one), as token ids."""
        prompts = []
        for prompt in given:  # no comprehension: no cell in the frame
            prompts.append(await self._completion_prompt(prompt))
        return prompts

    async def _completion_prompt(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, list):
            if not prompt:
                raise p.BadRequest("prompt must not be empty.", "prompt")
            return prompt
        return await self._tokenize(lambda: self.tokenizer.encode_prompt(prompt), len(prompt))

    async def chat_prompt_ids(
        self, messages: list[dict[str, Any]], tools: Any, add_generation_prompt: bool
    ) -> list[int]:
        p.check_messages(messages)
        size = sum(len(str(m.get("content", ""))) for m in messages)
        return await self._tokenize(
            lambda: self.tokenizer.encode_chat(
                messages, tools=tools, add_generation_prompt=add_generation_prompt
            ),
            size,
        )

    async def _tokenize(self, work: Callable[[], list[int]], size: int) -> list[int]:
        try:
            if size > THREAD_TOKENIZE_CHARS:
                return await asyncio.to_thread(work)
            return work()
        except TokenizerError as exc:
            raise p.BadRequest(str(exc)) from exc

    def check_model(self, model: str | None) -> LoraTag | None:
        """The adapter a model name is, or None for the base model; 404 for a name not
        served; none, null or empty is the served model's (vLLM's
        ``_is_model_supported`` tests the name's truth)."""
        if not model or model == self.settings.model:
            return None
        lora = self.adapters.use(model)
        if lora is None:
            raise p.NotFound(f"The model `{model}` does not exist.", "model")
        return lora

    def sglang_adapter(self, name: str) -> LoraTag:
        """The adapter an SGLang request names (``base:adapter`` or ``lora_path``)."""
        if not self.adapters.enabled:
            raise sg.lora_disabled(name)
        lora = self.adapters.use(name)
        if lora is None:
            raise sg.lora_not_loaded(name, list(self.adapters.registry.paths()))
        return lora

    def _answer_model(self, choices: Choices) -> str:
        """The model an answer names: the adapter's name for a LoRA request (vLLM's
        ``model_name(lora_request)``)."""
        lora = choices.handles[0].req.lora if choices.handles else None
        return lora.name if lora is not None else self.settings.model

    # -- engine-side routes ----------------------------------------------------------------

    async def models(self, request: Request) -> Result:
        """The engines' ``ModelCard`` (vLLM's ``entrypoints/openai/engine/protocol.py``,
        SGLang's ``entrypoints/openai/protocol.py``), made when asked; vLLM's with one
        default ``ModelPermission`` (``show_available_models``)."""
        now = int(time.time())
        cards = self.adapters.cards(now)
        if self.sglang is None:
            for card in cards:
                card["permission"] = [_model_permission(now)]
        return json_response({"object": "list", "data": [self._model_card(now), *cards]})

    def _model_card(self, now: int) -> dict[str, Any]:
        card: dict[str, Any] = {
            "id": self.settings.model,
            "object": "model",
            "created": now,
            # what tells the engines apart
            "owned_by": "vllm" if self.sglang is None else "sglang",
            "root": self.settings.model,
            "parent": None,
            "max_model_len": self.settings.model_len,
        }
        if self.sglang is None:
            card["permission"] = [_model_permission(now)]
        return card

    async def retrieve_model(self, request: Request) -> Result:
        """SGLang's ``GET /v1/models/{model:path}``: the card of the served model, or its
        404 (the path's rest, decoded, is the name; ``/v1/models/`` asks for '')."""
        model = request.path[len(_MODEL_PATH) :]
        if model != self.settings.model:
            return json_response(sg.model_not_found(model), 404)
        return json_response(self._model_card(int(time.time())))

    async def health(self, request: Request) -> Result:
        return Response(200, b"", content_type=b"")  # vLLM's and SGLang's: no content type

    async def version(self, request: Request) -> Result:
        return json_response({"version": VERSION})

    async def tokenize(self, request: Request) -> Result:
        body = p.decode_body(request.body, p.TokenizeRequest)
        if self.sglang is None:  # SGLang checks no model name
            self.check_model(body.model)
        if body.messages is not None:
            tokens = await self.chat_prompt_ids(
                body.messages, body.tools, body.add_generation_prompt
            )
        elif isinstance(body.prompt, str):
            text = body.prompt
            special = True if body.add_special_tokens is None else body.add_special_tokens
            tokens = await self._tokenize(
                lambda: self.tokenizer.encode_prompt(text, add_special_tokens=special), len(text)
            )
        elif body.prompt is not None:
            tokens = body.prompt
        else:
            raise p.BadRequest("Either prompt or messages is required.", "prompt")
        model_len = self.settings.model_len
        if self.sglang is not None:  # SGLang's TokenizeResponse
            return json_response(
                {"tokens": tokens, "count": len(tokens), "max_model_len": model_len}
            )
        return json_response(
            {"count": len(tokens), "max_model_len": model_len, "tokens": tokens, "token_strs": None}
        )

    async def render_completion(self, request: Request) -> Result:
        body = p.decode_completion(request.body)
        self.check_model(body.model)
        cap = None if self.sglang is not None else p.MAX_COMPLETION_PROMPTS
        try:  # a validator of vLLM's request body
            given = p.completion_prompts(body, cap)
        except p.RequestValidatorError as exc:
            raise exc.with_body(request.body) from None
        prompts = await self.prompt_ids(given)
        return json_response([self._generate_request(t, body, "cmpl") for t in prompts])

    async def render_chat(self, request: Request) -> Result:
        body = p.decode_body(request.body, p.ChatRequest)
        self.check_model(body.model)
        tokens = await self.chat_prompt_ids(body.messages, body.tools, body.add_generation_prompt)
        return json_response(self._generate_request(tokens, body, "chatcmpl"))

    def _generate_request(self, tokens: list[int], body: p._Sampling, prefix: str) -> Any:
        return {
            "request_id": f"{prefix}-{p.random_uuid()}",  # vLLM's: never the client's
            "token_ids": tokens,
            "sampling_params": {"max_tokens": body.max_tokens or p.DEFAULT_MAX_TOKENS},
            "model": self.settings.model,
            "stream": body.stream,
            "cache_salt": body.cache_salt,
        }

    async def reset_prefix_cache(self, request: Request) -> Result:
        if not self.engine.reset_prefix_cache():
            raise p.Conflict("Failed to reset the prefix cache: some blocks are still in use.")
        return Response(200, b"", content_type=b"")  # vLLM's and SGLang's: no content type

    async def flush_cache(self, request: Request) -> Result:
        """SGLang's ``/flush_cache`` (GET or POST): its one plain text, no content type,
        400 instead of 200 when requests are running or waiting (nothing flushed)."""
        status = 200 if self.engine.reset_prefix_cache() else 400
        return Response(status, sg.FLUSH_CACHE_TEXT, content_type=b"")

    async def metrics(self, request: Request) -> Result:
        body = self.engine.metrics.render(self.engine.load())
        return Response(200, body, METRICS_CONTENT_TYPE.encode())

    async def server_info(self, request: Request) -> Result:
        return json_response(_server_info(self.settings, self.engine))

    async def model_info(self, request: Request) -> Result:
        return json_response(
            {
                "model_path": _model_path(self.settings),
                "tokenizer_path": _model_path(self.settings),
                "is_generation": True,
                "served_model_name": self.settings.model,
            }
        )

    async def get_load(self, request: Request) -> Result:
        load = self.engine.load()
        return json_response(
            {
                "dp_rank": 0,
                "load": load.running + load.waiting,
                "num_reqs": load.running + load.waiting,
                "num_waiting_reqs": load.waiting,
                "num_tokens": load.used_tokens,
            }
        )

    async def kv_event_sources(self, request: Request) -> Result:
        publisher = self.engine.publisher
        config = {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": publisher.endpoint,
            "replay_endpoint": publisher.replay_endpoint,
            "buffer_steps": self.settings.replay_buffer_steps,
            "hwm": publisher.config.hwm,
            "max_queue_size": publisher.config.hwm,
            "topic": self.settings.topic,
        }
        return json_response({"0": config})

    async def vllm_load(self, request: Request) -> Result:
        load = self.engine.load()
        return json_response({"server_load": load.running + load.waiting})

    # -- admin -----------------------------------------------------------------------------

    def _admin_only(self, request: Request) -> None:
        if not request.client_host.startswith(_LOOPBACK):
            raise p.Forbidden("The admin API only answers loopback clients.")

    async def faults(self, request: Request) -> Result:
        self._admin_only(request)
        injector = self.engine.faults
        after = None
        if request.method == "DELETE":
            self.engine.apply_faults(injector.clear())
        elif request.method == "POST":
            update = p.decode_body(request.body or b"{}", FaultUpdate)
            self.engine.apply_faults(update)
            if update.crash:
                after = _crash
        return Response(200, _encode(injector.state), after=after)

    async def kv_pull(self, request: Request) -> Result:
        """The side channel of ``pd.py``: a decode engine reads the blocks it names
        (vLLM: by request; SGLang: by bootstrap room, once its prefill is done)."""
        body = p.decode_body(request.body or b"{}", dict[str, Any])
        held = await self.engine.release_transfer(body)
        if held is None:
            raise p.NotFound("No KV blocks are held for this transfer.")
        answer: dict[str, Any] = {"released": True}
        if "bootstrap_room" in body:  # SGLang's metadata buffer: the prefill's cache hit
            answer["cached_tokens"] = held.num_cached_tokens
        return json_response(answer)

    async def state(self, request: Request) -> Result:
        self._admin_only(request)
        pool = self.engine.core.kv
        event_id = self.engine.format.hasher.event_id
        load = self.engine.load()
        return json_response(
            {
                "cached_block_hashes": sorted(event_id(d) for d in pool.cached_digests()),
                "num_blocks": pool.num_blocks,
                "usable_blocks": pool.capacity_blocks,  # vLLM: all but the null block
                "num_free_blocks": pool.num_free,
                "running": load.running,
                "waiting": load.waiting,
                "kv_transfers_held": self.engine.transfers.num_held,
                "kv_blocks_read": self.engine.transfers.blocks_read,
                "event_endpoint": self.engine.publisher.endpoint,
                "replay_endpoint": self.engine.publisher.replay_endpoint,
            }
        )


_INFERENCE_PATHS = ("/v1/completions", "/v1/chat/completions")
_MODEL_PATH = "/v1/models/"
# the routes both engines guard with their ``validate_json_request`` dependency
_JSON_BODY_PATHS = frozenset(
    {*_INFERENCE_PATHS, "/tokenize", "/v1/tokenize", VLLM_LOAD_PATH, VLLM_UNLOAD_PATH}
)


def _adapter_handler(route: Route) -> Handler:
    async def handle(request: Request) -> Result:
        answer: LoraAnswer = await route(request.body)
        return Response(answer.status, answer.body, answer.content_type)

    return handle


def _check_json_media(request: Request, sglang: bool) -> None:
    """:class:`~enginesim.protocol.MediaTypeRefused` unless the body is declared JSON."""
    content_type = request.header(b"content-type")
    if p.declares_json(content_type):
        return
    if content_type is None:  # FastAPI parses an undeclared body as JSON first
        try:
            msgspec.json.decode(request.body)
        except (msgspec.DecodeError, RecursionError):
            return  # the route's own parse error answers it
    raise p.MediaTypeRefused(sglang)


def _stream_error(rid: str, exc: p.ApiError) -> EventStream:
    """vLLM's stream of a request that failed in the engine: the status was sent, so
    an error event, then the end."""
    error = b"data: " + json.dumps(exc.body()).encode() + b"\n\n"  # json.dumps's
    nothing = Choices(rid, [])  # nothing was queued
    return EventStream(_events(error, b"data: [DONE]\n\n"), nothing)


async def _events(*events: bytes) -> AsyncIterator[bytes]:
    for event in events:
        yield event


def _result(answer: Answer | GenerateAnswer) -> Result:
    if isinstance(answer, dict | list):
        return json_response(answer)
    return EventStream(*answer)


def _crash() -> None:
    log.error("crash requested through /sim/faults")
    os._exit(CRASH_EXIT_CODE)


def _answer_id(prefix: str, request: Request, body: p._Sampling) -> str:
    """The ``id`` of every answer and chunk to ``request``: ``cmpl-`` or ``chatcmpl-``,
    then :func:`protocol.base_request_id` (from ``X-Request-Id`` or the body)."""
    return f"{prefix}-{p.base_request_id(request.header(b'x-request-id'), body.request_id)}"


def _transfer_role(params: dict[str, Any] | None) -> tuple[bool, RemotePrefill | None]:
    """What a request's ``kv_transfer_params`` make of it (``pd.py``): whether it is a
    prefill whose blocks are held for a decode engine, and, for a decode, the blocks to
    read (``KvLoadFailed`` when they are not named)."""
    if not params:
        return False, None
    if params.get("do_remote_prefill"):
        return False, RemotePrefill.parse(params)
    return bool(params.get("do_remote_decode")), None


def _engine_request_id(external: str, unique: int, sample: int, n: int) -> str:
    """vLLM's ids: ``external`` is the answer's id, with ``-{i}`` for prompt ``i`` of a
    completion request (a batch or not); v1's ``InputProcessor.assign_request_id`` adds
    ``-`` and 8 random characters, since two requests may share an ``X-Request-Id`` (the
    simulator: the counter value ``unique`` in 8 or more hex digits, unique without
    chance); and sample ``j`` of ``n > 1`` is ``{j}_`` before that (``ParentRequest``)."""
    internal = f"{external}-{unique:08x}"
    return f"{sample}_{internal}" if n > 1 else internal


def _model_path(settings: SimSettings) -> str:
    return settings.tokenizer if os.path.isdir(settings.tokenizer) else settings.model


def _server_info(settings: SimSettings, engine: Engine) -> dict[str, Any]:
    host, _, port = engine.publisher.endpoint.rpartition(":")
    kv_events: dict[str, Any] = {
        "publisher": "zmq",
        "endpoint_host": host.removeprefix("tcp://"),
        "endpoint_port_base": int(port) if port.isdigit() else None,
        "topic": settings.topic,
        "block_size": settings.block_size,
        "dp_size": 1,
    }
    if engine.publisher.replay_endpoint:
        replay_port = engine.publisher.replay_endpoint.rpartition(":")[2]
        kv_events["replay_endpoint_port_base"] = int(replay_port)
    return {
        "model_path": _model_path(settings),
        "tokenizer_path": _model_path(settings),
        "served_model_name": settings.model,
        "page_size": settings.block_size,
        "max_total_num_tokens": settings.pool_tokens,
        "max_running_requests": settings.max_num_seqs,
        "context_length": settings.model_len,
        "kv_events": kv_events,
        "disaggregation_mode": settings.disaggregation_mode,
        "disaggregation_bootstrap_port": engine.transfers.port,  # the simulator's: HTTP's
        "disaggregation_decode_enable_radix_cache": (
            settings.disaggregation_decode_enable_radix_cache
        ),
        "disable_radix_cache": settings.disable_radix_cache,  # resolved, as SGLang reports it
        "version": VERSION,
    }


async def _read_body(receive: Receive) -> bytes:
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise p.BadRequest("client disconnected")
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            raise p.PayloadTooLarge(f"Request body larger than {MAX_BODY_BYTES} bytes.")
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks) if len(chunks) != 1 else chunks[0]


async def _send_response(response: Response, send: Send) -> None:
    headers = [*response.headers, (b"content-length", str(len(response.body)).encode())]
    if response.content_type:
        headers.append((b"content-type", response.content_type))
    await send({"type": "http.response.start", "status": response.status, "headers": headers})
    await send({"type": "http.response.body", "body": response.body})
    if response.after is not None:
        asyncio.get_running_loop().call_soon(response.after)
