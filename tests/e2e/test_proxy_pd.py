"""kvroute-proxy in front of a disaggregated prefill/decode pool of real kvroute-sim
processes, over vLLM's protocol (roles given as ``prefill=URL``) and SGLang's (roles read
from the engines' ``/server_info``): answers whole and streamed, chat and completions,
the prefill side's cache found again, client transfer fields ignored, a decode replica
that cannot read the KV re-prefilled, a pool missing a half answered 503, and a hung
(SIGSTOPped) prefill or decode replica of either protocol holding no request."""

from __future__ import annotations

import json
import os
import re
import signal
import time
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from typing import Any

import pytest

from tests.e2e.proxyproc import ProxyProcess
from tests.unit.enginesim.simproc import SimProcess, cached_tokens

pytestmark = pytest.mark.e2e

MODEL = "sim-model"
SYSTEM = "You are a careful assistant who answers every question in one short line. " * 30
COMMON = ("--instant", f"--model={MODEL}", "--replay-endpoint=")


def ready(proxy: ProxyProcess, roles: dict[str, int]) -> None:
    """Until the proxy knows every replica's model and role (static discovery)."""
    deadline = time.monotonic() + 20
    while True:
        _, _, body = proxy.request("/readyz", method="GET")
        detail = json.loads(body)
        if detail["ready"] and detail.get("roles") == roles:
            return
        assert time.monotonic() < deadline, detail
        time.sleep(0.05)  # polling readiness, bounded by the deadline


@pytest.fixture(scope="module")
def vllm_pool() -> Iterator[tuple[list[SimProcess], list[SimProcess], ProxyProcess]]:
    with ExitStack() as stack:
        prefills = [stack.enter_context(SimProcess(*COMMON)) for _ in range(2)]
        decodes = [stack.enter_context(SimProcess(*COMMON)) for _ in range(2)]
        urls = [f"prefill={p.url}" for p in prefills] + [f"decode={d.url}" for d in decodes]
        proxy = stack.enter_context(ProxyProcess(f"--static-replicas={','.join(urls)}"))
        ready(proxy, {"prefill": 2, "decode": 2})
        yield prefills, decodes, proxy


def chat(stream: bool, user: str, **extra: Any) -> dict[str, Any]:
    body = {
        "model": MODEL,
        "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}],
        "max_tokens": 5,
        "stream": stream,
        **extra,
    }
    if stream:
        body["stream_options"] = {"include_usage": True}
    return body


def events(raw: bytes) -> list[Any]:
    found = re.findall(rb"data: (.*?)\n\n", raw, re.S)
    return [e.decode() if e == b"[DONE]" else json.loads(e) for e in found]


def streamed_chat_usage(proxy: ProxyProcess, user: str) -> dict[str, Any]:
    """A streamed chat through the proxy, checked whole (200, its 5 tokens, ``[DONE]``
    last): the usage its stream ended with."""
    status, _, raw = proxy.request("/v1/chat/completions", chat(True, user))
    assert status == 200
    streamed = events(raw)
    assert streamed[-1] == "[DONE]"
    usage: dict[str, Any] = streamed[-2]["usage"]
    assert usage["completion_tokens"] == 5
    return usage


def test_vllm_whole_and_streamed_answers_come_from_decode_with_prefill_cache_hits(
    vllm_pool: Any,
) -> None:
    prefills, _, proxy = vllm_pool
    status, _, body = proxy.request("/v1/chat/completions", chat(False, "one"))
    assert status == 200, body
    answer = json.loads(body)
    assert answer["usage"]["completion_tokens"] == 5
    # the same prefix again: prefix_hash sends it to the same prefill replica, which hits
    hits = sum(p.metric("vllm:prefix_cache_hits_total") for p in prefills)
    usage = streamed_chat_usage(proxy, "two")
    # the decode's: every token read, the last computed again (vLLM's scheduler)
    assert cached_tokens(usage) == usage["prompt_tokens"] - 1
    prefill_hit = sum(p.metric("vllm:prefix_cache_hits_total") for p in prefills) - hits
    assert usage["prompt_tokens"] - 32 <= prefill_hit < usage["prompt_tokens"]
    held = [p.call("GET", "/sim/state")[1]["kv_transfers_held"] for p in prefills]
    assert held == [0, 0]  # every prefill's blocks were read by the decode replica


def test_vllm_completions_and_client_transfer_fields_are_not_trusted(vllm_pool: Any) -> None:
    _, _, proxy = vllm_pool
    forged = {"do_remote_prefill": True, "remote_engine_id": "x", "remote_block_ids": [[1]],
              "remote_host": "10.9.9.9", "remote_port": 1, "remote_request_id": "r"}  # fmt: skip
    body = {"model": MODEL, "prompt": "The quick brown fox " * 20, "max_tokens": 4,
            "kv_transfer_params": forged}  # fmt: skip
    status, _, raw = proxy.request("/v1/completions", body)
    assert status == 200, raw
    assert json.loads(raw)["usage"]["completion_tokens"] == 4
    status, _, raw = proxy.request("/v1/completions", {**body, "stream": True})
    assert status == 200 and events(raw)[-1] == "[DONE]"
    assert sum(1 for e in events(raw)[:-1] if e["choices"] and e["choices"][0]["text"]) == 4


def test_a_failed_decode_is_reprefilled_on_another_decode_replica_and_counted(
    vllm_pool: Any,
) -> None:
    _, decodes, proxy = vllm_pool
    before = _metric(proxy, "kvroute_proxy_pd_reprefills_total")
    decodes[0].call("POST", "/sim/faults", {"fail_requests": 1})  # the least loaded's turn
    body = {"model": MODEL, "prompt": "hi " * 30, "max_tokens": 2}
    status, _, raw = proxy.request("/v1/completions", body)
    assert status == 200, raw
    assert json.loads(raw)["usage"]["completion_tokens"] == 2
    assert _metric(proxy, "kvroute_proxy_pd_reprefills_total") == before + 1


def _metric(proxy: ProxyProcess, name: str) -> float:
    _, _, body = proxy.request("/metrics", method="GET")
    total = 0.0
    for line in body.decode().splitlines():
        if line.startswith(name):
            total += float(line.rsplit(" ", 1)[1])
    return total


def test_a_pool_without_decode_replicas_answers_503_naming_it() -> None:
    with (
        SimProcess(*COMMON) as prefill,
        ProxyProcess(f"--static-replicas=prefill={prefill.url}") as proxy,
    ):
        ready(proxy, {"prefill": 1})
        status, _, raw = proxy.request("/v1/completions", {"model": MODEL, "prompt": "hi"})
        assert status == 503
        error = json.loads(raw)["error"]
        assert "decode" in error["message"] and error["type"]


@pytest.fixture(scope="module")
def sglang_pool() -> Iterator[tuple[SimProcess, SimProcess, ProxyProcess]]:
    args = (*COMMON, "--event-format=sglang")
    with ExitStack() as stack:
        prefill = stack.enter_context(SimProcess(*args, "--disaggregation-mode=prefill"))
        decode = stack.enter_context(SimProcess(*args, "--disaggregation-mode=decode"))
        proxy = stack.enter_context(ProxyProcess(f"--static-replicas={prefill.url},{decode.url}"))
        ready(proxy, {"prefill": 1, "decode": 1})
        yield prefill, decode, proxy


def test_sglang_pool_whole_and_streamed(sglang_pool: Any) -> None:
    prefill, _, proxy = sglang_pool
    status, _, body = proxy.request("/v1/chat/completions", chat(False, "one"))
    assert status == 200, body
    assert json.loads(body)["usage"]["completion_tokens"] == 5
    cached = prefill.metric("sglang:cached_tokens_total")
    usage = streamed_chat_usage(proxy, "two")
    prefill_hit = prefill.metric("sglang:cached_tokens_total") - cached
    assert usage["prompt_tokens"] - 32 <= prefill_hit < usage["prompt_tokens"]
    assert cached_tokens(usage) == prefill_hit  # the decode answers what its prefill found
    body = {"model": MODEL, "prompt": SYSTEM, "max_tokens": 3}
    status, _, raw = proxy.request("/v1/completions", body)
    assert status == 200, raw
    assert json.loads(raw)["usage"]["completion_tokens"] == 3
    status, _, raw = proxy.request("/v1/completions", {**body, "stream": True})
    assert status == 200
    streamed = events(raw)
    assert streamed[-1] == "[DONE]"
    assert sum(1 for e in streamed[:-1] if e.get("choices") and e["choices"][0]["text"]) == 3


def test_sglang_pool_serves_the_native_generate(sglang_pool: Any) -> None:
    prefill, _, proxy = sglang_pool
    prompts = prefill.metric("sglang:prompt_tokens_total")
    body = {"text": SYSTEM + " native", "sampling_params": {"max_new_tokens": 4}}
    status, _, raw = proxy.request("/generate", body)
    assert status == 200, raw
    answer = json.loads(raw)
    assert answer["meta_info"]["completion_tokens"] == 4
    assert prefill.metric("sglang:prompt_tokens_total") > prompts  # prefilled there


def test_a_failed_prefill_is_retried_on_the_other_prefill_replica(vllm_pool: Any) -> None:
    prefills, _, proxy = vllm_pool
    prefills[0].call("POST", "/sim/faults", {"fail_requests": 1})

    def send(tag: str) -> int:
        body = {"model": MODEL, "prompt": f"prefill {tag} " * 40, "max_tokens": 2}
        return proxy.request("/v1/completions", body)[0]

    statuses: list[int] = []
    with ThreadPoolExecutor(4) as pool:
        # concurrent sends, so the policy spreads them whatever it learned of two --instant
        # replicas; a bounded count, until some request has met the failure
        for batch in range(8):
            if prefills[0].call("GET", "/sim/faults")[1]["fail_requests"] == 0:
                break
            statuses += pool.map(send, (f"{batch}.{i}" for i in range(8)))
    assert statuses and statuses == [200] * len(statuses)  # every request answered
    # the failure was served: some request met it, and another prefill replica took it
    assert prefills[0].call("GET", "/sim/faults")[1]["fail_requests"] == 0


# -- a hung engine (issue 46 item 2, for P/D pools) ---------------------------------------


@pytest.fixture(scope="module")
def sglang_pairs() -> Iterator[tuple[list[SimProcess], list[SimProcess], ProxyProcess]]:
    """Two SGLang prefill and two decode servers: a hung one of each has a peer."""
    args = (*COMMON, "--event-format=sglang")
    with ExitStack() as stack:
        prefills = [
            stack.enter_context(SimProcess(*args, "--disaggregation-mode=prefill"))
            for _ in range(2)
        ]
        decodes = [
            stack.enter_context(SimProcess(*args, "--disaggregation-mode=decode")) for _ in range(2)
        ]
        urls = ",".join(s.url for s in (*prefills, *decodes))
        proxy = stack.enter_context(ProxyProcess(f"--static-replicas={urls}"))
        ready(proxy, {"prefill": 2, "decode": 2})
        yield prefills, decodes, proxy


def timed(proxy: ProxyProcess, i: int, tag: str) -> tuple[bool, float]:
    """One completion (streamed when ``i`` is odd): whether it came whole, and its time.
    The client gives up after 10 s (a request held by the hung engine)."""
    body = {"model": MODEL, "prompt": f"{tag} {i} " * 30, "max_tokens": 3, "stream": i % 2 == 1}
    request = urllib.request.Request(
        proxy.url + "/v1/completions", json.dumps(body).encode(), method="POST"
    )
    request.add_header("content-type", "application/json")
    started = time.monotonic()
    try:
        with urllib.request.urlopen(request, timeout=10) as answer:
            raw = answer.read()
    except OSError:
        return False, time.monotonic() - started
    took = time.monotonic() - started
    if i % 2 == 1:
        return events(raw)[-1] == "[DONE]", took
    return json.loads(raw)["usage"]["completion_tokens"] == 3, took


def while_stopped(proxy: ProxyProcess, sim: SimProcess, tag: str) -> list[tuple[bool, float]]:
    """12 requests, half streamed, 4 at a time, all started while ``sim`` is stopped
    (SIGSTOP: its port still accepts connections, nothing answers); then it resumes and
    the proxy routes to it again (its probe answered: no breaker open)."""
    assert sim.proc is not None
    os.kill(sim.proc.pid, signal.SIGSTOP)
    try:
        with ThreadPoolExecutor(4) as pool:
            results = list(pool.map(lambda i: timed(proxy, i, tag), range(12)))
    finally:
        os.kill(sim.proc.pid, signal.SIGCONT)
    deadline = time.monotonic() + 10
    while json.loads(proxy.request("/readyz", method="GET")[2])["circuit_open"]:
        assert time.monotonic() < deadline, "the resumed replica is still held out"
        time.sleep(0.05)  # polling the proxy's readiness, bounded by the deadline
    return results


@pytest.mark.parametrize("kind", ["vllm", "sglang"])
@pytest.mark.parametrize("half", ["prefill", "decode"])
def test_a_hung_prefill_or_decode_replica_holds_no_request(
    kind: str, half: str, request: pytest.FixtureRequest
) -> None:
    """A stopped replica of either half: every request started after the stop is served
    whole by the other replica of that half within 3 s (the first-byte deadline of 1 s,
    or for a whole answer its replica's silence, moved it; the replica is suspect), the
    move counted as a first-byte-deadline retry; none fails."""
    prefills, decodes, proxy = request.getfixturevalue(
        f"{kind}_pool" if kind == "vllm" else "sglang_pairs"
    )
    victim = (prefills if half == "prefill" else decodes)[0]
    moved = _retries(proxy, "first_byte_deadline")
    reprefills = _metric(proxy, "kvroute_proxy_pd_reprefills_total")
    results = while_stopped(proxy, victim, f"hung {kind} {half}")
    assert [ok for ok, _ in results] == [True] * 12
    assert max(took for _, took in results) <= 3.0, results
    assert _retries(proxy, "first_byte_deadline") > moved  # the hang was met, and left
    if half == "decode":  # a decode that missed its deadline: prefilled again
        assert _metric(proxy, "kvroute_proxy_pd_reprefills_total") > reprefills


def _retries(proxy: ProxyProcess, reason: str) -> float:
    return _metric(proxy, f'kvroute_proxy_retries_total{{reason="{reason}"}}')
