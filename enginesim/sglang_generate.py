"""SGLang's native ``POST /generate`` (``PUT`` too), for ``--event-format sglang``.

RL rollout frameworks and SGLang's own router talk to SGLang through ``/generate``, not
its OpenAI routes, so a simulated SGLang must serve it. A request runs through the same
engine requests as a completion (``SglangServing.start``: the rid checks, ``n > 1``'s
warm-ups, the scheduler, the cache, KV events and metrics); only its body and answer
differ. Facts from SGLang 0.5.23 (``python/sglang/srt/``), with where they were read:

- **The route** (``entrypoints/http_server.py``, ``generate_request``): POST or PUT, the
  body a ``GenerateReqInput`` (no ``validate_json_request``, unlike the OpenAI routes).
  Whole: ``tokenizer_manager.generate_request(...).__anext__()`` as JSON; a
  ``ValueError`` becomes ``_create_error_response``: 400, ``{"error": {"message"}}``.
  Streamed: a ``StreamingResponse`` (``text/event-stream``) of ``b"data: " +
  orjson.dumps(out) + b"\\n\\n"`` per output, then ``data: [DONE]``; the generator runs
  only once the 200 is sent, so every ``ValueError`` of the request (its inputs, rids,
  lengths, sampling) is an event ``{"error": {"message"}}`` before ``[DONE]``, status 200.
  A body that does not validate is FastAPI's ``RequestValidationError``, before any of
  it: 400 in the OpenAI routes' error shape (type ``Bad Request``); an abort with a 500
  status is an ``HTTPException``: ``{"object": "error", ..., "type": "500"}``.
- **Inputs** (``managers/io_struct.py``, ``GenerateReqInput``): ``text`` (a string or a
  list of strings) or ``input_ids`` (a list of ints or of int lists).
  ``_validate_inputs`` refuses none of ``text``, ``input_ids`` and ``input_embeds``
  ("Either text, input_ids or input_embeds should be provided."), and all three at
  once, but not ``text`` with ``input_ids``: ``_determine_batch_size`` then takes the
  batch's shape from ``text`` and ``_tokenize_one_request`` the tokens from
  ``input_ids``. ``[]`` as ``input_ids``: "input_ids cannot be empty."; a list of texts
  is a batch (``[]``: no request, the answer ``[]``); an empty text fails tokenization
  (``_tokenize_texts``: "texts cannot be empty and tokenizer must be initialized");
  ``input_embeds`` alone needs ``--disable-radix-cache`` (refused with SGLang's words).
- **Tokenization** (``managers/tokenizer_manager.py``, ``_tokenize_texts``): the model's
  tokenizer, ``tokenizer.encode(t)`` or ``tokenizer(texts)``, so special tokens as the
  tokenizer adds them by default: what the OpenAI completion route does with a text
  ``prompt`` (``serving_completions`` passes it as ``text``), so both hit the same blocks.
- **sampling_params** (``sampling/sampling_params.py``, ``SamplingParams``):
  ``max_new_tokens`` 128 by default, null for no bound but the context; ``n`` 1
  (``_handle_parallel_sampling``: ``n > 1`` makes even one prompt a batch, with a
  warm-up per prompt, as ``sglang_api`` says); ``temperature``, ``ignore_eos``;
  ``verify`` refuses a negative or non-finite temperature, then a negative
  ``max_new_tokens``, after ``_validate_one_request``'s two length checks.
- **Answers** (``tokenizer_manager._handle_batch_output`` and ``_wait_one_response``):
  ``{"text", "output_ids", "meta_info"}``; ``meta_info`` in this order: ``id`` (the
  rid), ``finish_reason`` (``{"type": "length", "length": max_new_tokens}``, null until
  the end), ``prompt_tokens``, ``weight_version``, ``num_retractions``,
  ``reasoning_tokens``, ``completion_tokens``, ``cached_tokens`` (the prefix-cache hit),
  ``weight_versions`` (the spans, on the last output only:
  ``utils/weight_versions.py``, ``add_weight_versions_to_meta_info``),
  ``cached_tokens_details`` (``{"device": cached, "host": 0}``, null when nothing was
  cached: the scheduler's ``_get_cached_tokens_details``), ``dp_rank`` (null), then
  ``e2e_latency`` at the end and ``response_sent_to_client_ts`` on the first output
  sent (``_wait_one_response``). A batch (several prompts, or ``n > 1``) answers a list
  in rid order (``_collect_batch_responses``); its stream's outputs carry ``"index"``
  after ``meta_info`` (``_stream_batch_responses``). Streams are cumulative:
  ``incremental_streaming_output`` is off by default, so each output carries the whole
  ``text`` and ``output_ids`` so far. The recorded outputs in
  ``rust/sglang-processor/tests/fixtures/openai_parity/`` show the same keys and order.

Not simulated: logprobs (``return_logprob`` true is refused, in ``/generate``'s shape,
rather than answered without them), a list of ``sampling_params`` (one per prompt;
refused), sampling keys other than those above (ignored; SGLang's ``SamplingParams``
fails an unknown one with a 500), a batch with ``n < 1`` (SGLang fails it with a 500;
served as ``n = 1`` unless it names a rid), a 500's plain text (Starlette's, for
SGLang's own crashes: a single prompt's list of rids; answered as an ``HTTPException``
is here), an ``input_ids`` list holding an empty prompt (refused), the timing fields
``--enable-metrics`` adds to ``meta_info``, LoRA, multimodal inputs, sessions, and
``text`` and ``input_ids`` of different shapes (refused in the simulator's own words).
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable
from typing import Any, NamedTuple

import msgspec

from enginesim import protocol as p
from enginesim import sglang_api as sg
from enginesim import sglang_rids as sr
from enginesim.choices import Choices
from enginesim.pd import Bootstrap
from enginesim.sglang_serving import Sampling, SglangServing

DEFAULT_MAX_NEW_TOKENS = 128  # ``SamplingParams.max_new_tokens``
_encode = msgspec.json.encode
_DONE = b"data: [DONE]\n\n"

Prompts = list[str] | list[list[int]]
TextOf = Callable[[list[int]], str]
GenerateAnswer = dict[str, Any] | list[dict[str, Any]] | tuple[AsyncIterator[bytes], Choices]
"""A whole answer (one output, or a batch's list), or a stream's events and requests."""


class GenerateError(p.ApiError):
    """A refusal in the shape SGLang's server gives ``/generate``'s: ``body()`` is it."""

    def __init__(self, status: int, body: dict[str, Any]) -> None:
        super().__init__(str(body))
        self.status = status
        self._body = body

    def body(self) -> dict[str, Any]:
        return self._body


def refusal(exc: p.ApiError) -> GenerateError:
    """``exc`` as SGLang answers it on ``/generate``: a body that does not validate in
    the OpenAI routes' shape, a ``ValueError`` as ``_create_error_response``, anything
    else as its ``HTTPException`` handler."""
    if exc.sglang_type == "Bad Request":
        return GenerateError(400, sg.error_body(exc))
    if exc.status == 400:
        return GenerateError(400, {"error": {"message": exc.message}})
    status = exc.status
    error = {"object": "error", "message": exc.message, "type": str(status)}
    return GenerateError(status, {**error, "param": None, "code": status})


def _refused(message: str) -> p.BadRequest:
    """One of SGLang's ``ValueError``s (``/generate``: 400 ``{"error": {"message"}}``)."""
    return p.BadRequest(message, sglang_type="BadRequestError")


class GenerateRequest(msgspec.Struct, kw_only=True):
    """``GenerateReqInput``'s fields the simulator reads; the others are ignored."""

    text: str | list[str] | None = None
    input_ids: msgspec.Raw = p.ABSENT  # a list of ints or of int lists: ``_input_ids``
    input_embeds: msgspec.Raw = p.ABSENT
    sampling_params: msgspec.Raw = p.ABSENT  # an object (a list: not simulated)
    stream: bool = False
    rid: msgspec.Raw = p.ABSENT  # ``sglang_rids.body_rid``
    cache_salt: str | None = None
    return_logprob: bool | list[bool] | None = None
    bootstrap_host: str | None = None  # P/D (``pd.py``)
    bootstrap_port: int | None = None
    bootstrap_room: int | None = None
    lora_path: str | None = None  # the adapter's name (a list per prompt: not simulated)


class GenerateSampling(msgspec.Struct):
    """The keys of ``sampling_params`` the simulator reads."""

    max_new_tokens: int | None = DEFAULT_MAX_NEW_TOKENS
    temperature: float | None = None
    n: int | None = 1
    ignore_eos: bool | None = False  # no effect: the simulator never samples EOS


# -- the request ----------------------------------------------------------------------


class NativeGenerate:
    """``/generate`` on one SGLang-mode simulator's engine."""

    def __init__(self, serving: SglangServing) -> None:
        self.serving = serving
        self.app = serving.app

    async def generate(self, raw: bytes) -> GenerateAnswer:
        try:
            body = p.decode_body(raw, GenerateRequest)
            given_rid = sr.body_rid(body.rid)
            params = _sampling(body.sampling_params)
            input_ids = _input_ids(body.input_ids)
        except p.ApiError as exc:  # FastAPI's validation, before the route runs
            raise refusal(exc) from None
        try:
            return await self._serve(body, given_rid, params, input_ids)
        except p.ApiError as exc:
            if not body.stream or exc.status != 400:
                raise refusal(exc) from None
            return _events(_error_event(exc.message), _DONE), Choices("", [])

    async def _serve(
        self,
        body: GenerateRequest,
        given_rid: sr.GivenRid,
        params: GenerateSampling,
        input_ids: TokenIds | None,
    ) -> GenerateAnswer:
        """``tokenizer_manager.generate_request``: normalize, take the rids, tokenize,
        check, run."""
        given, batch = _inputs(body, input_ids)
        n = params.n if params.n is not None else 1
        batch = batch or n > 1  # ``_handle_parallel_sampling``
        if _asks_logprobs(body.return_logprob):
            raise _refused("kvroute-sim does not simulate logprobs: return_logprob is refused.")
        if not given:  # a batch of no prompts: nothing runs
            return (_events(_DONE), Choices("", [])) if body.stream else []
        rids = sr.plan(given_rid, len(given), n, batch=batch)
        prompts = await self.app.prompt_ids([*given])
        salt = body.cache_salt or None  # ``_normalize_single_inputs``: "" is none
        bootstrap = Bootstrap.of(body.bootstrap_host, body.bootstrap_port, body.bootstrap_room)
        ask = Sampling(
            params.max_new_tokens,
            params.temperature,
            body.stream,
            salt,
            None,
            bootstrap,
            body.lora_path,
        )
        ids_given = isinstance(given[0], list)
        choices = await self.serving.start(rids, prompts, ask, max(n, 1), ids_given=ids_given)
        text_of = self.app.tokenizer.text_of
        if body.stream:
            return _stream(choices, text_of, batch), choices
        await self.serving.until_done(choices)
        outputs = [_output(choices, k, text_of, first=True) for k in range(len(choices.handles))]
        return outputs if batch else outputs[0]


def _sampling(raw: msgspec.Raw) -> GenerateSampling:
    if raw in (p.ABSENT, p.NULL):
        return GenerateSampling()
    try:
        decoded = msgspec.json.decode(raw, type=dict[str, Any] | list[dict[str, Any]])
    except msgspec.ValidationError as exc:
        raise p.field_error(exc, "sampling_params") from None
    if isinstance(decoded, list):
        raise _refused("kvroute-sim takes one sampling_params object for a whole request.")
    try:
        return msgspec.convert(decoded, GenerateSampling)
    except msgspec.ValidationError as exc:  # SGLang's would be a TypeError (a 500)
        raise _refused(f"kvroute-sim cannot read sampling_params: {exc}") from None


class TokenIds(NamedTuple):
    """``input_ids`` as given: its prompts, and whether it was a list of them."""

    prompts: list[list[int]]
    nested: bool


def _input_ids(raw: msgspec.Raw) -> TokenIds | None:
    """``validate_optional_list_i64_1d_2d``: null, a list of ints or a list of int lists."""
    if raw in (p.ABSENT, p.NULL):
        return None
    try:
        return TokenIds([msgspec.json.decode(raw, type=list[int])], nested=False)
    except msgspec.ValidationError:
        pass
    try:
        return TokenIds(msgspec.json.decode(raw, type=list[list[int]]), nested=True)
    except msgspec.ValidationError as exc:
        raise p.field_error(exc, "input_ids") from None


def _inputs(body: GenerateRequest, ids: TokenIds | None) -> tuple[Prompts, bool]:
    """The prompts (texts or token ids) and whether the request is a batch:
    ``_validate_inputs``, ``_determine_batch_size``, ``_tokenize_one_request``'s pick."""
    text = body.text
    if text is None and ids is None:
        if body.input_embeds in (p.ABSENT, p.NULL):
            raise _refused("Either text, input_ids or input_embeds should be provided.")
        raise _refused(
            "input_embeds is provided while disable_radix_cache is False. Please add "
            "`--disable-radix-cache` when you launch the server if you want to use "
            "input_embeds as inputs."
        )
    prompts: Prompts
    if text is None:
        assert ids is not None
        if not ids.nested and not ids.prompts[0]:  # `[]`: ``_determine_batch_size``
            raise _refused("input_ids cannot be empty.")
        prompts, batch = ids.prompts, ids.nested
    else:
        batch = isinstance(text, list)
        prompts = text if isinstance(text, list) else [text]
        if ids is not None:  # the shape from ``text``, the tokens from ``input_ids``
            if ids.nested != batch or len(ids.prompts) != len(prompts):
                raise _refused("kvroute-sim serves text with input_ids only in the same shape.")
            prompts = ids.prompts
    _check_not_empty(prompts)
    return prompts, batch


def _check_not_empty(prompts: Prompts) -> None:
    for prompt in prompts:
        if isinstance(prompt, str) and not prompt:  # ``_tokenize_texts``
            raise _refused("texts cannot be empty and tokenizer must be initialized")
        if isinstance(prompt, list) and not prompt:
            raise _refused("kvroute-sim cannot serve a prompt of no tokens.")


def _asks_logprobs(asked: bool | list[bool] | None) -> bool:
    return any(asked) if isinstance(asked, list) else bool(asked)


# -- answers --------------------------------------------------------------------------


def meta_info(choices: Choices, k: int, sent: int, *, first: bool) -> dict[str, Any]:
    """Output ``k``'s ``meta_info`` after ``sent`` tokens, in SGLang's key order; ``first``:
    the first output of it the client gets."""
    handle = choices.handles[k]
    req = handle.req
    finished = sent >= req.max_tokens
    cached = req.num_cached_tokens
    meta: dict[str, Any] = {
        "id": sg.answer_id(choices, k),
        "finish_reason": {"type": "length", "length": req.max_tokens} if finished else None,
        "prompt_tokens": len(req.prompt),
        "weight_version": sg.WEIGHT_VERSION,
        "num_retractions": 0,
        "reasoning_tokens": 0,
        "completion_tokens": sent,
        "cached_tokens": cached,
    }
    if finished:
        meta["weight_versions"] = [{"version": sg.WEIGHT_VERSION, "start": 0, "end": sent}]
    meta["cached_tokens_details"] = {"device": cached, "host": 0} if cached else None
    meta["dp_rank"] = None
    if finished:
        meta["e2e_latency"] = time.perf_counter() - handle.arrival
    if first:
        meta["response_sent_to_client_ts"] = time.time()
    return meta


def _output(
    choices: Choices, k: int, text_of: TextOf, *, first: bool, sent: int | None = None
) -> dict[str, Any]:
    """One output of request ``k``: its text and token ids so far (``sent`` tokens; all
    it has by default), and its ``meta_info``."""
    output = choices.handles[k].req.output
    ids = output[: len(output) if sent is None else sent]
    meta = meta_info(choices, k, len(ids), first=first)
    return {"text": text_of(ids), "output_ids": ids, "meta_info": meta}


async def _stream(choices: Choices, text_of: TextOf, batch: bool) -> AsyncIterator[bytes]:
    """``generate_request``'s stream: one cumulative output per token of each request
    (``stream_interval`` 1; one for a request of no tokens), a batch's with its
    ``index``, then ``[DONE]``."""
    sent = [0] * len(choices.handles)
    async for delta in choices.deltas(text_of):
        if delta is None:  # the engine failed the requests
            yield _error_event("engine restarted")
            break
        k, pieces, _ = delta
        first, done = sent[k] == 0, sent[k]
        sent[k] += len(pieces)
        for upto in range(done + 1, sent[k] + 1) if pieces else [done]:
            out = _output(choices, k, text_of, first=first, sent=upto)
            first = False
            if batch:
                out["index"] = k
            yield b"data: " + _encode(out) + b"\n\n"
    yield _DONE


def _error_event(message: str) -> bytes:
    return b"data: " + _encode({"error": {"message": message}}) + b"\n\n"


async def _events(*events: bytes) -> AsyncIterator[bytes]:
    for event in events:
        yield event
