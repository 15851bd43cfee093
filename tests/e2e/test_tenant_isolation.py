"""One tenant cannot read another's cache through the proxy, whatever it sends.

A cache hit is a timing side channel (a hit answers several times faster than a
recompute), so a tenant that could land on another tenant's cached blocks could probe
whether that tenant sent a prompt. Tenant beta primes a prompt (twice: its own repeat is
served from cache); tenant alpha then sends the same prompt once with every body field,
header and route that could name beta's namespace: ``cache_salt`` or
``prompt_cache_key`` set to beta's name, to beta's own salt, or to the salt the proxy
derives for beta; beta's name in the tenant header; a workload that does not isolate
tenants. What is asserted is what the engine itself reports: alpha gets not one cached
token (``usage.prompt_tokens_details.cached_tokens`` of vLLM, ``meta_info.cached_tokens``
of SGLang's ``/generate``), on real ``kvroute-sim`` engines behind a proxy on a real port.
"""

from __future__ import annotations

import hashlib
import itertools
import json
from collections.abc import Iterator
from contextlib import ExitStack
from typing import Any

import aiohttp
import pytest

from kvcore.pb import events_pb2, routing_pb2
from kvcore.tenancy import tenant_salt
from tests.e2e.test_proxy_state_routing import KEYS, proxy
from tests.unit.dataplane.state_messages import config, model_entry, replica, snapshot
from tests.unit.enginesim.simproc import SimProcess, cached_tokens

pytestmark = pytest.mark.e2e

MODEL = "sim-model"
SYSTEM = "You are a careful assistant who answers every question in one short line. " * 30
ISOLATED = {"name": "isolated", "strategy": "kv_aware", "tenant_isolation": True}
SHARED = {"name": "shared", "strategy": "kv_aware"}
ALPHA, BETA = "alpha-secret", "beta-secret"
ROUTES = {"vllm": ("/v1/chat/completions", "/v1/completions"), "sglang": ("/generate",)}
_unique = itertools.count()

# (beta's body fields, alpha's body fields, alpha's headers): every way alpha might name
# beta's cache namespace, for a prompt beta sent plain, salted, or keyed
PROBES = [
    ({}, {}, {}),
    ({}, {"cache_salt": "beta"}, {}),
    ({}, {"prompt_cache_key": "beta"}, {}),
    ({}, {"cache_salt": tenant_salt("beta", None)}, {}),
    ({}, {"cache_salt": tenant_salt("beta", None)}, {"x-kvroute-workload": "shared"}),
    ({}, {}, {"x-tenant": "beta"}),
    ({}, {}, {"x-kvroute-workload": "shared"}),
    ({"cache_salt": "s"}, {"cache_salt": "s"}, {}),
    ({"cache_salt": "s"}, {"cache_salt": "s"}, {"x-kvroute-workload": "shared"}),
    ({"cache_salt": "s"}, {"cache_salt": tenant_salt("beta", "s")}, {}),
    ({"prompt_cache_key": "k"}, {"prompt_cache_key": "k"}, {}),
    ({"prompt_cache_key": "k"}, {"cache_salt": "k"}, {}),
]


@pytest.fixture(scope="module")
def engines() -> Iterator[dict[str, SimProcess]]:
    args = ("--instant", f"--model={MODEL}", "--max-model-len=8192", "--replay-endpoint=")
    with ExitStack() as stack:
        yield {
            "vllm": stack.enter_context(SimProcess(*args)),
            "sglang": stack.enter_context(SimProcess(*args, "--event-format=sglang")),
        }


def one_replica(engine: SimProcess, kind: str) -> Any:
    """The routing state of one replica (so no router can keep tenants apart: only the
    engine's salt can), both workloads, and the two tenants' keys."""
    info = replica(0, model=MODEL)
    info.base_url = engine.url
    if kind == "sglang":
        info.engine_kind = events_pb2.ENGINE_KIND_SGLANG
    rules = {"rules": [], "default_workload": "isolated"}
    routing = config([ISOLATED, SHARED], rules=rules, models=[model_entry(MODEL)])
    routing.api_keys.extend(
        routing_pb2.ApiKey(
            key_sha256=hashlib.sha256(secret.encode()).hexdigest(),
            tenant=tenant,
            scopes=["inference"],
        )
        for secret, tenant in KEYS.items()
    )
    return snapshot(1, 1, [info], routing=routing)


def body_for(path: str, prompt: str, fields: dict[str, Any]) -> dict[str, Any]:
    if path == "/generate":
        return {"text": prompt, "sampling_params": {"max_new_tokens": 1}, **fields}
    if path == "/v1/completions":
        return {"model": MODEL, "prompt": prompt, "max_tokens": 1, **fields}
    messages = [{"role": "system", "content": prompt}, {"role": "user", "content": "Why?"}]
    return {"model": MODEL, "messages": messages, "max_tokens": 1, **fields}


async def cached_of(
    url: str, path: str, body: dict[str, Any], headers: dict[str, str]
) -> tuple[int, str]:
    """The engine's cached tokens for one request, and the router's predicted blocks."""
    async with (
        aiohttp.ClientSession() as session,
        session.post(url + path, json=body, headers=headers) as resp,
    ):
        answer = json.loads(await resp.read())
        assert resp.status == 200, answer
        blocks = resp.headers["x-kvroute-prefix-blocks"]
    if path == "/generate":
        return int(answer["meta_info"]["cached_tokens"]), blocks
    return cached_tokens(answer["usage"]), blocks


def prompt() -> str:
    """A prompt no earlier one began like (its first word is new)."""
    return f"Probe{next(_unique)}x " + SYSTEM


async def primed(url: str, path: str, body: dict[str, Any], headers: dict[str, str]) -> None:
    """Beta's prompt, sent twice: its repeat must come from the cache (else the probe
    would prove nothing)."""
    await cached_of(url, path, body, headers)
    again, _ = await cached_of(url, path, body, headers)
    assert again > 400, f"beta's own repeat was not served from cache: {again}"


@pytest.mark.parametrize("kind", ["vllm", "sglang"])
async def test_with_keys_no_body_field_header_or_route_reads_another_tenants_cache(
    engines: dict[str, SimProcess], kind: str
) -> None:
    leaks = []
    async with proxy(one_replica(engines[kind], kind), tenant_header="x-tenant") as (url, _):
        for path, (beta_fields, alpha_fields, alpha_headers) in itertools.product(
            ROUTES[kind], PROBES
        ):
            text = prompt()
            beta = {"authorization": f"Bearer {BETA}"}
            await primed(url, path, body_for(path, text, beta_fields), beta)
            alpha = {"authorization": f"Bearer {ALPHA}", **alpha_headers}
            got, blocks = await cached_of(url, path, body_for(path, text, alpha_fields), alpha)
            if got or not blocks.startswith("0/"):
                leaks.append((path, beta_fields, alpha_fields, alpha_headers, got, blocks))
    assert leaks == []


async def test_a_clients_salt_subdivides_its_own_tenant_and_still_hits_its_own_cache(
    engines: dict[str, SimProcess],
) -> None:
    """The salt only subdivides: alpha's salted prompt is served from alpha's cache on
    its repeat with the same salt, not with another, and the router predicts it."""
    async with proxy(one_replica(engines["vllm"], "vllm")) as (url, _):
        path, text = "/v1/completions", prompt()
        alpha = {"authorization": f"Bearer {ALPHA}"}
        await primed(url, path, body_for(path, text, {"cache_salt": "mine"}), alpha)
        got, blocks = await cached_of(
            url, path, body_for(path, text, {"cache_salt": "mine"}), alpha
        )
        assert got > 400 and not blocks.startswith("0/")
        got, _ = await cached_of(url, path, body_for(path, text, {"cache_salt": "other"}), alpha)
        assert got == 0


async def test_without_keys_a_configured_tenant_header_is_the_tenant_and_salts_subdivide_it(
    engines: dict[str, SimProcess],
) -> None:
    """Without --auth the tenant is the configured header (set by a front proxy that
    authenticates); a body's salt or prompt_cache_key cannot step into another's."""
    state = one_replica(engines["vllm"], "vllm")
    leaks = []
    async with proxy(state, auth=False, tenant_header="x-tenant") as (url, _):
        for path, (beta_fields, alpha_fields, _) in itertools.product(
            ROUTES["vllm"], PROBES[:3] + PROBES[7:8] + PROBES[10:]
        ):
            text = prompt()
            await primed(url, path, body_for(path, text, beta_fields), {"x-tenant": "beta"})
            alpha = {"x-tenant": "alpha"}
            got, blocks = await cached_of(url, path, body_for(path, text, alpha_fields), alpha)
            if got or not blocks.startswith("0/"):
                leaks.append((path, beta_fields, alpha_fields, got, blocks))
    assert leaks == []
