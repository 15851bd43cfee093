"""Responses passed back untouched, except for the usage the proxy asked for on its own.

The proxy compares every response's ``usage.prompt_tokens_details.cached_tokens`` with
the cached tokens it predicted. A non-streaming body carries usage; a stream carries it
only in a final chunk (``"choices": []``) that engines send when the request had
``stream_options.include_usage``. So the proxy asks for it, and when the client had
not, :class:`SseRelay` removes that chunk: the client sees exactly the events it would
have seen. (Not for a client that asked for ``continuous_usage_stats`` without
``include_usage``: vLLM would then put usage in every chunk, so that stream is sent as
asked and its cached tokens go unmeasured: ``InferenceRequest.adds_usage``.) Events are
forwarded as soon as they are complete (the engines write one whole event per write, so
in practice as each chunk arrives); only a partial trailing event is held back until its
end arrives.

SGLang's native ``/generate`` reports its tokens in every answer's ``meta_info``
(``prompt_tokens``, ``cached_tokens``; a batch answers a list, the first its routed
prompt's), a stream's in each event (the last one whole): :func:`generate_usage_of` and
:class:`GenerateRelay`, which forwards every byte as it comes and reads the last event.
"""

from __future__ import annotations

from dataclasses import dataclass

import msgspec


class _Details(msgspec.Struct):
    cached_tokens: int | None = None


class _Usage(msgspec.Struct):
    prompt_tokens: int | None = None
    prompt_tokens_details: _Details | None = None


class _Envelope(msgspec.Struct):
    usage: _Usage | None = None
    choices: msgspec.Raw = msgspec.Raw(b"null")


_envelope = msgspec.json.Decoder(_Envelope)


class _MetaInfo(msgspec.Struct):
    prompt_tokens: int | None = None
    cached_tokens: int | None = None


class _Generated(msgspec.Struct):
    meta_info: _MetaInfo | None = None


_generated = msgspec.json.Decoder(_Generated | list[_Generated])
_EVENT_END = b"\n\n"
_DATA = b"data:"
_USAGE = b'"usage"'
_NO_USAGE = (b'"usage":null', b'"usage": null')  # SGLang's every chunk but the last


@dataclass(slots=True)
class Usage:
    """What the engine reported for one request (None: it did not say). ``final``: the
    request's whole usage (a whole answer's, or a stream's usage chunk), not a chunk's so
    far (``continuous_usage_stats``), which never carries cached tokens from vLLM."""

    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    final: bool = True


def usage_of(body: bytes) -> Usage | None:
    """The usage of a JSON response body, or None when it has none or is not JSON."""
    envelope = _decode(body)
    return None if envelope is None else _usage(envelope)


def generate_usage_of(body: bytes) -> Usage | None:
    """The tokens a ``/generate`` answer (or one streamed event) reports in its
    ``meta_info``; a batch's first answer's. None when it has none or is not JSON."""
    try:
        answer = _generated.decode(body)
    except (msgspec.DecodeError, msgspec.ValidationError, RecursionError):
        return None
    if isinstance(answer, list):
        if not answer:
            return None
        answer = answer[0]
    meta = answer.meta_info
    return None if meta is None else Usage(meta.prompt_tokens, meta.cached_tokens)


def _decode(data: bytes) -> _Envelope | None:
    try:
        return _envelope.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError, RecursionError):
        return None  # passed on as the engine sent it


def _usage(envelope: _Envelope, final: bool = True) -> Usage | None:
    usage = envelope.usage
    if usage is None:
        return None
    details = usage.prompt_tokens_details
    cached = None if details is None else details.cached_tokens
    return Usage(usage.prompt_tokens, cached, final)


class SseRelay:
    """One ``text/event-stream`` on its way to the client; ``strip_usage`` removes the
    usage-only event the proxy asked for on the client's behalf."""

    __slots__ = ("_pending", "strip_usage", "usage")

    def __init__(self, *, strip_usage: bool) -> None:
        self.strip_usage = strip_usage
        self.usage: Usage | None = None
        self._pending = b""

    def feed(self, chunk: bytes) -> bytes:
        """The bytes to forward now (whole events) for ``chunk`` just received."""
        data = self._pending + chunk if self._pending else chunk
        end = data.rfind(_EVENT_END)
        if end < 0:
            self._pending = data
            return b""
        end += len(_EVENT_END)
        self._pending = data[end:]
        complete = data[:end] if self._pending else data
        if _USAGE not in complete or _only_null_usage(complete):
            return complete
        return b"".join(self._keep(event) for event in complete.split(_EVENT_END)[:-1])

    def flush(self) -> bytes:
        """What is left when the upstream stream ends (an event without its end)."""
        rest, self._pending = self._pending, b""
        return rest

    def _keep(self, event: bytes) -> bytes:
        if _USAGE in event and event.startswith(_DATA):
            envelope = _decode(event[len(_DATA) :])
            if envelope is not None and envelope.usage is not None:
                usage_only = _empty(envelope.choices)
                self.usage = _usage(envelope, final=usage_only)
                if self.strip_usage and usage_only:
                    return b""
        return event + _EVENT_END


def _only_null_usage(events: bytes) -> bool:
    """Whether every ``"usage"`` key in ``events`` is null (a key inside a JSON string
    has its quotes escaped, so these count keys alone): nothing to read or strip."""
    return events.count(_USAGE) == sum(events.count(null) for null in _NO_USAGE)


def _empty(choices: msgspec.Raw) -> bool:
    return bytes(choices).strip() == b"[]"


class GenerateRelay:
    """One ``/generate`` stream on its way to the client: every byte forwarded as it
    came, the last ``data:`` event before ``[DONE]`` kept for its ``meta_info``."""

    __slots__ = ("_last", "_pending")

    def __init__(self) -> None:
        self._pending = b""  # the bytes after the last whole event
        self._last = b""  # the last whole event's data

    def feed(self, chunk: bytes) -> bytes:
        data = self._pending + chunk if self._pending else chunk
        end = data.rfind(_EVENT_END)
        if end < 0:
            self._pending = data
            return chunk
        self._pending = data[end + len(_EVENT_END) :]
        for event in reversed(data[:end].split(_EVENT_END)):
            if event.startswith(_DATA) and event[len(_DATA) :].strip() != b"[DONE]":
                self._last = event[len(_DATA) :]
                break
        return chunk

    def flush(self) -> bytes:
        return b""  # everything was forwarded as it came

    @property
    def usage(self) -> Usage | None:
        return generate_usage_of(self._last) if self._last else None
