"""The OpenAI answers of SGLang's server, for ``--event-format sglang``.

SGLang (0.5.23) answers the same routes as vLLM with other rules; the simulator follows
them in SGLang mode. Facts, with where they were read (``python/sglang/srt/``):

- **Request ids** are ``uuid4().hex``, one per engine request (``managers/io_struct.py``,
  ``GenerateReqInput._normalize_single_inputs`` / ``_normalize_rid``;
  ``regenerate_rid`` gives each sample of ``n > 1`` its own), unless the client named
  the request (its ``rid``, or a chat's ``x-override-rid`` header where SGLang is told
  to read it: ``sglang_rids``, which keeps those facts). A whole answer carries the
  first engine request's id (``ret[0]["meta_info"]["id"]`` in
  ``serving_completions._build_completion_response`` and
  ``serving_chat._build_chat_response``); a streamed chunk carries the id of the engine
  request whose output it is; the closing chunks (chat's finish chunks, the usage chunk)
  carry the id of the last output seen (``content["meta_info"]["id"]`` after the loop).
- **n > 1** (``managers/tokenizer_manager.py``, ``_handle_batch_request``): per prompt, in
  turn, a warm-up request with ``max_new_tokens = 0`` is sent and awaited ("cache the
  common prefix"), then ``n`` samples per prompt are sent; choice ``i * n + j`` is
  prompt ``i``, sample ``j`` (``_stream_batch_responses`` indexes by rid order). No check
  of ``n`` exists: no bound, no refusal of greedy sampling, nothing for ``n`` with a
  batch or a stream. ``n < 1`` runs as one request and then trips the usage sums (below).
- **usage** (``entrypoints/openai/usage_processor.py``): ``prompt_tokens`` sums the first
  sample of each prompt (``range(0, len(ret), n)``, or ``index % n == 0`` streamed);
  ``completion_tokens`` sums every choice; ``prompt_tokens_details.cached_tokens`` sums
  the first sample of each prompt, reported with ``--enable-cache-report`` and only when
  not 0 (``UsageProcessor._details_if_cached``: null otherwise; the simulator reports as
  that flag makes SGLang report); ``reasoning_tokens`` 0 is always there, and
  ``completion_tokens_details`` is null. So ``n = 0`` fails a whole answer with
  ``range()``'s ValueError, and ``n < 0`` counts no prompt tokens; streamed, ``n = 0``
  fails the usage chunk with ZeroDivisionError ("integer modulo by zero": Python 3.12's
  words), an error event in a completion stream, a broken connection in a chat stream.
- **Shapes** (``entrypoints/openai/protocol.py``, ``sse_utils.py``): choices carry
  ``matched_stop`` (no ``stop_reason``); a chat message carries ``reasoning_content``; a
  whole answer ends with ``metadata`` (``utils/weight_versions.py``,
  ``build_endpoint_weight_version_metadata``: weight version ``default``, one span over
  the first choice's output). A completion chunk has ``"usage": null``; its usage chunk
  is dumped without nulls. Chat chunks are msgspec structs (``sse_utils.StreamChunk``):
  no ``usage`` key, ``reasoning_content`` always present in the delta.
- **Chat stream order** (``serving_chat._generate_chat_stream``): a choice's role chunk
  comes with its first output, its content chunks carry no finish reason, and after the
  last output one finish chunk per choice, in the order they finished.
- **stream_options** (``protocol.StreamOptions``, ``utils.should_include_usage``):
  ``include_usage`` defaults to false, so ``{}`` or ``null`` asks for no usage chunk; no
  check ties stream_options to ``stream``. ``continuous_usage_stats`` is read on its own,
  whatever ``include_usage`` says: each content chunk then carries its choice's usage so
  far (``UsageProcessor.calculate_token_usage`` on that choice's prompt and completion
  tokens; ``total_tokens`` before ``completion_tokens``). A completion stream puts it on
  every chunk, the one with the finish reason too, without ``prompt_tokens_details``
  (``serving_completions._generate_completion_stream``); a chat stream puts it on its
  content chunks alone, not on a role or finish chunk, with the choice's cached tokens
  under ``--enable-cache-report`` (``serving_chat._generate_stream_content``,
  ``_continuous_usage_cached_details``), so a choice that outputs no text has none.
- **Model names** (``serving_base._parse_model_parameter``, ``protocol``'s
  ``DEFAULT_MODEL_NAME``): not checked; every answer names the request's ``model``, or
  ``"default"`` without one. A name with a colon selects a LoRA adapter (what follows
  the served name and a colon, else what follows the first colon; stripped, and none
  when empty), which a server launched without ``--enable-lora`` refuses with a 400
  ``BadRequestError`` (``tokenizer_manager._validate_and_resolve_lora``, after the
  prompt is rendered, before its length and sampling checks); the simulator has no
  adapters, so it refuses every one so.
- **Errors** (``serving_base.create_error_response``, ``http_server``'s
  ``RequestValidationError`` handler): ``{"object": "error", "message", "type", "param",
  "code"}`` at the top level, status 400. The type is ``"Bad Request"`` for a body that
  does not validate, ``"BadRequest"`` for a ValueError raised while serving,
  ``"BadRequestError"`` for ``_validate_request`` and the tokenizer manager's refusals.
  Mid-stream, ``create_streaming_error_response``: ``{"error": {...}}`` by ``json.dumps``.
  Not simulated: FastAPI's wording of a body that does not validate (the simulator's is
  msgspec's), and the 500 (Starlette's, text/plain) of a chat body that is JSON but not
  an object, on which the chat request's validators crash (the simulator answers 400).
- **Prompts** (``serving_completions._validate_request``): "Prompt cannot be empty" for
  a falsy prompt or one whose items are all falsy (``[0]`` too); no bound on the number
  of prompts; token ids are not checked against the vocabulary anywhere (neither there
  nor in ``tokenizer_manager._validate_one_request``), so the simulator serves any id it
  can hash (SGLang hashes pages as uint32) and refuses others as its own limit.
- **Lengths** (``tokenizer_manager._validate_one_request``): an input of at least the
  context length is refused, then input + ``max_new_tokens`` above it, each with its
  own message; a chat request without ``max_tokens`` has no ``max_new_tokens`` and is
  only bounded by the context.
- **Sampling** (``sampling/sampling_params.py``, ``verify``): of what the simulator
  reads, a negative or non-finite temperature is refused, then a negative
  ``max_new_tokens``.
- **max_tokens 0**: a completion refuses it (its request's ``max_tokens must be
  positive`` validator: a body that does not validate), a chat serves it: its
  ``max_tokens`` and ``max_completion_tokens`` are any integers, the engine request gets
  ``max_completion_tokens or max_tokens`` and runs prefill only (as SGLang's own n > 1
  warm-ups do), and the answer has empty content, finish reason ``length`` and no
  completion tokens; streamed, a role chunk, the finish chunk and no content chunk.
"""

from __future__ import annotations

import json
import math
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

import msgspec

from enginesim import protocol as p
from enginesim.choices import Choices

WEIGHT_VERSION = "default"  # ``--weight-version``'s default
DEFAULT_MODEL_NAME = "default"  # a request's ``model`` when it names none
MAX_HASHED_TOKEN_ID = 2**32  # pages are hashed as uint32: the simulator's own bound
_encode = msgspec.json.encode
_DONE = b"data: [DONE]\n\n"


def request_id() -> str:
    return uuid.uuid4().hex


class BrokenStream(Exception):
    """An exception SGLang's stream does not catch (chat's ``_generate_chat_stream``
    catches only ValueError): the server closes the connection mid-stream, with no
    error event and no ``[DONE]``."""


# -- checks ---------------------------------------------------------------------------


def check_prompt(prompt: object) -> None:
    """``serving_completions._validate_request``, on the prompt as sent."""
    if not prompt or (isinstance(prompt, list) and all(not item for item in prompt)):
        raise p.BadRequest("Prompt cannot be empty", sglang_type="BadRequestError")


def check_messages(messages: Sequence[object]) -> None:
    """``serving_chat._validate_request``."""
    if not messages:
        raise p.BadRequest("Messages cannot be empty.", sglang_type="BadRequestError")


def check_token_ids(prompt: Sequence[int]) -> None:
    """No engine check: only what the simulator cannot hash is refused."""
    if min(prompt) < 0 or max(prompt) >= MAX_HASHED_TOKEN_ID:
        bad = min(prompt) if min(prompt) < 0 else max(prompt)
        raise p.BadRequest(
            f"Token id {bad} cannot be served by kvroute-sim: SGLang hashes token ids as uint32.",
            sglang_type="BadRequestError",
        )


def check_length(prompt_len: int, max_tokens: int | None, context_len: int) -> None:
    """``tokenizer_manager._validate_one_request`` (no auto-truncation)."""
    if prompt_len >= context_len:
        raise p.BadRequest(
            f"The input ({prompt_len} tokens) is longer than the model's context length "
            f"({context_len} tokens).",
            sglang_type="BadRequestError",
        )
    if max_tokens is not None and prompt_len + max_tokens > context_len:
        raise p.BadRequest(
            "Requested token count exceeds the model's maximum context length of "
            f"{context_len} tokens. You requested a total of {prompt_len + max_tokens} "
            f"tokens: {prompt_len} tokens from the input messages and {max_tokens} tokens "
            "for the completion. Please reduce the number of tokens in the input messages "
            "or the completion to fit within the limit.",
            sglang_type="BadRequestError",
        )


def check_temperature(temperature: float | None) -> None:
    """``SamplingParams.verify``'s temperature check, the only one the simulator reads."""
    if temperature is not None and (not math.isfinite(temperature) or temperature < 0.0):
        raise p.BadRequest(
            f"temperature must be a non-negative finite number, got {temperature}.",
            sglang_type="BadRequestError",
        )


def check_n(n: int | None) -> int:
    """A chat's ``n`` is ``int = 1`` in SGLang's protocol: null does not validate."""
    if n is None:
        raise p.BadRequest(
            "Invalid request: Expected `int`, got `null` - at `$.n`", sglang_type="Bad Request"
        )
    return n


def check_max_new_tokens(max_tokens: int | None) -> None:
    """``SamplingParams.verify``'s ``max_new_tokens`` check (after the temperature's)."""
    if max_tokens is not None and max_tokens < 0:
        raise p.BadRequest(
            f"max_new_tokens must be at least 0, got {max_tokens}.", sglang_type="BadRequestError"
        )


def adapter_named(model: str | None, served: str) -> str | None:
    """``_parse_model_parameter``'s adapter: what follows ``base:``, if anything."""
    if model is None or ":" not in model or model == served:
        return None
    named = model[len(served) + 1 :] if model.startswith(f"{served}:") else model.split(":", 1)[1]
    return named.strip() or None


def lora_disabled(adapter: str) -> p.BadRequest:
    """``_validate_and_resolve_lora`` on a server without ``--enable-lora``."""
    return p.BadRequest(
        f"LoRA adapter '{adapter}' was requested, but LoRA is not enabled. Please launch "
        "the server with --enable-lora flag and preload adapters using --lora-paths or "
        "/load_lora_adapter endpoint.",
        sglang_type="BadRequestError",
    )


def lora_not_loaded(adapter: str, loaded: Sequence[str]) -> p.BadRequest:
    """``_resolve_lora_path`` for an adapter never loaded (or unloaded)."""
    return p.BadRequest(
        f"Got LoRA adapter that has never been loaded: {adapter}\n"
        f"All loaded adapters: {list(loaded)}.",
        sglang_type="BadRequestError",
    )


class ChatRequest(p.ChatRequest, kw_only=True):
    """SGLang's chat request: ``max_tokens`` and ``max_completion_tokens`` are any
    integers (0 runs prefill only; a negative one fails ``SamplingParams.verify``)."""

    max_tokens: int | None = None
    max_completion_tokens: int | None = None


class StreamOptions(msgspec.Struct):
    """SGLang's: ``include_usage`` is false unless given true."""

    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False


def stream_usage(body: p._Sampling) -> p.UsageAsked:
    """``should_include_usage``: a usage chunk only when ``include_usage`` is true, and
    usage on content chunks whenever ``continuous_usage_stats`` is."""
    if body.stream_options == p.NULL:
        return p.NO_USAGE
    try:
        options = msgspec.json.decode(body.stream_options, type=StreamOptions | None)
    except msgspec.ValidationError as exc:
        raise p.field_error(exc, "stream_options") from None
    if options is None:
        return p.NO_USAGE
    return p.UsageAsked(options.include_usage is True, bool(options.continuous_usage_stats))


# -- errors ---------------------------------------------------------------------------


FLUSH_CACHE_TEXT = (
    b"Cache flushed.\nPlease check backend logs for more details. "
    b"(When there are running or waiting requests, the operation will not be performed.)\n"
)
"""``/flush_cache``'s answer, whether or not it flushed (its status says which)."""


def model_not_found(model: str) -> dict[str, Any]:
    """``GET /v1/models/{model}``'s 404 body for a model this server does not serve."""
    message = f"The model '{model}' does not exist"
    return {
        "error": {
            "message": message,
            "type": "invalid_request_error",
            "param": "model",
            "code": "model_not_found",
        }
    }


def error_body(exc: p.ApiError) -> dict[str, Any]:
    return {
        "object": "error",
        "message": exc.message,
        "type": exc.sglang_type or _TYPES.get(exc.status, str(exc.status)),
        "param": None,
        "code": exc.status,
    }


_TYPES = {400: "BadRequestError", 500: "InternalServerError"}


def stream_error(message: str, error_type: str, code: int) -> bytes:
    """``create_streaming_error_response``: ``json.dumps``, so with spaces."""
    error = {"object": "error", "message": message, "type": error_type, "param": None}
    return b"data: " + json.dumps({"error": {**error, "code": code}}).encode() + b"\n\n"


# -- usage ----------------------------------------------------------------------------


def usage(choices: Choices, n: int, *, streamed: bool) -> dict[str, Any]:
    """``UsageProcessor``'s sums over ``choices``; ``n`` as the request gave it."""
    handles = choices.handles
    if streamed:  # ``index % n == 0``
        if n == 0:
            raise ZeroDivisionError("integer modulo by zero")
        firsts = [h for k, h in enumerate(handles) if k % n == 0]
    else:  # ``range(0, len(ret), n)``
        if n == 0:
            raise p.BadRequest("range() arg 3 must not be zero", sglang_type="BadRequest")
        firsts = handles[::n] if n > 0 else []
    prompt = sum(len(h.req.prompt) for h in firsts)
    completion = sum(len(h.req.output) for h in handles)
    cached = choices.reported(sum(h.req.num_cached_tokens for h in firsts))
    return usage_info(prompt, completion, cached)


def usage_info(prompt: int, completion: int, cached: int | None) -> dict[str, Any]:
    """``UsageInfo`` as SGLang dumps it: of a whole answer, a usage chunk, or with
    ``continuous_usage_stats`` a content chunk's choice so far (``cached``: ``None`` where
    no cached tokens are reported: a completion stream's content chunks)."""
    return {
        "prompt_tokens": prompt,
        "total_tokens": prompt + completion,
        "completion_tokens": completion,
        "prompt_tokens_details": {"cached_tokens": cached} if cached else None,  # None or 0
        "reasoning_tokens": 0,
        "completion_tokens_details": None,
    }


def _metadata(output_tokens: int) -> dict[str, Any]:
    span = {"version": WEIGHT_VERSION, "start": 0, "end": output_tokens}
    return {"weight_version": WEIGHT_VERSION, "weight_versions": [span]}


# -- whole answers --------------------------------------------------------------------


def completion_body(
    choices: Choices, n: int, model: str, text_of: Callable[[list[int]], str]
) -> dict[str, Any]:
    items = [
        _text_choice(k, text_of(h.req.output), "length") for k, h in enumerate(choices.handles)
    ]
    return _whole(choices, n, "text_completion", model, items)


def chat_body(
    choices: Choices, n: int, model: str, text_of: Callable[[list[int]], str]
) -> dict[str, Any]:
    items = []
    for k, handle in enumerate(choices.handles):
        message = {"role": "assistant", "content": text_of(handle.req.output)}
        items.append({"index": k, "message": {**message, "reasoning_content": None}, **_ENDED})
    return _whole(choices, n, "chat.completion", model, items)


_ENDED = {"logprobs": None, "finish_reason": "length", "matched_stop": None}


def _text_choice(k: int, text: str, finish: str | None) -> dict[str, Any]:
    return {
        "index": k,
        "text": text,
        "logprobs": None,
        "finish_reason": finish,
        "matched_stop": None,
    }


def _whole(
    choices: Choices, n: int, obj: str, model: str, items: list[dict[str, Any]]
) -> dict[str, Any]:
    use = usage(choices, n, streamed=False)
    body = _chunk(choices.request_id, obj, model, items)  # the first engine request's
    return {**body, "usage": use, "metadata": _metadata(len(choices.handles[0].req.output))}


# -- streams --------------------------------------------------------------------------


def answer_id(choices: Choices, k: int) -> str:
    """The ``id`` of choice ``k``'s chunks: its engine request's rid, the client's name
    for it if it has one (``sglang_rids``)."""
    named = choices.answer_ids
    return named[k] if named is not None else choices.handles[k].req.request_id


def _chunk(rid: str, obj: str, model: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "id": rid,
        "object": obj,
        "created": int(time.time()),
        "model": model,
        "choices": choices,
    }


def _sse(obj: Any) -> bytes:
    return b"data: " + _encode(obj) + b"\n\n"


async def completion_chunks(
    choices: Choices,
    n: int,
    model: str,
    text_of: Callable[[list[int]], str],
    asked: p.UsageAsked,
) -> AsyncIterator[bytes]:
    """``serving_completions._generate_completion_stream``."""
    rid = choices.request_id
    sent = [0] * len(choices.handles)
    async for delta in choices.deltas(text_of):
        if delta is None:
            yield stream_error("engine restarted", "InternalServerError", 500)
            break
        k, pieces, last = delta
        req = choices.handles[k].req
        rid = answer_id(choices, k)
        for i, piece in enumerate(pieces):
            finish = "length" if last and i == len(pieces) - 1 else None
            item = _text_choice(k, piece, finish)
            sent[k] += 1
            use = usage_info(len(req.prompt), sent[k], None) if asked.continuous else None
            yield _sse({**_chunk(rid, "text_completion", model, [item]), "usage": use})
    else:
        if asked.final:
            try:
                use = usage(choices, n, streamed=True)
            except ZeroDivisionError as exc:  # the stream has started: an error event
                yield stream_error(str(exc), "BadRequestError", 400)
            else:
                del use["completion_tokens_details"]  # dumped with exclude_none
                yield _sse({**_chunk(rid, "text_completion", model, []), "usage": use})
    yield _DONE


def _chat_choice(k: int, delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
    return {
        "index": k,
        "delta": {"reasoning_content": None, **delta},
        "logprobs": None,
        "finish_reason": finish,
        "matched_stop": None,
    }


async def chat_chunks(
    choices: Choices,
    n: int,
    model: str,
    text_of: Callable[[list[int]], str],
    asked: p.UsageAsked,
) -> AsyncIterator[bytes]:
    """``serving_chat._generate_chat_stream``."""
    obj = "chat.completion.chunk"
    rid = choices.request_id
    started: set[int] = set()
    finished: list[int] = []
    sent = [0] * len(choices.handles)
    async for delta in choices.deltas(text_of):
        if delta is None:
            yield stream_error("engine restarted", "InternalServerError", 500)
            break
        k, pieces, last = delta
        req = choices.handles[k].req
        rid = answer_id(choices, k)
        if k not in started:
            started.add(k)
            role = _chat_choice(k, {"role": "assistant", "content": ""})
            yield _sse(_chunk(rid, obj, model, [role]))
        for piece in pieces:
            chunk = _chunk(rid, obj, model, [_chat_choice(k, {"content": piece})])
            sent[k] += 1
            if asked.continuous:  # a msgspec struct's usage: left out when null
                cached = choices.reported(req.num_cached_tokens)
                chunk["usage"] = usage_info(len(req.prompt), sent[k], cached)
            yield _sse(chunk)
        if last:
            finished.append(k)
    else:
        for k in finished:
            yield _sse(_chunk(rid, obj, model, [_chat_choice(k, {}, "length")]))
        if asked.final:
            try:
                use = usage(choices, n, streamed=True)
            except ZeroDivisionError as exc:  # uncaught by SGLang's chat stream
                raise BrokenStream(str(exc)) from exc
            else:
                yield _sse({**_chunk(rid, obj, model, []), "usage": use})
    yield _DONE
