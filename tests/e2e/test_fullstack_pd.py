"""A disaggregated prefill/decode fleet as ``kvroute up --pd`` runs it (NATS, etcd,
control plane, a sidecar announcing each replica's role, the proxy) in front of real
sims, over each protocol (vLLM's ``kv_transfer_params``; SGLang's bootstrap room, the
roles read from the engines): the prefill replicas' cached tokens equal the proxy's
prediction within 2% on a shared prefix, and a prefill or a decode replica killed under
load loses no request that had not started streaming (each fleet's last tests kill
them)."""

from __future__ import annotations

import http.client
import json
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from typing import Any

import pytest

from tests.e2e.fullstack import FullStack, wait_for
from tests.e2e.test_fullstack import fidelity, matched_blocks
from tests.unit.enginesim.simproc import SimProcess

pytestmark = [pytest.mark.e2e, pytest.mark.integration]

MODEL = "sim-model"
SYSTEM = "You are a careful assistant who answers every question in one short line. " * 60
SIM_ARGS = ("--instant", "--max-model-len=8192", f"--model={MODEL}")
ENV = {"KVROUTE_ANNOUNCE_INTERVAL_S": "600", "KVROUTE_LOAD_INTERVAL_S": "0.2"}


# each engine's (prefix-cache hits, prompt tokens looked up) counters
COUNTERS = {
    "vllm": ("vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total"),
    "sglang": ("sglang:cached_tokens_total", "sglang:prompt_tokens_total"),
}


# the engines in order, kvroute up naming them r0..r3; the SGLang fleet's second decode
# server keeps a radix cache (the other runs SGLang's default: none)
ROLES = ("prefill", "prefill", "decode", "decode")
RADIX_DECODE = "r3"


def sim_args(kind: str, role: str, radix: bool = False) -> tuple[str, ...]:
    if kind == "vllm":
        return SIM_ARGS  # vLLM's role is per request (kv_transfer_params)
    flags = ("--disaggregation-decode-enable-radix-cache",) if radix else ()
    return (*SIM_ARGS, "--event-format=sglang", f"--disaggregation-mode={role}", *flags)


@pytest.fixture(scope="module", params=["vllm", "sglang"])
def stack(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[FullStack]:
    kind = request.param
    with ExitStack() as started:
        sims = [
            started.enter_context(SimProcess(*sim_args(kind, role, f"r{i}" == RADIX_DECODE)))
            for i, role in enumerate(ROLES)
        ]
        run_dir = tmp_path_factory.mktemp("fleet")
        fleet = started.enter_context(FullStack(sims, run_dir, ENV, kind, pd=(2, 2)))
        roles = {"prefill": 2, "decode": 2}
        wait_for(lambda: fleet.readyz().get("roles") == roles, "every replica's role")
        yield fleet


def ask(stack: FullStack, question: str) -> tuple[int, dict[str, str], Any]:
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
    body = {"model": MODEL, "messages": messages, "max_tokens": 2}
    status, got, answer = stack.request("/v1/chat/completions", body)
    return status, got, json.loads(answer)


def prefill_hits(stack: FullStack) -> float:
    hits = COUNTERS[stack.options.engine_kind][0]
    return sum(sim.metric(hits) for sim in stack.engines[:2])


def test_the_prefill_replicas_cache_what_the_proxy_predicted(stack: FullStack) -> None:
    assert ask(stack, "First question?")[0] == 200
    # the prefill engine's events reach the proxy through sidecar, NATS and control plane
    wait_for(lambda: matched_blocks(ask(stack, "Is it cached yet?")[1]) > 0, "residency")
    counted_before, hits_before = fidelity(stack), prefill_hits(stack)
    predicted = 0
    for i in range(8):
        status, headers, answer = ask(stack, f"Question number {i}: why?")
        assert status == 200 and answer["usage"]["completion_tokens"] == 2
        predicted += matched_blocks(headers) * 16
    measured = prefill_hits(stack) - hits_before  # what the prefill engines found cached
    assert measured > 8 * 600
    assert abs(predicted - measured) <= 0.02 * measured
    counted = [a - b for a, b in zip(fidelity(stack), counted_before, strict=True)]
    assert counted == [predicted, measured]  # the proxy counts the prefill side's report


def replicas(stack: FullStack) -> list[dict[str, Any]]:
    status, body = stack.admin("GET", "/v1/replicas")
    assert status == 200
    return list(body["replicas"])


def test_decode_replicas_report_residency_only_where_their_engine_publishes_it(
    stack: FullStack,
) -> None:
    """vLLM's decode caches what it read and publishes it. SGLang's decode at its
    defaults keeps no radix cache and publishes nothing (picked by load alone, kept up by
    its sidecar's load reports); one started with
    ``--disaggregation-decode-enable-radix-cache`` publishes what it decoded, and the
    proxy then prefers it for a prompt it holds."""
    for i in range(4):
        assert ask(stack, f"Decode question {i}?")[0] == 200

    def decodes() -> dict[str, dict[str, Any]]:
        return {r["replica_id"]: r for r in replicas(stack) if r["role"] == "decode"}

    if stack.options.engine_kind == "vllm":
        wait_for(lambda: any(r["resident_blocks"] > 0 for r in decodes().values()), "residency")
    else:
        decode_by_hand(stack, "Warm the radix decode server?")
        wait_for(lambda: decodes()[RADIX_DECODE]["resident_blocks"] > 0, "its residency")
        before = {name: r["last_seen"] for name, r in decodes().items()}
        wait_for(
            lambda: all(r["last_seen"] > before[name] for name, r in decodes().items()),
            "a load report from each decode replica",
        )
        assert {n: r["resident_blocks"] == 0 for n, r in decodes().items()} == {
            "r2": True,
            RADIX_DECODE: False,
        }
        status, headers, _ = ask(stack, "Which decode server holds the system prompt?")
        assert status == 200 and headers["x-kvroute-replica"] == RADIX_DECODE
    assert [r["status"] for r in decodes().values()] == ["healthy", "healthy"]
    assert stack.readyz().get("roles") == {"prefill": 2, "decode": 2}


def decode_by_hand(stack: FullStack, question: str) -> None:
    """One SGLang P/D request sent to r0 and the radix decode server directly, as
    SGLang's router pairs them."""
    prefill, decode = stack.engines[0], stack.engines[int(RADIX_DECODE[1:])]
    port = prefill.call("GET", "/server_info")[1]["disaggregation_bootstrap_port"]
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
    body = {
        "model": MODEL,
        "messages": messages,
        "max_tokens": 2,
        **{"bootstrap_host": "127.0.0.1", "bootstrap_port": port, "bootstrap_room": 5},
    }
    with ThreadPoolExecutor(2) as pool:
        halves = [
            pool.submit(s.call, "POST", "/v1/chat/completions", body) for s in (prefill, decode)
        ]
        assert [half.result()[0] for half in halves] == [200, 200]


def complete(stack: FullStack, i: int, stream: bool) -> tuple[bool, int]:
    """One request: whether it ended well, and how many tokens its client saw."""
    body = {"model": MODEL, "prompt": f"request {i} " * 20, "max_tokens": 8, "stream": stream}
    try:
        status, _, answer = stack.request("/v1/completions", body)
    except http.client.IncompleteRead as cut:
        status, answer = 200, cut.partial
    if not stream:
        return status == 200, 8 if status == 200 else 0
    events = [e[6:] for e in answer.decode().split("\n\n") if e.startswith("data: ")]
    tokens = sum(1 for e in events if e != "[DONE]" and "choices" in json.loads(e))
    return status == 200 and events[-1:] == ["[DONE]"], tokens


def queries(stack: FullStack, sim: SimProcess) -> float:
    return sim.metric(COUNTERS[stack.options.engine_kind][1])


def under_load(stack: FullStack, half: list[SimProcess], first: int) -> list[tuple[bool, int]]:
    """60 requests on 8 threads, half streamed; once 20 have started, the busiest replica
    of ``half`` so far is killed."""
    started = threading.Event()

    def one(i: int) -> tuple[bool, int]:
        if i == first + 20:
            started.set()
        return complete(stack, i, stream=i % 2 == 1)

    before = [queries(stack, sim) for sim in half]
    with ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(one, i) for i in range(first, first + 60)]
        assert started.wait(30)
        served = [queries(stack, sim) - b for sim, b in zip(half, before, strict=True)]
        victim = half[served.index(max(served))]
        assert max(served) > 0  # it was serving this load
        assert victim.proc is not None
        victim.proc.kill()
        return [f.result() for f in futures]


@pytest.mark.parametrize("half", ["prefill", "decode"])
def test_a_replica_killed_under_load_loses_no_request_that_had_not_started_streaming(
    stack: FullStack, half: str
) -> None:
    replicas = stack.engines[:2] if half == "prefill" else stack.engines[2:]  # one of each stays
    for sim in stack.engines:
        if sim.proc is not None and sim.proc.poll() is None:
            sim.post("/sim/faults", {"delay_ms": 5})
    results = under_load(stack, replicas, 1000 if half == "prefill" else 2000)
    lost = [i for i, (ok, tokens) in enumerate(results) if not ok and tokens == 0]
    assert lost == []
    cut = [i for i, (ok, _) in enumerate(results) if not ok]
    assert all(i % 2 == 1 for i in cut) and len(cut) <= 8  # only streams already under way
