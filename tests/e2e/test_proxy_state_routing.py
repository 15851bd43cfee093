"""The proxy routing on a control plane's state, in front of real kvroute-sim replicas.

The state arrives as the control plane streams it (real ``routing.proto`` messages
applied to the service's ``FleetState``); the proxy runs in process on a real port. What
users notice: bearer keys are enforced in OpenAI's error shape; tenants whose workload
isolates them never share cached blocks on the engine; a saturated replica overflows.
"""

from __future__ import annotations

import hashlib
import json
import socket
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import ExitStack, asynccontextmanager
from typing import Any

import aiohttp
import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from dataplane.service import ProxyService
from dataplane.settings import ProxySettings
from dataplane.transport.server import HttpServer
from kvcore.pb import routing_pb2
from tests.unit.dataplane.state_messages import config, load, model_entry, replica, snapshot
from tests.unit.enginesim.simproc import SimProcess, cached_tokens

pytestmark = pytest.mark.e2e

MODEL = "sim-model"
SYSTEM = "You are a careful assistant who answers every question in one short line. " * 30
KEYS = {"alpha-secret": "alpha", "beta-secret": "beta"}


@pytest.fixture(scope="module")
def sims() -> Iterator[list[SimProcess]]:
    args = ("--instant", f"--model={MODEL}", "--max-model-len=4096", "--replay-endpoint=")
    with ExitStack() as stack:
        yield [stack.enter_context(SimProcess(*args)) for _ in range(2)]


def routing_state(
    sims: list[SimProcess], workload: dict[str, Any], capacity: int = 64, models: Any = None
) -> Any:
    """The fleet of ``sims``, each serving ``MODEL`` unless ``models`` names theirs."""
    replicas = []
    for ordinal, sim in enumerate(sims):
        model = MODEL if models is None else models[ordinal]
        info = replica(ordinal, model=model, capacity=capacity)
        info.base_url = sim.url
        replicas.append(info)
    rules = {"rules": [], "default_workload": workload["name"]}
    routing = config([workload], rules=rules, models=[model_entry(MODEL)])
    routing.api_keys.extend(
        routing_pb2.ApiKey(
            key_sha256=hashlib.sha256(secret.encode()).hexdigest(),
            tenant=tenant,
            default_workload=workload["name"],
            scopes=["inference"],
        )
        for secret, tenant in KEYS.items()
    )
    return snapshot(1, 1, replicas, routing=routing)


@asynccontextmanager
async def proxy(
    updates: Any, exporter: InMemorySpanExporter | None = None, **options: Any
) -> AsyncIterator[tuple[str, ProxyService]]:
    """The proxy's service on a free port, its state applied from ``updates``; ``options``
    are settings over the test's (bearer keys on, debug headers)."""
    settings = ProxySettings(
        **{"controlplane": ["127.0.0.1:9"], "debug_headers": True, "auth": True, **options},
        tracing=exporter is not None,
    )
    service = ProxyService(settings, span_exporter=exporter)
    for update in updates:
        service.fleet.apply(update)
    await service.upstream.start()
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    server = HttpServer(service.app, max_body_bytes=settings.max_body_bytes)
    await server.start(sock)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}", service
    finally:
        await server.aclose()
        await service.aclose()


async def chat(
    url: str, key: str | None, question: str, *, model: str | None = MODEL, **extra: str
) -> tuple[int, dict[str, str], Any]:
    """A chat through the proxy (``model`` None: the body names no model)."""
    headers = {"authorization": f"Bearer {key}"} if key else {}
    headers.update(extra)
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
    body: dict[str, Any] = {"messages": messages, "max_tokens": 2}
    if model is not None:
        body["model"] = model
    async with (
        aiohttp.ClientSession() as session,
        session.post(f"{url}/v1/chat/completions", json=body, headers=headers) as resp,
    ):
        return resp.status, dict(resp.headers), json.loads(await resp.read())


def cached(answer: Any) -> int:
    return cached_tokens(answer["usage"])


async def test_bearer_keys_are_required_and_tenants_never_share_cached_blocks(
    sims: list[SimProcess],
) -> None:
    workload = {"name": "isolated", "strategy": "prefix_hash", "tenant_isolation": True}
    async with proxy(routing_state(sims, workload)) as (url, _):
        for key, message in ((None, "Missing bearer"), ("wrong", "Incorrect API key")):
            status, _, answer = await chat(url, key, "Who am I?")
            assert status == 401 and message in answer["error"]["message"]
            assert answer["error"]["type"] == "authentication_error"
        status, headers, first = await chat(url, "alpha-secret", "What is a KV cache?")
        assert status == 200 and headers["x-kvroute-workload"] == "isolated"
        _, _, again = await chat(url, "alpha-secret", "And prefix caching?")
        _, _, other = await chat(url, "beta-secret", "And prefix caching?")
    assert cached(first) == 0 and cached(again) > 400
    assert cached(other) == 0  # same prompt, other tenant: the engine did not share it


async def test_a_request_naming_no_model_is_for_the_only_model_and_refused_behind_two(
    sims: list[SimProcess],
) -> None:
    workload = {"name": "default", "strategy": "kv_aware"}
    async with proxy(routing_state(sims, workload)) as (url, _):
        status, headers, answer = await chat(url, "alpha-secret", "Which model?", model=None)
        blocks = answer["usage"]["prompt_tokens"] // 16  # keyed with the model's tokenizer
        assert status == 200 and answer["model"] == MODEL
        assert headers["x-kvroute-prefix-blocks"].endswith(f"/{blocks}")
    two = routing_state(sims, workload, models=[MODEL, "other-model"])
    async with proxy(two) as (url, _):
        status, _, answer = await chat(url, "alpha-secret", "Which model?", model=None)
        assert status == 400 and answer["error"]["param"] == "model"
        assert f"serves other-model, {MODEL}" in answer["error"]["message"]
        status, _, answer = await chat(url, "alpha-secret", "Which model?")
        assert status == 200 and answer["model"] == MODEL


async def test_a_saturated_replica_overflows_to_the_other(sims: list[SimProcess]) -> None:
    workload = {"name": "default", "strategy": "prefix_hash", "load_threshold": 0.5}
    now = time.time()
    state = routing_state(sims, workload, capacity=4)
    async with proxy(state) as (url, service):
        status, headers, _ = await chat(url, "alpha-secret", "Where do I land?")
        assert status == 200
        owner = headers["x-kvroute-replica"]
        ordinal = next(
            e.ordinal for e in service.fleet.replicas.endpoints() if e.replica_id == owner
        )
        delta = routing_pb2.Delta(
            loads=[routing_pb2.LoadUpdate(ordinal=ordinal, load=load(4, 2, ts=now))]
        )
        service.fleet.apply(routing_pb2.StateUpdate(epoch=1, version=2, delta=delta))
        landed = {(await chat(url, "alpha-secret", f"Question {i}?"))[1]["x-kvroute-replica"]
                  for i in range(4)}  # fmt: skip
    assert landed == {
        next(e.replica_id for e in service.fleet.replicas.endpoints() if e.ordinal != ordinal)
    }


async def test_a_traced_request_is_one_span_under_the_clients_trace(
    sims: list[SimProcess],
) -> None:
    workload = {"name": "default", "strategy": "prefix_hash"}
    exporter = InMemorySpanExporter()
    trace_id = "4bf92f3577b34da6a3ce929d0e0e4736"
    parent = f"00-{trace_id}-00f067aa0ba902b7-01"
    async with proxy(routing_state(sims, workload), exporter) as (url, _):
        status, headers, answer = await chat(url, "alpha-secret", "Traced?", traceparent=parent)
        assert status == 200
    (span,) = exporter.get_finished_spans()
    assert span.context is not None and f"{span.context.trace_id:032x}" == trace_id
    attributes = dict(span.attributes or {})
    assert attributes["kvroute.replica"] == headers["x-kvroute-replica"]
    assert attributes["kvroute.workload"] == "default"
    assert attributes["kvroute.cached_tokens.measured"] == cached(answer)
    assert attributes["kvroute.prefix_blocks.total"] > 0
