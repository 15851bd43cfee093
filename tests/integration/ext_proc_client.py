"""Envoy's side of an ext_proc stream, message for message, for the picker's tests.

The messages are the ones Envoy's ext_proc filter sends (request headers with
``protocol_config`` on the first message and the subset hint in ``metadata_context``,
body pieces, response headers with the endpoint that served, response body pieces,
trailers); :class:`ExtProcCall` writes them and reads the picker's answers.
"""

from __future__ import annotations

from collections.abc import Iterable

import grpc
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ext_proc
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ext_proc_grpc
from google.protobuf import struct_pb2

from dataplane.epp.messages import (
    BUFFERED,
    FULL_DUPLEX,
    LB_NAMESPACE,
    SERVED,
    SUBSET,
    SUBSET_NAMESPACE,
)


def _header_map(pairs: Iterable[tuple[str, str]]) -> base_pb2.HeaderMap:
    return base_pb2.HeaderMap(
        headers=[base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in pairs]
    )


def request_headers(
    path: str = "/v1/completions",
    *,
    extra: Iterable[tuple[str, str]] = (),
    end_of_stream: bool = False,
    mode: int = FULL_DUPLEX,
    subset: list[str] | str | None = None,
) -> ext_proc.ProcessingRequest:
    pairs = [(":method", "POST"), (":path", path), (":authority", "gateway"),
             (":scheme", "http"), ("content-type", "application/json"), *extra]  # fmt: skip
    message = ext_proc.ProcessingRequest(
        request_headers=ext_proc.HttpHeaders(
            headers=_header_map(pairs), end_of_stream=end_of_stream
        ),
        protocol_config=ext_proc.ProtocolConfiguration(
            request_body_mode=mode, response_body_mode=mode if mode == FULL_DUPLEX else BUFFERED
        ),
    )
    if subset is not None:
        hint = struct_pb2.Struct()
        hint.update({SUBSET: subset})
        message.metadata_context.filter_metadata[SUBSET_NAMESPACE].CopyFrom(hint)
    return message


def request_body(data: bytes, end_of_stream: bool) -> ext_proc.ProcessingRequest:
    return ext_proc.ProcessingRequest(
        request_body=ext_proc.HttpBody(body=data, end_of_stream=end_of_stream)
    )


def response_headers(
    status: int = 200, content_type: str = "application/json", served: str | None = None
) -> ext_proc.ProcessingRequest:
    pairs = [(":status", str(status)), ("content-type", content_type)]
    message = ext_proc.ProcessingRequest(
        response_headers=ext_proc.HttpHeaders(headers=_header_map(pairs))
    )
    if served is not None:
        lb = struct_pb2.Struct()
        lb.update({SERVED: served})
        message.metadata_context.filter_metadata[LB_NAMESPACE].CopyFrom(lb)
    return message


def response_body(data: bytes, end_of_stream: bool) -> ext_proc.ProcessingRequest:
    return ext_proc.ProcessingRequest(
        response_body=ext_proc.HttpBody(body=data, end_of_stream=end_of_stream)
    )


def pieces(data: bytes, size: int) -> list[bytes]:
    return [data[i : i + size] for i in range(0, len(data), size)]


def header_of(common: ext_proc.CommonResponse, name: str) -> str | None:
    for option in common.header_mutation.set_headers:
        if option.header.key == name:
            return option.header.raw_value.decode()
    return None


def destination_metadata(answer: ext_proc.ProcessingResponse) -> str:
    return (
        answer.dynamic_metadata.fields[LB_NAMESPACE]
        .struct_value.fields["x-gateway-destination-endpoint"]
        .string_value
    )


def streamed(
    answers: Iterable[ext_proc.ProcessingResponse], field: str
) -> tuple[bytes, list[int], bool]:
    """The bytes given back in ``field`` (request_body or response_body) full-duplex
    answers, each piece's size, and whether the last one ended the stream."""
    data, sizes, ended = b"", [], False
    for answer in answers:
        piece = getattr(answer, field).response.body_mutation.streamed_response
        data += piece.body
        sizes.append(len(piece.body))
        ended = piece.end_of_stream
    return data, sizes, ended


class ExtProcCall:
    """One ``Process`` stream on ``channel``."""

    def __init__(self, channel: grpc.aio.Channel) -> None:
        self.call = ext_proc_grpc.ExternalProcessorStub(channel).Process()

    async def send(self, *messages: ext_proc.ProcessingRequest) -> None:
        for message in messages:
            await self.call.write(message)

    async def read(self, count: int) -> list[ext_proc.ProcessingResponse]:
        answers = []
        for _ in range(count):
            answer = await self.call.read()
            assert answer is not grpc.aio.EOF, f"the stream ended after {answers}"
            answers.append(answer)
        return answers

    async def close(self) -> None:
        await self.call.done_writing()
        assert await self.call.read() is grpc.aio.EOF
