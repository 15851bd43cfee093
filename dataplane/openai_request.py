"""An inference request's body, checked just enough to route it and never to crash on it.

The proxy forwards the client's body as it came (re-encoding it only when it must add
``stream_options.include_usage`` or ``cache_salt``), so this module checks only what
routing reads: the body is a JSON object, ``model`` is a string (or absent or null, as
the engines accept it: ``model`` is then ``""``), chat ``messages`` are a non-empty list
of objects with a string ``role``, a completion ``prompt`` is a string, a list of token
ids, or a list of those, SGLang's native ``/generate`` has ``text`` or ``input_ids`` of
those shapes (never given ``stream_options``: its every answer carries its tokens in
``meta_info``; a tenant's ``cache_salt`` it takes as the other routes do), and the
streaming and tenant fields have their types. Anything else is the engine's to judge.
Every problem is a :class:`BadRequest` naming the field, in OpenAI's error shape.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import msgspec

from dataplane.http_errors import BadRequest
from kvcore.request import prompt_field

Kind = Literal["chat", "completion", "generate"]
_decode = msgspec.json.decode
_MAX_TOKEN_ID = 2**32


@dataclass(slots=True)
class InferenceRequest:
    """A checked chat or completion request; ``body`` is the decoded JSON object."""

    kind: Kind
    raw: bytes
    body: dict[str, Any]
    model: str  # "": the body names none (see dataplane.app: the fleet's only model)
    stream: bool
    # stream_options.include_usage as the client gave it: True; False (false, null, or no
    # stream_options); None: stream_options without it, which the engines read apart
    usage_asked: bool | None
    # stream_options.continuous_usage_stats given, other than false or null
    continuous_usage: bool = False

    def __init__(  # written out: one per request (see dataplane/native.py)
        self,
        kind: Kind,
        raw: bytes,
        body: dict[str, Any],
        model: str,
        stream: bool,
        usage_asked: bool | None,
        continuous_usage: bool = False,
    ) -> None:
        self.kind = kind
        self.raw = raw
        self.body = body
        self.model = model
        self.stream = stream
        self.usage_asked = usage_asked
        self.continuous_usage = continuous_usage

    @property
    def adds_usage(self) -> bool:
        """Whether the proxy asks the engine for the stream's usage on the client's
        behalf (stripped again on the way back, :mod:`dataplane.relay`). Not when the
        client asked for no usage but for ``continuous_usage_stats``: vLLM honours that
        only with ``include_usage`` on, and would then put usage in every chunk, which
        the client would see (SGLang puts it there either way, as the client asked)."""
        if not self.stream or self.usage_asked is True or self.kind == "generate":
            return False  # /generate: every event carries its meta_info
        return not (self.usage_asked is False and self.continuous_usage)

    def wants_usage(self, engine_kind: str) -> bool:
        """Whether a stream from an ``engine_kind`` engine ends with usage for this
        request: ``stream_options`` without ``include_usage`` asks vLLM for it (its
        ``include_usage`` defaults to true) but not SGLang (false); an unknown engine is
        taken for vLLM."""
        if self.usage_asked is None:
            return engine_kind != "sglang"
        return self.usage_asked

    @property
    def messages(self) -> list[dict[str, Any]]:
        return self.body["messages"]  # type: ignore[no-any-return]

    @property
    def is_batch(self) -> bool:
        """A completion with more than one prompt (the engine runs one request each)."""
        prompt = prompt_field(self.body, self.kind)[1] if self.kind != "chat" else None
        return isinstance(prompt, list) and len(prompt) > 1 and _is_batch_form(prompt)

    @property
    def fans_out(self) -> bool:
        """Whether the engine serves this as several requests: a batch of prompts, or
        ``n`` > 1 samples (vLLM runs each sample as a request of its own; ``/generate``
        asks for them in ``sampling_params``)."""
        n = self.body.get("n")
        if self.kind == "generate":
            sampling = self.body.get("sampling_params")
            n = sampling.get("n") if isinstance(sampling, dict) else None
        return self.is_batch or (isinstance(n, int) and n > 1)

    def upstream_body(self, *, include_usage: bool, cache_salt: str | None) -> bytes:
        """The body to send upstream: the client's bytes unless a field must change."""
        if not include_usage and cache_salt is None:
            return self.raw
        body = dict(self.body)
        if include_usage:
            options = dict(body.get("stream_options") or {})
            options["include_usage"] = True
            body["stream_options"] = options
        if cache_salt is not None:
            body["cache_salt"] = cache_salt  # the tenant's (dataplane.routing)
            body.pop("extra_key", None)  # SGLang's: folded into it
        return msgspec.json.encode(body)


def parse_inference(raw: bytes, kind: Kind) -> InferenceRequest:
    """``raw`` checked as a ``kind`` request; :class:`BadRequest` says what is wrong."""
    body = decode_object(raw)
    model = body.get("model")
    if model is None:
        model = ""  # as vLLM and SGLang take it: the model they serve
    elif not isinstance(model, str):
        raise BadRequest("'model' must be a string.", "model")
    if kind == "chat":
        _check_messages(body.get("messages"))
    elif kind == "completion":
        _check_prompt(body.get("prompt"))
    else:
        _check_generate(body)
        lora_path = body.get("lora_path")  # SGLang's adapter for /generate: routed by it
        if not model and isinstance(lora_path, str) and lora_path:
            model = lora_path
    _check_types(body)
    stream = body.get("stream") is True
    options = body.get("stream_options")
    if options is None:
        usage_asked: bool | None = False
    elif "include_usage" in options:
        usage_asked = options["include_usage"] is True
    else:
        usage_asked = None  # stream_options without include_usage: up to the engine
    continuous = options is not None and options.get("continuous_usage_stats") not in (None, False)
    return InferenceRequest(kind, raw, body, model, stream, usage_asked, continuous)


def _is_batch_form(prompt: object) -> bool:
    """A list of prompts (strings or token-id lists), not one prompt of token ids."""
    return isinstance(prompt, list) and bool(prompt) and not isinstance(prompt[0], int)


def decode_object(raw: bytes) -> dict[str, Any]:
    """``raw`` as a JSON object, or :class:`BadRequest`."""
    try:
        body = _decode(raw)
    except msgspec.DecodeError as exc:
        raise BadRequest(f"The request body is not valid JSON: {exc}") from None
    except RecursionError:  # msgspec's depth limit, not a DecodeError
        raise BadRequest("The request body's JSON is nested too deeply.") from None
    if not isinstance(body, dict):
        raise BadRequest(f"The request body must be a JSON object, got {_kind(body)}.")
    return body


def _check_messages(messages: object) -> None:
    if not isinstance(messages, list) or not messages:
        raise BadRequest("'messages' is required and must be a non-empty array.", "messages")
    for index, message in enumerate(messages):
        if not isinstance(message, dict):
            raise BadRequest(f"messages[{index}] must be an object.", "messages")
        if not isinstance(message.get("role"), str):
            raise BadRequest(f"messages[{index}].role must be a string.", "messages")
        content = message.get("content")
        if content is not None and not isinstance(content, str | list):
            raise BadRequest(f"messages[{index}].content must be a string or an array.", "messages")


def _check_prompt(prompt: object) -> None:
    if _texts(prompt) or _id_lists(prompt):
        return
    raise BadRequest(
        "'prompt' is required: a string, an array of strings, an array of token ids, "
        "or an array of those.",
        "prompt",
    )


def _check_generate(body: dict[str, Any]) -> None:
    """``/generate``: its prompt in ``input_ids`` (token ids, or a batch of them) or in
    ``text`` (a string, or a batch of strings); both given, the engine's to refuse."""
    field, prompt = prompt_field(body, "generate")
    if prompt is None:
        raise BadRequest("'text' or 'input_ids' is required.", "text")
    if field == "text" and not _texts(prompt):
        raise BadRequest("'text' must be a string or an array of strings.", "text")
    if field == "input_ids" and not _id_lists(prompt):
        raise BadRequest(
            "'input_ids' must be an array of token ids or an array of those.", "input_ids"
        )


def _texts(value: object) -> bool:
    """A string, or a non-empty list of strings."""
    if isinstance(value, str):
        return True
    return isinstance(value, list) and bool(value) and all(isinstance(v, str) for v in value)


def _id_lists(value: object) -> bool:
    """Token ids, or a non-empty list of them."""
    return _token_ids(value) or (
        isinstance(value, list) and bool(value) and all(_token_ids(v) for v in value)
    )


def _token_ids(value: object) -> bool:
    return (
        isinstance(value, list)
        and bool(value)
        and all(
            type(token) is int and 0 <= token < _MAX_TOKEN_ID  # bool is not a token id
            for token in value
        )
    )


_FIELD_TYPES: dict[str, tuple[type, ...]] = {
    "stream": (bool,),
    "stream_options": (dict,),
    "cache_salt": (str,),
    "prompt_cache_key": (str,),
    "extra_key": (str,),  # SGLang's, part of the tenant's salt (dataplane.routing)
    "tools": (list,),
    "user": (str,),
}


def _check_types(body: dict[str, Any]) -> None:
    for name, value in body.items():  # a body has a few fields; most are not checked here
        types = _FIELD_TYPES.get(name)
        if types is not None and value is not None and not isinstance(value, types):
            expected = " or ".join(_NAMES[t] for t in types)
            raise BadRequest(f"'{name}' must be {expected}, got {_kind(value)}.", name)
    options = body.get("stream_options")
    if options and not isinstance(options.get("include_usage", False), bool | None):
        raise BadRequest(
            "'stream_options.include_usage' must be a boolean or null.", "stream_options"
        )
    salt = body.get("cache_salt")
    if salt is not None and not salt:
        raise BadRequest("'cache_salt' must not be empty.", "cache_salt")


_NAMES = {bool: "a boolean", dict: "an object", str: "a string", list: "an array"}


def _kind(value: object) -> str:
    if value is None:
        return "null"
    return {bool: "a boolean", dict: "an object", str: "a string", list: "an array"}.get(
        type(value), "a number"
    )
