"""The ext_proc messages an endpoint picker reads and writes, as Gateway API Inference
Extension's endpoint picker protocol (its ``004-endpoint-picker-protocol``) shapes them.

Read: a request's headers (``raw_value``, else ``value``), the subset hint in its filter
metadata (``envoy.lb.subset_hint`` / ``x-gateway-destination-endpoint-subset``, a list
or one comma-separated string), the endpoint that served (``envoy.lb`` /
``x-gateway-destination-endpoint-served``, else Envoy's ``upstream.address``
attribute) and the body modes Envoy says it uses
(``protocol_config``, sent on a stream's first message).

Written: the pick as both the ``x-gateway-destination-endpoint`` header and the dynamic
metadata ``envoy.lb`` / ``x-gateway-destination-endpoint`` (one value, the primary
then its fallbacks, ``ip:port,ip:port``), with ``clear_route_cache`` so the route is
chosen again with it; a body given back in ``streamed_response`` pieces of at most
:data:`BODY_CHUNK_BYTES` (Envoy's own limit is 64 KiB a piece); and a refusal as an
``ImmediateResponse`` with OpenAI's error body.
"""

from __future__ import annotations

from collections.abc import Iterator

from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ext_proc
from envoy.type.v3 import http_status_pb2
from google.protobuf import struct_pb2

from dataplane.http_errors import ApiError

BODY_CHUNK_BYTES = 62_000
DESTINATION = "x-gateway-destination-endpoint"
SERVED = "x-gateway-destination-endpoint-served"
SUBSET = "x-gateway-destination-endpoint-subset"
UPSTREAM_ADDRESS = "upstream.address"
LB_NAMESPACE = "envoy.lb"
SUBSET_NAMESPACE = "envoy.lb.subset_hint"
OBJECTIVE_HEADERS = ("x-gateway-inference-objective", "x-llm-d-inference-objective")
BodyMode = processing_mode_pb2.ProcessingMode.BodySendMode
FULL_DUPLEX = processing_mode_pb2.ProcessingMode.FULL_DUPLEX_STREAMED
BUFFERED = processing_mode_pb2.ProcessingMode.BUFFERED
NO_BODY = processing_mode_pb2.ProcessingMode.NONE
_OVERWRITE = base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD


def header_map(headers: base_pb2.HeaderMap) -> dict[str, str]:
    """Headers by lower-case name (``:path`` and the other pseudo-headers included); a
    repeated one keeps its first value."""
    out: dict[str, str] = {}
    for header in headers.headers:
        value = header.raw_value.decode("latin-1") if header.raw_value else header.value
        out.setdefault(header.key.lower(), value)
    return out


def subset_hint(request: ext_proc.ProcessingRequest) -> frozenset[str] | None:
    """The endpoints (``ip:port``) the gateway allows, or ``None`` when it sets no hint
    (an empty set: a hint that allows none)."""
    entry = request.metadata_context.filter_metadata.get(SUBSET_NAMESPACE)
    if entry is None or SUBSET not in entry.fields:
        return None
    value = entry.fields[SUBSET]
    kind = value.WhichOneof("kind")
    if kind == "string_value":
        items = [value.string_value]
    elif kind == "list_value":
        items = [v.string_value for v in value.list_value.values if v.HasField("string_value")]
    else:
        items = []
    return frozenset(part.strip() for item in items for part in item.split(",") if part.strip())


def served_endpoint(request: ext_proc.ProcessingRequest) -> str | None:
    """The endpoint that served the request, on its response messages: as the protocol
    has the gateway say it (``envoy.lb`` metadata), else Envoy's ``upstream.address``
    attribute (a plain Envoy's ``response_attributes``)."""
    entry = request.metadata_context.filter_metadata.get(LB_NAMESPACE)
    if entry is not None and SERVED in entry.fields:
        return entry.fields[SERVED].string_value or None
    for attributes in request.attributes.values():
        if UPSTREAM_ADDRESS in attributes.fields:
            return attributes.fields[UPSTREAM_ADDRESS].string_value or None
    return None


def _set(name: str, value: str) -> base_pb2.HeaderValueOption:
    return base_pb2.HeaderValueOption(
        header=base_pb2.HeaderValue(key=name, raw_value=value.encode("latin-1")),
        append_action=_OVERWRITE,
    )


def pick_mutation(
    endpoints: str, content_length: int | None
) -> tuple[ext_proc.CommonResponse, struct_pb2.Struct]:
    """The pick as a header mutation (and the body's new length, when it was read) that
    clears the route cache, and its dynamic metadata."""
    headers = [_set(DESTINATION, endpoints)]
    if content_length is not None:
        headers.append(_set("content-length", str(content_length)))
    common = ext_proc.CommonResponse(
        header_mutation=ext_proc.HeaderMutation(set_headers=headers), clear_route_cache=True
    )
    metadata = struct_pb2.Struct()
    metadata.get_or_create_struct(LB_NAMESPACE)[DESTINATION] = endpoints
    return common, metadata


def headers_response(
    common: ext_proc.CommonResponse | None = None,
    metadata: struct_pb2.Struct | None = None,
    *,
    response: bool = False,
) -> ext_proc.ProcessingResponse:
    """An answer to a request's (or ``response``'s) headers: go on, with ``common``'s
    changes."""
    answer = ext_proc.HeadersResponse(response=common or ext_proc.CommonResponse())
    if response:
        return ext_proc.ProcessingResponse(response_headers=answer, dynamic_metadata=metadata)
    return ext_proc.ProcessingResponse(request_headers=answer, dynamic_metadata=metadata)


def body_response(
    common: ext_proc.CommonResponse | None = None,
    metadata: struct_pb2.Struct | None = None,
    *,
    response: bool = False,
) -> ext_proc.ProcessingResponse:
    """An answer to a body message of a buffered or streamed (not full-duplex) mode."""
    answer = ext_proc.BodyResponse(response=common or ext_proc.CommonResponse())
    if response:
        return ext_proc.ProcessingResponse(response_body=answer, dynamic_metadata=metadata)
    return ext_proc.ProcessingResponse(request_body=answer, dynamic_metadata=metadata)


def streamed_body(
    body: bytes, *, end_of_stream: bool, response: bool = False
) -> Iterator[ext_proc.ProcessingResponse]:
    """``body`` given back in full-duplex mode: pieces of at most :data:`BODY_CHUNK_BYTES`,
    the last one ending the stream when ``end_of_stream`` (one empty piece for no bytes)."""
    pieces = [body[i : i + BODY_CHUNK_BYTES] for i in range(0, len(body), BODY_CHUNK_BYTES)]
    pieces = pieces or [b""]
    for index, piece in enumerate(pieces):
        last = end_of_stream and index == len(pieces) - 1
        mutation = ext_proc.BodyMutation(
            streamed_response=ext_proc.StreamedBodyResponse(body=piece, end_of_stream=last)
        )
        answer = ext_proc.BodyResponse(response=ext_proc.CommonResponse(body_mutation=mutation))
        if response:
            yield ext_proc.ProcessingResponse(response_body=answer)
        else:
            yield ext_proc.ProcessingResponse(request_body=answer)


def trailers_response(*, response: bool = False) -> ext_proc.ProcessingResponse:
    if response:
        return ext_proc.ProcessingResponse(response_trailers=ext_proc.TrailersResponse())
    return ext_proc.ProcessingResponse(request_trailers=ext_proc.TrailersResponse())


def immediate(error: ApiError) -> ext_proc.ProcessingResponse:
    """The gateway answers the client itself: ``error``'s status and OpenAI error body."""
    headers = [_set("content-type", "application/json")]
    headers += [
        _set(name.decode("latin-1"), value.decode("latin-1")) for name, value in error.headers
    ]
    answer = ext_proc.ImmediateResponse(
        status=http_status_pb2.HttpStatus(code=error.status),
        headers=ext_proc.HeaderMutation(set_headers=headers),
        body=error.encode(),
        details=f"kvroute_epp_{error.code or error.error_type}",
    )
    return ext_proc.ProcessingResponse(immediate_response=answer)
