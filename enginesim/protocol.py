"""The OpenAI-compatible request and response shapes, and the errors, as vLLM serves them
(SGLang mode's answers are in ``sglang_api.py``, on the same request structs).

Requests are decoded with msgspec structs (unknown fields ignored, as vLLM does for
sampling options the simulator has no use for); responses are plain dicts encoded with
msgspec. Errors have OpenAI's shape ``{"error": {"message", "type", "param", "code"}}``
with vLLM's status codes::

    ApiError                 base: status + OpenAI error type
     ├── BadRequest          400  malformed JSON, missing or invalid field, prompt too long
     │    ├── RequestValidatorError  a vLLM request validator's (worded as pydantic's)
     │    ├── MediaTypeRefused       a body not declared application/json
     │    └── EngineInputError       token id out of the vocabulary (an event in a stream)
     ├── Forbidden           403  admin route from a non-loopback client
     ├── NotFound            404  unknown model (an unknown route is FastAPI's own 404)
     ├── Conflict            409  /reset_prefix_cache while blocks are in use
     ├── PayloadTooLarge     413
     └── InjectedFailure     500  a fault asked for (``/sim/faults``) or an engine restart
"""

from __future__ import annotations

import math
import time
import uuid
from collections.abc import Sequence
from typing import Annotated, Any, NamedTuple, TypeVar

import msgspec

DEFAULT_MAX_TOKENS = 16
MAX_SALT_CHARS = 128
MAX_N = 16384  # vLLM's ``VLLM_MAX_N_SEQUENCES`` default
MAX_COMPLETION_PROMPTS = 1024  # vLLM's ``VLLM_MAX_COMPLETION_PROMPTS`` default
GREEDY_TEMPERATURE = 1e-5  # vLLM's ``_SAMPLING_EPS``: below it, sampling is greedy
T = TypeVar("T")
_json_decoder_cache: dict[type, msgspec.json.Decoder[Any]] = {}


class ApiError(Exception):
    status = 500
    error_type = "InternalServerError"

    def __init__(
        self, message: str, param: str | None = None, *, sglang_type: str | None = None
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.sglang_type = sglang_type  # the ``type`` SGLang gives it (``sglang_api``)

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.error_type,
                "param": self.param,
                "code": self.status,
            }
        }


class BadRequest(ApiError):
    status, error_type = 400, "BadRequestError"


class BodyUnparsable(BadRequest):
    """A body FastAPI could not parse at all (its JSON nested past the parser's depth):
    FastAPI's ``HTTPException(400, "There was an error parsing the body")``, which vLLM's
    ``http_exception_handler`` answers with the status phrase as the type."""

    error_type = "Bad Request"


class RequestValidatorError(BadRequest):
    """Refused by one of vLLM's request validators (pydantic ``model_validator``s of mode
    "before" on ``CompletionRequest`` / ``ChatCompletionRequest``, which run before the
    fields are read, the last defined first). vLLM answers such an error as FastAPI's
    ``RequestValidationError`` (``serve/exception_handling/handlers/validation.py``,
    ``validation_exception_handler``): type "Bad Request", ``param`` the one the
    ``VLLMValidationError`` names, and the message "1 validation error:" then the
    pydantic error as ``str()`` of its dict, ``loc`` cleaned to "body", the body's dict
    summarized by its number of fields (``_summarize_error_input``), the reason in
    ``msg`` with ``VLLMValidationError.__str__``'s "(parameter=...)". The format was
    checked against FastAPI 0.165 / pydantic 2.14 with a model shaped like vLLM's."""

    error_type = "Bad Request"

    def __init__(self, reason: str, param: str) -> None:
        super().__init__(reason, param)
        self.reason = reason

    def with_body(self, raw: bytes) -> RequestValidatorError:
        """The message as vLLM words it, which counts the fields of the body ``raw``."""
        fields = len(msgspec.json.decode(raw, type=dict[str, msgspec.Raw]))
        msg = f"Value error, {self.reason} (parameter={self.param})"
        summary = f"<dict of {fields} items>"
        error = (
            f"{{'type': 'value_error', 'loc': 'body', 'msg': {msg!r}, 'input': {summary!r}, "
            f"'ctx': {{'error': VLLMValidationError({self.reason!r})}}}}"
        )
        if len(error) > _MAX_ERROR_CHARS:
            error = error[:_MAX_ERROR_CHARS] + "...[truncated]"
        self.message = f"1 validation error:\n  {error}"
        return self


_MAX_ERROR_CHARS = 1000  # vLLM's bound on one reported validation error


class MediaTypeRefused(BadRequest):
    """A body not declared ``application/json`` (its media type, before any ``;``, lower
    cased) on a route both engines guard with their ``validate_json_request`` dependency,
    which raises a ``RequestValidationError``: vLLM's handler words its one error as
    "1 validation error:" and the reason; SGLang's (its error a dict naming the header)
    as ``str()`` of the exception then of its errors, as FastAPI 0.165 writes them. A body
    sent with no content type at all is parsed as JSON first, so it is refused so only
    when it is JSON (else its parse error stands)."""

    error_type = "Bad Request"

    def __init__(self, sglang: bool) -> None:
        if not sglang:
            super().__init__(f"1 validation error:\n  {MEDIA_TYPE_REASON}")
            return
        error = {"loc": ["header", "content-type"], "msg": MEDIA_TYPE_REASON, "type": "value_error"}
        super().__init__(f"1 validation error:\n  {error} {[error]}", sglang_type="Bad Request")


MEDIA_TYPE_REASON = "Unsupported Media Type: Only 'application/json' is allowed"


def declares_json(content_type: str | None) -> bool:
    """Whether a ``content-type`` is what ``validate_json_request`` lets through."""
    return (content_type or "").lower().split(";", 1)[0] == "application/json"


class EngineInputError(BadRequest):
    """Refused by vLLM's engine input processing, which a stream only reaches after its
    200: there it is an error event, ``json.dumps`` of the body, then ``[DONE]``
    (``completion/serving.py``, ``completion_stream_generator``)."""


class Forbidden(ApiError):
    status, error_type = 403, "PermissionDeniedError"


class NotFound(ApiError):
    status, error_type = 404, "NotFoundError"


class Conflict(ApiError):
    status, error_type = 409, "ConflictError"


class PayloadTooLarge(ApiError):
    status, error_type = 413, "PayloadTooLarge"


class InjectedFailure(ApiError):
    status, error_type = 500, "InternalServerError"


# -- requests ------------------------------------------------------------------------

PositiveInt = Annotated[int, msgspec.Meta(ge=1)]
TokenId = int  # any integer: the engine's own vocabulary check refuses the others


class StreamOptions(msgspec.Struct):
    """vLLM's: given at all, a stream ends with usage unless ``include_usage`` is false
    or null."""

    include_usage: bool | None = True
    continuous_usage_stats: bool | None = False


NULL = msgspec.Raw(b"null")
ABSENT = msgspec.Raw(b"")  # a field the body does not have (any value it has is not empty)


class _Sampling(msgspec.Struct, kw_only=True):
    model: str | None = None
    request_id: msgspec.Raw = ABSENT  # vLLM's, checked by :func:`base_request_id`
    rid: msgspec.Raw = ABSENT  # SGLang's, checked in SGLang mode (``sglang_rids``)
    max_tokens: PositiveInt | None = None
    stream: bool = False
    stream_options: msgspec.Raw = NULL  # checked by :func:`stream_usage`
    ignore_eos: bool = False
    cache_salt: str | None = None
    kv_transfer_params: dict[str, Any] | None = None  # vLLM's P/D (``pd.py``)
    bootstrap_host: str | None = None  # SGLang's P/D (``pd.py``)
    bootstrap_port: int | None = None
    bootstrap_room: int | None = None
    n: int | None = 1  # vLLM's chat request takes null for 1
    temperature: float | None = None


class CompletionRequest(_Sampling, kw_only=True):
    prompt: str | list[TokenId]
    n: int = 1  # vLLM's completion request does not take null


class CompletionBatchRequest(_Sampling, kw_only=True):
    prompt: list[str | list[TokenId]]  # all strings or all token-id lists
    n: int = 1


class ChatRequest(_Sampling, kw_only=True):
    messages: list[dict[str, Any]]
    max_completion_tokens: PositiveInt | None = None
    tools: list[dict[str, Any]] | None = None
    add_generation_prompt: bool = True


class TokenizeRequest(msgspec.Struct, kw_only=True):
    model: str | None = None
    prompt: str | list[TokenId] | None = None
    messages: list[dict[str, Any]] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    tools: list[dict[str, Any]] | None = None


def decode_body(body: bytes, kind: type[T]) -> T:
    """Decode a JSON body into ``kind``; every failure becomes a ``BadRequest``."""
    decoder = _json_decoder_cache.get(kind)
    if decoder is None:
        decoder = _json_decoder_cache[kind] = msgspec.json.Decoder(kind)
    try:
        return decoder.decode(body)  # type: ignore[no-any-return]
    except msgspec.ValidationError as exc:
        raise BadRequest(f"Invalid request: {exc}", sglang_type=_UNVALIDATED) from exc
    except msgspec.DecodeError as exc:
        raise BadRequest(f"Malformed JSON body: {exc}", sglang_type=_UNVALIDATED) from exc
    except RecursionError:
        raise BodyUnparsable("There was an error parsing the body") from None


_UNVALIDATED = "Bad Request"  # SGLang's type for a body that does not validate


class UsageAsked(NamedTuple):
    """What a stream says of its usage (vLLM's ``should_include_usage``)."""

    final: bool  # a usage chunk ends the stream
    continuous: bool  # every other chunk carries its choice's usage so far


NO_USAGE = UsageAsked(final=False, continuous=False)


def stream_usage(body: _Sampling) -> UsageAsked:
    """The stream's usage by vLLM's rules for ``stream_options``: an object of
    ``StreamOptions``' fields (others ignored), non-empty only with ``stream`` true (its
    ``validate_stream_options``: ``{}`` passes either way); ``continuous_usage_stats``
    counts only with ``include_usage`` on."""
    raw = body.stream_options
    if raw == NULL:
        return NO_USAGE
    try:
        fields = msgspec.json.decode(raw, type=dict[str, Any])
        options = msgspec.convert(fields, StreamOptions)
    except msgspec.ValidationError as exc:
        raise field_error(exc, "stream_options") from None
    if fields and not body.stream:
        reason = "Stream options can only be defined when `stream=True`."
        raise RequestValidatorError(reason, "stream_options")
    final = options.include_usage is True
    return UsageAsked(final, final and options.continuous_usage_stats is True)


def field_error(exc: msgspec.ValidationError, field: str) -> BadRequest:
    """The refusal of a field decoded on its own, worded as if the whole body had been
    decoded (msgspec's message, its path under ``$.field``): a body that does not
    validate."""
    where, at = str(exc), f"`$.{field}"
    message = where.replace("`$", at, 1) if "`$" in where else f"{where} - at {at}`"
    return BadRequest(f"Invalid request: {message}", field, sglang_type=_UNVALIDATED)


def base_request_id(header: str | None, given: msgspec.Raw) -> str:
    """vLLM's ``_base_request_id``, what follows ``cmpl-`` or ``chatcmpl-`` in an answer's
    id: the ``X-Request-Id`` header, else the body's ``request_id``, else
    :func:`random_uuid` (the default of the body's field). The body's must be a string
    (its request model's ``request_id: str``), header or not."""
    body_id = None
    if given != ABSENT:
        try:
            body_id = msgspec.json.decode(given, type=str)
        except msgspec.ValidationError as exc:
            raise field_error(exc, "request_id") from None
    if header is not None:
        return header
    return random_uuid() if body_id is None else body_id


def random_uuid() -> str:
    """vLLM's ``random_uuid``: 32 hex digits."""
    return uuid.uuid4().hex


def check_salt(salt: str | None) -> None:
    """vLLM 0.33's ``validate_cache_salt``."""
    if salt is None:
        return
    if not salt:
        raise BadRequest("cache_salt must be a non-empty string.", "cache_salt")
    if len(salt) > MAX_SALT_CHARS:
        raise BadRequest(f"cache_salt must be at most {MAX_SALT_CHARS} characters.", "cache_salt")
    if any(c in salt for c in "@/\\\0"):
        raise BadRequest("cache_salt must not contain '@', '/', '\\' or NUL.", "cache_salt")


def decode_completion(body: bytes) -> CompletionRequest | CompletionBatchRequest:
    """A completion request, whose ``prompt`` is a batch when it is a list that does not
    begin with a token id: one prompt decodes as fast, and fails with the same messages,
    as if batches did not exist."""
    try:
        return decode_body(body, CompletionRequest)
    except BadRequest as exc:
        if not exc.message.endswith(_NOT_A_TOKEN_ID):
            raise
    return decode_body(body, CompletionBatchRequest)


_NOT_A_TOKEN_ID = ("got `str` - at `$.prompt[0]`", "got `array` - at `$.prompt[0]`")


def completion_prompts(
    body: CompletionRequest | CompletionBatchRequest, max_prompts: int | None = None
) -> list[str | list[int]]:
    """The prompts of a completion request, one per engine request; a batch of more than
    ``max_prompts`` is refused as vLLM refuses it (``completion/protocol.py``,
    ``CompletionRequest.validate_prompt_list_length``: a list not of ints longer than
    ``VLLM_MAX_COMPLETION_PROMPTS``; vLLM checks it before the fields' types, the
    simulator after). SGLang has no such bound (``max_prompts`` None)."""
    if isinstance(body, CompletionRequest):
        return [body.prompt]
    if max_prompts is not None and len(body.prompt) > max_prompts:
        raise RequestValidatorError(
            f"prompt list length {len(body.prompt)} exceeds the maximum allowed count of "
            f"{max_prompts}. To increase this limit, set the VLLM_MAX_COMPLETION_PROMPTS "
            "environment variable.",
            "prompt",
        )
    kind = type(body.prompt[0])
    if not all(type(item) is kind for item in body.prompt):
        message = "prompt must be a string, token ids, or a list of either."
        raise BadRequest(message, "prompt", sglang_type=_UNVALIDATED)
    return body.prompt


def check_token_ids(prompt: Sequence[int], max_token_id: int) -> None:
    """vLLM's ``validate_token_ids`` (``renderers/base.py``, run by the v1 input
    processor's ``_validate_model_input`` when the engine takes the request): the lowest
    id if it is negative, else the highest if it is above ``max_token_id``, "is out of
    vocabulary"; no ``param``."""
    low = min(prompt)
    if low < 0:
        raise EngineInputError(f"Token id {low} is out of vocabulary")
    high = max(prompt)
    if high > max_token_id:
        raise EngineInputError(f"Token id {high} is out of vocabulary")


def check_sampling(n: int | None, temperature: float | None) -> int:
    """vLLM's ``SamplingParams`` checks of what the simulator reads, in vLLM's order
    (``_verify_num_sequences``, the temperature's range, then ``_verify_greedy_sampling``
    at temperature 0); returns ``n``."""
    n = 1 if n is None else n
    if n < 1:
        raise BadRequest(f"n must be at least 1, got {n}.")
    if n > MAX_N:
        raise BadRequest(
            f"n must be at most {MAX_N}, got {n}. To increase this limit, set the "
            "VLLM_MAX_N_SEQUENCES environment variable."
        )
    if temperature is None:
        return n
    if not math.isfinite(temperature):
        raise BadRequest(f"temperature must be a finite number, got {temperature}.", "temperature")
    if temperature < 0.0:
        raise BadRequest(f"temperature must be non-negative, got {temperature}.", "temperature")
    if temperature > 2.0:
        raise BadRequest(f"temperature must be in [0, 2], got {temperature}.", "temperature")
    if temperature < GREEDY_TEMPERATURE and n > 1:
        raise BadRequest(f"n must be 1 when using greedy sampling, got {n}.")
    return n


def check_messages(messages: Sequence[dict[str, Any]]) -> None:
    if not messages:
        raise BadRequest("messages must not be empty.", "messages")
    for i, message in enumerate(messages):
        if not isinstance(message.get("role"), str):
            raise BadRequest(f"messages[{i}] needs a string 'role'.", "messages")


# -- responses -----------------------------------------------------------------------


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    """vLLM's ``UsageInfo`` as ``--enable-prompt-tokens-details`` fills it: the details
    only when some tokens were cached (vLLM tests the count's truth), else null (and left
    out of a stream's usage chunk, dumped without nulls: :func:`usage_chunk`)."""
    details = {"cached_tokens": cached_tokens} if cached_tokens else None
    return {
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "completion_tokens": completion_tokens,
        "prompt_tokens_details": details,
    }


def running_usage(prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
    """A chunk's ``usage`` with ``continuous_usage_stats``: its choice's tokens so far,
    without ``prompt_tokens_details`` (vLLM sets the other three fields alone)."""
    return {
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "completion_tokens": completion_tokens,
    }


def completion_body(
    rid: str,
    model: str,
    text: str,
    use: dict[str, Any] | None,
    finish: str | None = "length",
    index: int = 0,
) -> dict[str, Any]:
    """A completion with one choice, or one streamed chunk of choice ``index``."""
    return _envelope(rid, "text_completion", model, [_text_choice(index, text, finish)], use)


def completion_batch_body(
    rid: str, model: str, texts: Sequence[str], use: dict[str, Any]
) -> dict[str, Any]:
    """A finished completion with a choice per text, indexed in order."""
    choices = [_text_choice(i, text, "length") for i, text in enumerate(texts)]
    return _envelope(rid, "text_completion", model, choices, use)


def _text_choice(index: int, text: str, finish: str | None) -> dict[str, Any]:
    return {
        "index": index,
        "text": text,
        "logprobs": None,
        "finish_reason": finish,
        "stop_reason": None,
    }


def chat_body(rid: str, model: str, texts: Sequence[str], use: dict[str, Any]) -> dict[str, Any]:
    """A finished chat completion with a choice per text, indexed in order."""
    choices = [
        {
            "index": i,
            "message": {"role": "assistant", "content": text, "tool_calls": []},
            "logprobs": None,
            "finish_reason": "length",
            "stop_reason": None,
        }
        for i, text in enumerate(texts)
    ]
    return _envelope(rid, "chat.completion", model, choices, use)


def chat_chunk(
    rid: str,
    model: str,
    delta: dict[str, Any],
    finish: str | None,
    use: dict[str, Any] | None,
    index: int = 0,
) -> dict[str, Any]:
    choices = [{"index": index, "delta": delta, "logprobs": None, "finish_reason": finish}]
    return _envelope(rid, "chat.completion.chunk", model, choices, use)


def usage_chunk(rid: str, model: str, obj: str, use: dict[str, Any]) -> dict[str, Any]:
    """A stream's usage chunk, dumped as vLLM dumps it: without null fields."""
    return _envelope(rid, obj, model, [], {k: v for k, v in use.items() if v is not None})


def _envelope(
    rid: str, obj: str, model: str, choices: list[dict[str, Any]], use: dict[str, Any] | None
) -> dict[str, Any]:
    body: dict[str, Any] = {
        "id": rid,
        "object": obj,
        "created": int(time.time()),
        "model": model,
        "choices": choices,
    }
    if use is not None:
        body["usage"] = use
    return body
