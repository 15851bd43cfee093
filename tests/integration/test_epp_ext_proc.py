"""kvroute-epp's ext_proc server driven as Envoy drives it, on a real RoutingState stream.

Each test starts a scripted ``RoutingState`` server (tests/integration/routing_state_server)
with three replicas, one of which holds the prompt's blocks, and a real picker
(``EppService``) watching it; an ext_proc client sends Envoy's message sequences in
full-duplex and buffered body modes and reads the answers.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest
import trustme
from grpc_health.v1 import health_pb2, health_pb2_grpc

from dataplane.epp.messages import BODY_CHUNK_BYTES, BUFFERED, DESTINATION, BodyMode
from dataplane.epp.service import EXT_PROC_SERVICE, EppService
from dataplane.epp.settings import EppSettings
from kvcore.keys import block_keys
from kvcore.pb import routing_pb2
from kvroute.servers import free_port
from tests.integration.ext_proc_client import (
    ExtProcCall,
    destination_metadata,
    header_of,
    pieces,
    request_body,
    request_headers,
    response_body,
    response_headers,
    streamed,
)
from tests.integration.routing_state_server import RoutingStateServer
from tests.unit.dataplane.state_messages import MODEL, load, replica

pytestmark = pytest.mark.integration
PROMPT = list(range(1000, 1064))  # four blocks of 16, held by r1
KEYS = block_keys(PROMPT, model=MODEL)
PADDING = "x" * 200_000  # a body of some 200 KB: four pieces back
R1 = "127.0.0.1:9001"
STREAMED = BodyMode.STREAMED
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def completion(prompt: list[int], **fields: Any) -> bytes:
    return json.dumps({"model": MODEL, "prompt": prompt, "max_tokens": 4, **fields}).encode()


def settings(address: str, **fields: Any) -> EppSettings:
    values: dict[str, Any] = dict(
        controlplane=[address], host="127.0.0.1", grpc_port=0, health_port=0, metrics_port=0,
        epp_id="epp-1", report_interval_s=0.05, shutdown_grace_s=0,
    )  # fmt: skip
    return EppSettings(**(values | fields))


@pytest.fixture
async def server() -> AsyncIterator[RoutingStateServer]:
    server = RoutingStateServer(3, [replica(0), replica(1), replica(2)], {1: KEYS})
    await server.start()
    yield server
    await server.stop()


async def started(settings: EppSettings) -> EppService:
    service = EppService(settings)
    await service.start()
    async with asyncio.timeout(10):
        await service.state_client.wait_ready()
    return service


@pytest.fixture
async def epp(server: RoutingStateServer) -> AsyncIterator[EppService]:
    service = await started(settings(server.address, sheddable_objectives="batch"))
    yield service
    await service.aclose()


@pytest.fixture
async def channel(epp: EppService) -> AsyncIterator[grpc.aio.Channel]:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{epp.ports['grpc']}") as channel:
        yield channel


async def picked_full_duplex(
    call: ExtProcCall, body: bytes, **headers: Any
) -> tuple[Any, bytes, list[int]]:
    """Send a request full-duplex in Envoy's pieces; the headers answer, the body given
    back and its pieces' sizes."""
    chunks = pieces(body, 16_384)
    await call.send(request_headers(**headers))
    await call.send(*(request_body(c, i == len(chunks) - 1) for i, c in enumerate(chunks)))
    [answer] = await call.read(1)
    assert answer.WhichOneof("response") == "request_headers", answer
    length = int(header_of(answer.request_headers.response, "content-length") or 0)
    echoed, sizes, ended = streamed(
        await call.read(max(1, math.ceil(length / BODY_CHUNK_BYTES))), "request_body"
    )
    assert ended and len(echoed) == length
    return answer, echoed, sizes


async def test_full_duplex_picks_the_holder_echoes_the_body_and_counts_the_usage(
    server: RoutingStateServer, epp: EppService, channel: grpc.aio.Channel
) -> None:
    body = completion(PROMPT, user=PADDING)
    call = ExtProcCall(channel)
    answer, echoed, sizes = await picked_full_duplex(call, body)
    common = answer.request_headers.response
    endpoints = header_of(common, DESTINATION)
    assert endpoints is not None and endpoints.split(",")[0] == R1
    assert sorted(endpoints.split(",")) == ["127.0.0.1:9000", R1, "127.0.0.1:9002"]
    assert destination_metadata(answer) == endpoints and common.clear_route_cache
    assert echoed == body and max(sizes) <= BODY_CHUNK_BYTES and len(sizes) == 4
    assert epp.fleet.inflight.total() == 1
    # 48: as vLLM caps a hit, the prompt's last block is computed
    usage = {"prompt_tokens": len(PROMPT), "prompt_tokens_details": {"cached_tokens": 48}}
    answer_body = json.dumps({"choices": [{"text": "hi"}], "usage": usage}).encode()
    await call.send(response_headers(served=R1))
    [headers_answer] = await call.read(1)
    assert headers_answer.WhichOneof("response") == "response_headers"
    half = len(answer_body) // 2
    await call.send(
        response_body(answer_body[:half], False), response_body(answer_body[half:], True)
    )
    given_back, _, ended = streamed(await call.read(2), "response_body")
    assert given_back == answer_body and ended
    await call.close()
    assert epp.fleet.inflight.total() == 0
    key = ("default", "r1")
    assert epp.metrics.predicted.values[key] == 48 and epp.metrics.measured.values[key] == 48
    assert epp.metrics.requests.values[("default", "r1", "ok")] == 1
    async with asyncio.timeout(5):
        await server.wait_for_reports(1)
    rows = [row for report in server.reports for row in report.rows if row.replica_id == "r1"]
    assert rows[0].counters.predicted_cached_tokens == 48 == rows[0].counters.measured_cached_tokens


async def test_a_stream_gets_usage_added_and_taken_back_out(
    epp: EppService, channel: grpc.aio.Channel
) -> None:
    body = completion(PROMPT, stream=True)
    call = ExtProcCall(channel)
    _, echoed, _ = await picked_full_duplex(call, body)
    assert json.loads(echoed) == json.loads(body) | {"stream_options": {"include_usage": True}}
    events = [
        b'data: {"choices":[{"text":"a"}],"usage":null}\n\n',
        b'data: {"choices":[],"usage":{"prompt_tokens":64,'
        b'"prompt_tokens_details":{"cached_tokens":48}}}\n\n',
        b"data: [DONE]\n\n",
    ]
    await call.send(response_headers(content_type="text/event-stream"))
    await call.read(1)
    await call.send(*(response_body(e, i == 2) for i, e in enumerate(events)))
    given_back, _, ended = streamed(await call.read(2), "response_body")  # the usage event: none
    assert given_back == events[0] + events[2] and ended
    await call.close()
    assert epp.metrics.measured.values[("default", "r1")] == 48


async def test_buffered_mode_lets_the_headers_through_and_picks_on_the_body(
    epp: EppService, channel: grpc.aio.Channel
) -> None:
    body = completion(PROMPT)
    call = ExtProcCall(channel)
    await call.send(request_headers(mode=BUFFERED))
    [first] = await call.read(1)
    assert first.WhichOneof("response") == "request_headers"
    assert not first.request_headers.response.header_mutation.set_headers
    await call.send(request_body(body, True))
    [answer] = await call.read(1)
    common = answer.request_body.response
    assert header_of(common, DESTINATION).split(",")[0] == R1  # type: ignore[union-attr]
    assert destination_metadata(answer) == header_of(common, DESTINATION)
    assert common.clear_route_cache and not common.HasField("body_mutation")
    await call.send(response_headers(), response_body(b'{"usage":{"prompt_tokens":64}}', True))
    answers = await call.read(2)
    assert [a.WhichOneof("response") for a in answers] == ["response_headers", "response_body"]
    assert not answers[1].response_body.response.HasField("body_mutation")  # let through
    await call.close()


@pytest.mark.parametrize(
    "hint", [["127.0.0.1:9002"], "127.0.0.1:9002, 127.0.0.1:9999"], ids=["list", "string"]
)
async def test_the_subset_hint_is_honoured_and_503_when_none_of_it_serves(
    epp: EppService, channel: grpc.aio.Channel, hint: list[str] | str
) -> None:
    call = ExtProcCall(channel)
    answer, _, _ = await picked_full_duplex(call, completion(PROMPT), subset=hint)
    assert header_of(answer.request_headers.response, DESTINATION) == "127.0.0.1:9002"
    call.call.cancel()
    call = ExtProcCall(channel)
    await call.send(
        request_headers(subset=["10.1.2.3:8000"]), request_body(completion(PROMPT), True)
    )
    [refused] = await call.read(1)
    assert refused.immediate_response.status.code == 503
    assert json.loads(refused.immediate_response.body)["error"]["code"] == "no_replica"
    await call.close()


async def test_a_request_without_a_body_is_picked_from_its_headers(
    epp: EppService, channel: grpc.aio.Channel
) -> None:
    """GET /v1/models: headers that end the request, answered at once with one replica
    serving the fleet's model (the least loaded), as the proxy forwards it."""
    call = ExtProcCall(channel)
    await call.send(request_headers("/v1/models", end_of_stream=True))
    [answer] = await call.read(1)
    endpoint = header_of(answer.request_headers.response, DESTINATION)
    assert endpoint in {"127.0.0.1:9000", R1, "127.0.0.1:9002"}
    assert destination_metadata(answer) == endpoint
    await call.send(response_headers(), response_body(b'{"data":[]}', True))
    await call.read(2)
    await call.close()
    assert epp.fleet.inflight.total() == 0


async def test_an_inference_request_with_no_body_is_a_400(
    epp: EppService, channel: grpc.aio.Channel
) -> None:
    call = ExtProcCall(channel)
    await call.send(request_headers(end_of_stream=True))
    [refused] = await call.read(1)
    assert refused.immediate_response.status.code == 400
    assert json.loads(refused.immediate_response.body)["error"]["type"] == "invalid_request_error"
    await call.close()


async def test_a_sheddable_request_gets_429_while_every_replica_is_saturated(
    server: RoutingStateServer, epp: EppService, channel: grpc.aio.Channel
) -> None:
    now = time.time()
    server.publish(
        routing_pb2.Delta(
            loads=[routing_pb2.LoadUpdate(ordinal=o, load=load(64, 8, now)) for o in range(3)]
        )
    )
    async with asyncio.timeout(5):
        await epp.state_client.wait_until(
            lambda s: all(r.load >= 1 for r in s.views.view(MODEL).replicas())
        )
    body = completion(PROMPT)
    call = ExtProcCall(channel)
    await call.send(
        request_headers(extra=[("x-gateway-inference-objective", "batch")]),
        request_body(body, True),
    )
    [refused] = await call.read(1)
    assert refused.immediate_response.status.code == 429
    assert json.loads(refused.immediate_response.body)["error"]["code"] == "saturated"
    await call.close()
    call = ExtProcCall(channel)  # an objective not sheddable is still served
    answer, _, _ = await picked_full_duplex(
        call, body, extra=[("x-gateway-inference-objective", "chat")]
    )
    assert header_of(answer.request_headers.response, DESTINATION)
    call.call.cancel()


async def test_a_body_over_the_limit_is_413(server: RoutingStateServer) -> None:
    epp = await started(settings(server.address, max_body_bytes=2048))
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{epp.ports['grpc']}") as channel:
            call = ExtProcCall(channel)
            await call.send(
                request_headers(), request_body(completion(PROMPT, user=PADDING[:3000]), False)
            )
            [refused] = await call.read(1)
            assert refused.immediate_response.status.code == 413
            assert (
                json.loads(refused.immediate_response.body)["error"]["type"]
                == "invalid_request_error"
            )
            await call.close()
    finally:
        await epp.aclose()


async def test_a_client_gone_mid_answer_releases_the_replica(
    epp: EppService, channel: grpc.aio.Channel
) -> None:
    call = ExtProcCall(channel)
    await picked_full_duplex(call, completion(PROMPT, stream=True))
    await call.send(response_headers(content_type="text/event-stream"))
    await call.read(1)
    await call.send(response_body(b'data: {"choices":[{"text":"a"}]}\n\n', False))
    await call.read(1)
    assert epp.fleet.inflight.total() == 1
    call.call.cancel()
    async with asyncio.timeout(5):
        await epp.servicer.wait_idle()
    assert epp.fleet.inflight.total() == 0
    assert epp.metrics.requests.values[("default", "r1", "cancelled")] == 1
    assert ("default", "r1") not in epp.metrics.predicted.values  # no fidelity for it


@pytest.mark.parametrize(
    "sequence",
    [
        pytest.param([request_body(b"{}", True)], id="body before headers"),
        pytest.param([request_headers(), request_headers()], id="headers twice"),
        pytest.param(
            [request_headers(), request_body(b"{", False), response_headers()],
            id="no end_of_stream",
        ),
        pytest.param([response_headers()], id="response first"),
        pytest.param([request_headers(mode=STREAMED)], id="streamed mode"),
    ],
)
async def test_a_malformed_sequence_ends_its_stream_not_the_server(
    epp: EppService, channel: grpc.aio.Channel, sequence: list[Any]
) -> None:
    call = ExtProcCall(channel)
    await call.send(*sequence)
    with pytest.raises(grpc.aio.AioRpcError) as failure:
        await call.read(1)
    assert failure.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert epp.fleet.inflight.total() == 0
    call = ExtProcCall(channel)  # the server still serves
    answer, _, _ = await picked_full_duplex(call, completion(PROMPT))
    assert header_of(answer.request_headers.response, DESTINATION).startswith(R1)  # type: ignore[union-attr]
    call.call.cancel()


async def test_readiness_waits_for_the_routing_state_then_serves() -> None:
    port = free_port()
    epp = EppService(settings(f"127.0.0.1:{port}"))
    await epp.start()
    server = RoutingStateServer(3, [replica(0)], port=port)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{epp.ports['health']}") as channel:
            health = health_pb2_grpc.HealthStub(channel)
            check = health_pb2.HealthCheckRequest
            assert (await health.Check(check(service="liveness"))).status == SERVING
            for service in ("readiness", EXT_PROC_SERVICE):
                assert (await health.Check(check(service=service))).status == NOT_SERVING
            watch = health.Watch(check(service="readiness"))
            assert (await watch.read()).status == NOT_SERVING
            await server.start()
            async with asyncio.timeout(10):
                assert (await watch.read()).status == SERVING
            assert (await health.Check(check(service=EXT_PROC_SERVICE))).status == SERVING
            watch.cancel()
    finally:
        await epp.aclose()
        await server.stop()


async def test_stopping_turns_readiness_off_and_streams_go_on(
    epp: EppService, channel: grpc.aio.Channel
) -> None:
    """What SIGTERM does first: the gateway and Kubernetes stop sending new requests."""
    await epp.stop_serving()
    async with grpc.aio.insecure_channel(f"127.0.0.1:{epp.ports['health']}") as probes:
        health = health_pb2_grpc.HealthStub(probes)
        for service in ("readiness", EXT_PROC_SERVICE):
            check = health_pb2.HealthCheckRequest(service=service)
            assert (await health.Check(check)).status == NOT_SERVING
        check = health_pb2.HealthCheckRequest(service="liveness")
        assert (await health.Check(check)).status == SERVING
    call = ExtProcCall(channel)
    answer, _, _ = await picked_full_duplex(call, completion(PROMPT))
    assert header_of(answer.request_headers.response, DESTINATION).startswith(R1)  # type: ignore[union-attr]
    call.call.cancel()


async def test_the_ext_proc_port_serves_tls_when_given_a_certificate(
    server: RoutingStateServer, tmp_path: Any
) -> None:
    authority = trustme.CA()
    leaf = authority.issue_cert("127.0.0.1")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    leaf.private_key_pem.write_to_path(str(key))
    leaf.cert_chain_pems[0].write_to_path(str(cert))
    epp = await started(settings(server.address, tls_cert=str(cert), tls_key=str(key)))
    try:
        credentials = grpc.ssl_channel_credentials(authority.cert_pem.bytes())
        async with grpc.aio.secure_channel(
            f"127.0.0.1:{epp.ports['grpc']}", credentials
        ) as channel:
            call = ExtProcCall(channel)
            answer, _, _ = await picked_full_duplex(call, completion(PROMPT))
            assert header_of(answer.request_headers.response, DESTINATION).startswith(R1)  # type: ignore[union-attr]
            call.call.cancel()
    finally:
        await epp.aclose()
