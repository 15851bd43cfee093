"""One ext_proc stream: one HTTP request passing through the gateway, phase by phase.

Envoy opens a stream per request and sends its phases in order: request headers, the
body (full-duplex: in pieces, the last with ``end_of_stream``, or ended by trailers;
buffered: one message, after Envoy has its answer to the headers), then the response's
headers, body and trailers. The request body modes this picker takes, as Envoy announces
them in ``protocol_config`` (full-duplex when it does not, as the reference picker
assumes):

- ``FULL_DUPLEX_STREAMED``: the headers are answered only once the body has ended, with
  the pick; then the body is given back (the client's bytes, or with ``include_usage`` or
  the tenant's ``cache_salt`` added as the proxy adds them) in pieces, with its new
  ``content-length``;
- ``BUFFERED`` (Envoy Gateway's ``Buffered``): the headers are let through at once, and
  the body's answer carries the pick (header mutations apply to a buffered body);
- ``NONE``, or headers that end the request: picked from the headers alone.

The response passes back: its headers and body are let through (full-duplex: each piece
given back as it came, less the usage event the picker asked for on the client's
behalf), and its usage (a whole body's, or a stream's last usage event) is counted as
the proxy counts it; so the gateway must send the response's headers and body (a stream
that ends before its answer has passed back whole counts as cancelled). A request
refused gets an ``ImmediateResponse``; a message out of order (a body before headers, a
phase twice, a response before the request ended, a body past its end) ends the stream
with ``INVALID_ARGUMENT`` and is logged, the server serving on.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass

from envoy.service.ext_proc.v3 import external_processor_pb2 as ext_proc

from dataplane.epp import messages
from dataplane.epp.messages import BUFFERED, FULL_DUPLEX, NO_BODY
from dataplane.epp.picker import Pick, Picker
from dataplane.http_errors import ApiError, PayloadTooLarge
from dataplane.relay import GenerateRelay, SseRelay, generate_usage_of, usage_of

log = logging.getLogger("dataplane.epp")
Answers = Iterator[ext_proc.ProcessingResponse]


class ProtocolViolation(Exception):
    """A message the ext_proc protocol does not allow here: the stream ends with an error."""


@dataclass(frozen=True, slots=True)
class StreamOptions:
    max_body_bytes: int


class RequestStream:
    """The state of one ext_proc stream; :meth:`on_message` answers each message."""

    def __init__(self, picker: Picker, options: StreamOptions) -> None:
        self.picker = picker
        self.options = options
        self.phase = "start"  # start, request_body, picked, response_body, done
        self.request_mode = FULL_DUPLEX
        self.response_mode = FULL_DUPLEX
        self.headers: dict[str, str] = {}
        self.subset: frozenset[str] | None = None
        self.body = bytearray()
        self.pick: Pick | None = None
        self.status = 0
        self.streaming = False
        self.relay: SseRelay | GenerateRelay | None = None
        self.answer = bytearray()  # a whole answer, read for its usage at its end
        self.closed = False  # an immediate response was sent: Envoy ends the stream

    async def on_message(
        self, message: ext_proc.ProcessingRequest
    ) -> list[ext_proc.ProcessingResponse]:
        """The answers to one message; :class:`ProtocolViolation` when it is out of order."""
        kind = message.WhichOneof("request")
        hint = messages.subset_hint(message)
        if hint is not None:
            self.subset = hint
        try:
            if kind == "request_headers":
                return await self._request_headers(message)
            if kind == "request_body":
                return await self._request_body(message.request_body)
            if kind == "request_trailers":
                return await self._request_trailers()
            if kind == "response_headers":
                return list(self._response_headers(message))
            if kind == "response_body":
                return list(self._response_body(message.response_body))
            if kind == "response_trailers":
                return self._response_trailers()
        except ApiError as refusal:
            return self._refuse(refusal)
        raise ProtocolViolation(f"a message with no phase ({kind})")

    def end(self) -> None:
        """The stream ended, closed or cancelled: a request whose answer did not pass
        back whole is counted as cancelled (no fidelity figures: nothing measured), as
        the proxy counts a client gone; its replica is released either way."""
        pick, self.phase = self.pick, "done"
        if pick is not None:
            self.picker.finish(pick, self.status, "cancelled")

    # -- the request ----------------------------------------------------------------

    async def _request_headers(
        self, message: ext_proc.ProcessingRequest
    ) -> list[ext_proc.ProcessingResponse]:
        self._expect("start", "request headers")
        if message.HasField("protocol_config"):
            config = message.protocol_config
            self.request_mode = config.request_body_mode
            self.response_mode = config.response_body_mode
        self.headers = messages.header_map(message.request_headers.headers)
        if message.request_headers.end_of_stream or self.request_mode == NO_BODY:
            return [await self._picked_headers(None)]
        self.phase = "request_body"
        if self.request_mode == BUFFERED:
            return [messages.headers_response()]  # Envoy waits for it, then buffers
        if self.request_mode != FULL_DUPLEX:
            name = messages.BodyMode.Name(self.request_mode)
            raise ProtocolViolation(
                f"request body mode {name} is not supported: use FULL_DUPLEX_STREAMED or BUFFERED"
            )
        return []

    async def _request_body(self, body: ext_proc.HttpBody) -> list[ext_proc.ProcessingResponse]:
        self._expect("request_body", "a request body")
        if len(self.body) + len(body.body) > self.options.max_body_bytes:
            raise PayloadTooLarge(
                f"The request body is over {self.options.max_body_bytes} bytes.",
                code="request_too_large",
            )
        self.body += body.body
        if not body.end_of_stream:
            return []
        if self.request_mode == BUFFERED:
            return [await self._picked_body()]
        return [await self._picked_headers(len(self.body)), *self._echo(end_of_stream=True)]

    async def _request_trailers(self) -> list[ext_proc.ProcessingResponse]:
        """Trailers end a full-duplex body that had no ``end_of_stream``."""
        if self.phase != "request_body" or self.request_mode == BUFFERED:
            self._expect("picked", "request trailers")
            return [messages.trailers_response()]
        answers = [await self._picked_headers(len(self.body)), *self._echo(end_of_stream=False)]
        return [*answers, messages.trailers_response()]

    async def _picked_headers(self, length: int | None) -> ext_proc.ProcessingResponse:
        pick = await self._pick()
        if length is not None:
            length = len(pick.body)
        common, metadata = messages.pick_mutation(pick.addresses(), length)
        return messages.headers_response(common, metadata)

    async def _picked_body(self) -> ext_proc.ProcessingResponse:
        """A buffered body's answer: the pick, and the body if routing changed it."""
        original = bytes(self.body)
        pick = await self._pick()
        changed = pick.body != original
        common, metadata = messages.pick_mutation(
            pick.addresses(), len(pick.body) if changed else None
        )
        if changed:
            common.body_mutation.body = pick.body
        return messages.body_response(common, metadata)

    async def _pick(self) -> Pick:
        body = bytes(self.body)
        self.body = bytearray()
        pick = await self.picker.pick(
            self.headers, body, self.subset, add_usage=self.response_mode == FULL_DUPLEX
        )
        self.pick, self.phase = pick, "picked"
        pick.handed_at = time.perf_counter()
        return pick

    def _echo(self, *, end_of_stream: bool) -> Answers:
        assert self.pick is not None
        return messages.streamed_body(self.pick.body, end_of_stream=end_of_stream)

    # -- the response -----------------------------------------------------------------

    def _response_headers(self, message: ext_proc.ProcessingRequest) -> Answers:
        self._expect("picked", "response headers")
        pick = self.pick
        assert pick is not None
        headers = messages.header_map(message.response_headers.headers)
        self.picker.served_by(pick, messages.served_endpoint(message))
        self.status = int(headers.get(":status", "0") or 0)
        self.streaming = "text/event-stream" in headers.get("content-type", "")
        self.phase = "response_body"
        exchange = pick.exchange
        if exchange is not None and self.streaming:
            request = exchange.request
            if request.kind == "generate":
                self.relay = GenerateRelay()
            else:
                engine = pick.endpoints[pick.served].engine_kind
                strip = self.response_mode == FULL_DUPLEX and request.stream
                self.relay = SseRelay(strip_usage=strip and not request.wants_usage(engine))
        yield messages.headers_response(response=True)
        if message.response_headers.end_of_stream or self.response_mode == NO_BODY:
            self._answered()

    def _response_body(self, body: ext_proc.HttpBody) -> Answers:
        self._expect("response_body", "a response body")
        pick = self.pick
        assert pick is not None
        self.picker.first_byte(pick, self.status, self.streaming)
        chunk = body.body
        if self.relay is not None:
            chunk = self.relay.feed(chunk)
            if body.end_of_stream:
                chunk += self.relay.flush()
        elif pick.exchange is not None and len(self.answer) < self.options.max_body_bytes:
            self.answer += chunk
        if self.response_mode != FULL_DUPLEX:
            yield messages.body_response(response=True)
        elif chunk or body.end_of_stream:
            yield from messages.streamed_body(chunk, end_of_stream=body.end_of_stream,
                                              response=True)  # fmt: skip
        if body.end_of_stream:
            self._answered()

    def _response_trailers(self) -> list[ext_proc.ProcessingResponse]:
        if self.phase == "response_body":
            self._answered()
        self._expect("done", "response trailers")
        return [messages.trailers_response(response=True)]

    def _answered(self) -> None:
        """The answer ended whole: its usage counted as the proxy counts it."""
        pick = self.pick
        assert pick is not None
        exchange = pick.exchange
        if exchange is not None:
            if self.relay is not None:
                pick.usage = self.relay.usage
            elif exchange.request.kind == "generate":
                pick.usage = generate_usage_of(bytes(self.answer))
            else:
                pick.usage = usage_of(bytes(self.answer))
        self.picker.finish(pick, self.status, "ok")
        self.phase = "done"

    # -- refusals and order -----------------------------------------------------------

    def _refuse(self, refusal: ApiError) -> list[ext_proc.ProcessingResponse]:
        self.picker.refused(refusal)
        self.closed, self.phase = True, "done"
        return [messages.immediate(refusal)]

    def _expect(self, phase: str, what: str) -> None:
        if self.phase != phase:
            raise ProtocolViolation(f"{what} in phase {self.phase}")
