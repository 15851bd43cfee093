"""kvroute-proxy in static mode (no control plane) in front of real kvroute-sim replicas.

What a user of the proxy notices: the official OpenAI client works through it exactly as
against a replica; prompts that share a beginning land on the replica that caches it; bad
input gets OpenAI-shaped 4xx answers and never a 500; a client that goes away stops the
engine's work. (A replica killed under load is shown on the whole fleet, in
``test_fullstack.py``: the retry path is the same in both modes.)
"""

from __future__ import annotations

import http.client
import http.server
import json
import signal
import socket
import threading
import time
import urllib.request
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bench.micro.model_files import write_config, write_tiny_model
from kvcore.tenancy import tenant_salt
from tests.e2e.openai_answers import openai_answers
from tests.e2e.proxyproc import ProxyProcess
from tests.request_bodies import request_bodies
from tests.unit.enginesim.simproc import SimProcess, cached_tokens

pytestmark = pytest.mark.e2e

MODEL = "sim-model"
JSON = {"content-type": "application/json"}
SYSTEM = "You are a careful assistant who answers every question in one short line. " * 40
SIM_ARGS = ("--instant", f"--model={MODEL}", "--max-model-len=4096", "--replay-endpoint=")


@pytest.fixture(scope="module")
def fleet() -> Iterator[tuple[list[SimProcess], ProxyProcess]]:
    with ExitStack() as stack:
        sims = [stack.enter_context(SimProcess(*SIM_ARGS)) for _ in range(3)]
        urls = ",".join(sim.url for sim in sims)
        proxy = stack.enter_context(
            ProxyProcess(f"--static-replicas={urls}", "--debug-headers", "--max-body-bytes=65536")
        )
        yield sims, proxy


def strip_ids(events: list[Any]) -> list[Any]:
    """Events without the fields that differ between two runs of one request."""
    return [{k: v for k, v in e.items() if k not in ("id", "created")} for e in events]


def test_openai_client_sees_what_the_replica_itself_answers(fleet: Any) -> None:
    sims, proxy = fleet
    via_proxy, direct = (openai_answers(url, MODEL, SYSTEM) for url in (proxy.url, sims[0].url))
    assert via_proxy == direct
    assert via_proxy[0] and len(via_proxy[2]) == 7  # role chunk + 6 tokens, no usage chunk
    assert via_proxy[3][-1]["choices"] == []  # asked for: the usage chunk is there


def test_raw_stream_without_usage_is_event_for_event_the_replicas(fleet: Any) -> None:
    sims, proxy = fleet
    body = {"model": MODEL, "prompt": "The quick brown fox", "max_tokens": 5, "stream": True}
    via_proxy, direct = (_events(url, body) for url in (proxy.url, sims[1].url))
    assert strip_ids(via_proxy[:-1]) == strip_ids(direct[:-1])
    assert via_proxy[-1] == direct[-1] == "[DONE]"
    assert all("usage" not in e for e in via_proxy[:-1])


CONTINUOUS = {"continuous_usage_stats": True}


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"include_usage": None},
        {"include_usage": True},
        CONTINUOUS,
        {"include_usage": True, **CONTINUOUS},
        {"include_usage": False, **CONTINUOUS},
        {"include_usage": None, **CONTINUOUS},
    ],
)
def test_stream_options_get_the_usage_chunk_the_replica_would_send(
    fleet: Any, options: dict[str, Any]
) -> None:
    """``stream_options`` given asks for usage unless include_usage is false or null
    (vLLM's rule): the proxy, which asks the engine for it when it may, removes only the
    chunk the client would not have had. With ``continuous_usage_stats`` every chunk
    carries usage exactly when include_usage is on: asked for on the client's behalf, it
    would have put usage in every chunk of a stream that had none."""
    sims, proxy = fleet
    body = {"model": MODEL, "prompt": "Jumps over the lazy dog", "max_tokens": 3,
            "stream": True, "stream_options": options}  # fmt: skip
    via_proxy, direct = (_events(url, body) for url in (proxy.url, sims[1].url))
    assert [("usage" in e) for e in via_proxy[:-1]] == [("usage" in e) for e in direct[:-1]]
    assert ("usage" in via_proxy[-2]) is (options.get("include_usage", True) is True)
    running = [
        [e.get("usage") for e in events[:-1] if e["choices"]] for events in (via_proxy, direct)
    ]
    assert running[0] == running[1]  # the chunks' own usage so far, when there is any


STREAM_OPTIONS = [
    None,
    {},
    {"include_usage": None},
    {"include_usage": False},
    {"include_usage": True},
]


@pytest.mark.parametrize("options", STREAM_OPTIONS)
def test_behind_sglang_the_stream_has_usage_exactly_when_sglangs_own_would(
    options: dict[str, Any] | None,
) -> None:
    """SGLang's ``include_usage`` defaults to false: ``stream_options: {}`` ends its
    stream without usage, where vLLM's has it. The proxy, which asks every engine for
    usage, learns a static replica's engine from its /v1/models (``owned_by``)."""
    with (
        SimProcess(*SIM_ARGS, "--event-format=sglang") as sim,
        ProxyProcess(f"--static-replicas={sim.url}") as proxy,
    ):
        body: dict[str, Any] = {"model": MODEL, "prompt": "Jumps over the lazy dog",
                                "max_tokens": 3, "stream": True}  # fmt: skip
        if options is not None:
            body["stream_options"] = options
        assert json.loads(proxy.request("/v1/models", method="GET")[2])["data"]  # read at start
        via_proxy, direct = (_events(url, body) for url in (proxy.url, sim.url))
    has_usage = [e.get("usage") is not None for e in direct[:-1]]  # SGLang: "usage": null
    assert [e.get("usage") is not None for e in via_proxy[:-1]] == has_usage
    assert any(has_usage) is (options is not None and options.get("include_usage") is True)
    assert [e["choices"] for e in via_proxy[:-1]] == [e["choices"] for e in direct[:-1]]


@pytest.mark.parametrize(
    "options",
    [CONTINUOUS, {"include_usage": False, **CONTINUOUS}, {"include_usage": True, **CONTINUOUS}],
)
def test_behind_sglang_continuous_usage_arrives_as_sglang_sends_it(options: dict[str, Any]) -> None:
    """SGLang puts each chunk's usage so far on it whatever ``include_usage`` says, and a
    usage chunk at the end only with ``include_usage`` true: through the proxy (which asks
    for that chunk when the client did not, and takes it off again) the client gets
    SGLang's own stream."""
    with (
        SimProcess(*SIM_ARGS, "--event-format=sglang") as sim,
        ProxyProcess(f"--static-replicas={sim.url}") as proxy,
    ):
        body = {"model": MODEL, "prompt": "Jumps over the lazy dog", "max_tokens": 3,
                "stream": True, "stream_options": options}  # fmt: skip
        assert json.loads(proxy.request("/v1/models", method="GET")[2])["data"]  # read at start
        via_proxy, direct = (strip_ids(_events(url, body)[:-1]) for url in (proxy.url, sim.url))
    assert via_proxy == direct
    assert [e["usage"]["completion_tokens"] for e in direct[:3]] == [1, 2, 3]
    assert len(direct) == (4 if options.get("include_usage") else 3)


def test_behind_sglang_any_model_name_is_served_as_sglangs_own_server_serves_it() -> None:
    """SGLang checks no model name (its examples send ``"default"``), where vLLM answers
    404: behind SGLang replicas of one model the proxy routes any name to that model,
    keyed as it (a prompt lands where the model's own name sent it, and hits its
    cache), and the answer names what the client sent, as SGLang's does."""
    with ExitStack() as stack:
        sims = [stack.enter_context(SimProcess(*SIM_ARGS, "--event-format=sglang"))
                for _ in range(2)]  # fmt: skip
        urls = ",".join(sim.url for sim in sims)
        proxy = stack.enter_context(ProxyProcess(f"--static-replicas={urls}", "--debug-headers"))
        (card,) = json.loads(proxy.request("/v1/models", method="GET")[2])["data"]
        assert (card["id"], card["owned_by"], card["max_model_len"]) == (MODEL, "sglang", 4096)
        replicas, cached = set(), []
        for name, question in ((MODEL, "Where?"), ("default", "Here?"), ("gpt-4o", "There?")):
            messages = [
                {"role": "system", "content": SYSTEM},
                {"role": "user", "content": question},
            ]
            body = {"model": name, "max_tokens": 2, "messages": messages}
            status, headers, answer = proxy.request("/v1/chat/completions", body)
            assert status == 200 and json.loads(answer)["model"] == name
            replicas.add(headers["x-kvroute-replica"])
            cached.append(cached_tokens(json.loads(answer)["usage"]))
    assert len(replicas) == 1
    assert cached[1] > 400 and cached[2] >= cached[1]


def test_a_batch_with_two_samples_each_arrives_intact_and_answers_as_the_replica(
    fleet: Any,
) -> None:
    sims, proxy = fleet
    prompts = [list(range(24_000, 24_040)), list(range(25_000, 25_024))]
    body = {"model": MODEL, "prompt": prompts, "n": 2, "max_tokens": 3}
    stream = {**body, "stream": True, "stream_options": {"include_usage": True}}

    def cold() -> None:  # every replica cold: the same cache hits both ways
        for sim in sims:
            assert sim.call("POST", "/reset_prefix_cache")[0] == 200

    def answers(url: str) -> tuple[Any, Any]:
        cold()
        whole = json.loads(urllib.request.urlopen(_post(url, body), timeout=30).read())
        cold()
        events = strip_ids(_events(url, stream)[:-1])
        return {k: v for k, v in whole.items() if k not in ("id", "created")}, events

    via_proxy, direct = answers(proxy.url), answers(sims[2].url)
    assert via_proxy == direct
    whole, events = via_proxy
    assert [c["index"] for c in whole["choices"]] == [0, 1, 2, 3]
    assert whole["usage"]["prompt_tokens"] == 64
    assert whole["usage"]["prompt_tokens_details"]["cached_tokens"] == 16
    assert sorted({e["choices"][0]["index"] for e in events[:-1]}) == [0, 1, 2, 3]
    assert events[-1]["usage"]["completion_tokens"] == 12


def test_a_batch_or_n_samples_counts_the_first_prompts_cached_tokens_or_none(
    fleet: Any,
) -> None:
    """A whole answer to a batch or to n > 1 carries its last engine request's cached
    tokens (another prompt's, or a sample that hit the first sample's blocks): not a
    measurement of the routed prompt, so not counted as one; a stream's usage is the
    first prompt's first sample's, counted against the first prompt's size."""
    sims, proxy = fleet
    first, second = list(range(26_000, 26_040)), list(range(27_000, 27_024))
    body = {"model": MODEL, "prompt": [first, second], "n": 2, "max_tokens": 2}
    stream = {**body, "stream": True, "stream_options": {"include_usage": True}}
    for sim in sims:
        assert sim.call("POST", "/reset_prefix_cache")[0] == 200

    before = _fidelity_totals(proxy)
    status, _, whole = proxy.request("/v1/completions", body)
    assert status == 200
    assert json.loads(whole)["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    after_whole = _fidelity_totals(proxy)
    assert after_whole["measured_requests"] == before["measured_requests"]
    assert after_whole["measured_cached_tokens"] == before["measured_cached_tokens"]
    assert after_whole["prompt_tokens"] - before["prompt_tokens"] == len(first)

    events = _events(proxy.url, stream)
    after_stream = _fidelity_totals(proxy)
    reported = events[-2]["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert after_stream["measured_requests"] == after_whole["measured_requests"] + 1
    assert (
        after_stream["measured_cached_tokens"] - after_whole["measured_cached_tokens"] == reported
    )
    assert after_stream["prompt_tokens"] - after_whole["prompt_tokens"] == len(first)


def test_a_miss_counts_as_measured_once_the_replica_is_seen_reporting_cached_tokens() -> None:
    """vLLM reports cached tokens only when some were cached (``--enable-prompt-tokens-
    details`` tests the count's truth), and not at all without that flag: an answer
    without them is unknown until its replica has reported some, then a miss, 0 cached,
    whole or streamed (the usage chunk the proxy asked for and took off again)."""
    with (
        SimProcess(*SIM_ARGS) as sim,
        ProxyProcess(f"--static-replicas={sim.url}") as proxy,
    ):
        prompt = list(range(27_000, 27_064))
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 1}
        counted = [_fidelity_totals(proxy)]
        for sent in (body, body, {**body, "prompt": prompt[::-1]}):
            assert proxy.request("/v1/completions", sent)[0] == 200
            counted.append(_fidelity_totals(proxy))
        cold = {**body, "prompt": prompt[1:], "stream": True}
        assert [e for e in _events(proxy.url, cold) if e != "[DONE]" and e.get("usage")] == []
        counted.append(_fidelity_totals(proxy))
    requests = [c["measured_requests"] - counted[0]["measured_requests"] for c in counted[1:]]
    tokens = [
        c["measured_cached_tokens"] - counted[0]["measured_cached_tokens"] for c in counted[1:]
    ]
    assert requests == [0, 1, 2, 3]  # the first unknown: this replica had reported none yet
    assert tokens == [0, 48, 48, 48]  # then a hit and two misses


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_an_engine_that_reports_no_cached_tokens_has_none_counted_as_measured(engine: str) -> None:
    """Started without its report of cached tokens (the engines' default), an engine's
    answers say nothing of them, hits included: the proxy counts none of its answers as
    measured rather than take the silence for misses."""
    with (
        SimProcess(*SIM_ARGS, f"--event-format={engine}", "--no-cache-report") as sim,
        ProxyProcess(f"--static-replicas={sim.url}") as proxy,
    ):
        before = _fidelity_totals(proxy)
        body = {"model": MODEL, "prompt": list(range(28_000, 28_064)), "max_tokens": 1}
        answers = [json.loads(proxy.request("/v1/completions", body)[2]) for _ in range(2)]
        after = _fidelity_totals(proxy)
        assert sim.metric(f"{engine}:prefix_cache_hits_total" if engine == "vllm"
                          else "sglang:cached_tokens_total") == 48  # fmt: skip
    assert [a["usage"]["prompt_tokens_details"] for a in answers] == [None, None]
    assert after["measured_requests"] == before["measured_requests"]
    assert after["prompt_tokens"] - before["prompt_tokens"] == 128


def test_behind_sglang_no_answer_to_a_batch_or_n_samples_counts_as_measured() -> None:
    """SGLang runs each prompt of a batch or of n > 1 once as a warm-up, then the samples,
    and sums the samples' cached tokens: whole or streamed, no measure of the prompt as
    routed. A single prompt's stream still is one."""
    with (
        SimProcess(*SIM_ARGS, "--event-format=sglang") as sim,
        ProxyProcess(f"--static-replicas={sim.url}") as proxy,
    ):
        prompt = list(range(26_000, 26_040))
        options = {"stream": True, "stream_options": {"include_usage": True}}
        before = _fidelity_totals(proxy)
        for extra in ({"n": 2}, {"n": 2, **options}, {"prompt": [prompt, prompt[:24]], **options}):
            body = {"model": MODEL, "prompt": prompt, "max_tokens": 2, **extra}
            events = _events(proxy.url, body) if extra.get("stream") else None
            if events is None:
                assert proxy.request("/v1/completions", body)[0] == 200
            else:
                assert events[-2]["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
        after_fanned = _fidelity_totals(proxy)
        assert after_fanned["measured_requests"] == before["measured_requests"]
        single = {"model": MODEL, "prompt": prompt[:30], "max_tokens": 2, **options}
        _events(proxy.url, single)
        assert _fidelity_totals(proxy)["measured_requests"] == after_fanned["measured_requests"] + 1


def _fidelity_totals(proxy: ProxyProcess) -> dict[str, float]:
    """The proxy's fidelity counters, summed over workloads and replicas."""
    status, _, text = proxy.request("/metrics", method="GET")
    assert status == 200
    names = ("prompt_tokens", "measured_cached_tokens", "measured_requests")
    totals = dict.fromkeys(names, 0.0)
    for line in text.decode().splitlines():
        for name in names:
            if line.startswith(f"kvroute_proxy_{name}_total{{"):
                totals[name] += float(line.rsplit(" ", 1)[1])
    return totals


def _post(url: str, body: dict[str, Any]) -> urllib.request.Request:
    return urllib.request.Request(f"{url}/v1/completions", json.dumps(body).encode(), JSON)


def _events(url: str, body: dict[str, Any]) -> list[Any]:
    request = urllib.request.Request(f"{url}/v1/completions", json.dumps(body).encode(), JSON)
    with urllib.request.urlopen(request, timeout=30) as resp:
        text = resp.read().decode()
    events = [part[6:] for part in text.split("\n\n") if part.startswith("data: ")]
    return [e if e == "[DONE]" else json.loads(e) for e in events]


def test_prompts_sharing_a_system_prompt_land_together_and_hit_its_cache(fleet: Any) -> None:
    _, proxy = fleet
    replicas, cached = set(), []
    for question in ("What is a KV cache?", "And prefix caching?", "Why route by prefix?"):
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
        body = {"model": MODEL, "max_tokens": 2, "messages": messages}
        status, headers, answer = proxy.request("/v1/chat/completions", body)
        assert status == 200
        replicas.add(headers["x-kvroute-replica"])
        cached.append(cached_tokens(json.loads(answer)["usage"]))
    assert len(replicas) == 1
    assert cached[1] > 400 and cached[2] >= cached[1]


USER = [{"role": "user", "content": "x"}]


def _json(**body: Any) -> bytes:
    return json.dumps(body).encode()


BAD = [
    (b"{not json", 400, None),
    (b"[1, 2]", 400, None),
    (_json(model=MODEL), 400, "messages"),
    (_json(model=MODEL, messages=[]), 400, "messages"),
    (_json(model=MODEL, messages=[{"content": "x"}]), 400, "messages"),
    (_json(model=7, messages=USER), 400, "model"),
    (_json(model=MODEL, messages=USER, stream="yes"), 400, "stream"),
    (_json(model="nope", messages=USER), 404, "model"),
    (b"{" + b" " * 70_000 + b"}", 413, None),
    (b'{"model": "x", "messages": ' + b"[" * 20_000, 400, None),  # past msgspec's depth
]


@pytest.mark.parametrize(("raw", "status", "param"), BAD)
def test_bad_input_gets_an_openai_shaped_4xx(
    fleet: Any, raw: bytes, status: int, param: str | None
) -> None:
    _, proxy = fleet
    got, _, body = proxy.request("/v1/chat/completions", raw=raw)
    assert got == status
    error = json.loads(body)["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["param"] == param


@pytest.mark.parametrize("named", [{}, {"model": None}])
def test_a_request_naming_no_model_is_answered_as_the_replica_answers_it(
    fleet: Any, named: dict[str, Any]
) -> None:
    """vLLM and SGLang run their own model for a request that names none: so does the
    proxy behind replicas of one model, forwarding the body as it came."""
    sims, proxy = fleet
    for path, body in (
        ("/v1/chat/completions", {"messages": USER, "max_tokens": 3, **named}),
        ("/v1/completions", {"prompt": "Say it", "max_tokens": 3, **named}),
    ):
        status, _, answer = proxy.request(path, body)
        assert status == 200, answer
        via_proxy, direct = json.loads(answer), sims[0].post(path, body)
        assert via_proxy["model"] == direct["model"] == MODEL
        assert via_proxy["choices"] == direct["choices"]


BODIES = request_bodies(MODEL)


@settings(
    max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(body=BODIES, path=st.sampled_from(["/v1/chat/completions", "/v1/completions"]))
def test_fuzzed_bodies_never_get_a_500(fleet: Any, body: dict[str, Any], path: str) -> None:
    _, proxy = fleet
    status, _, answer = proxy.request(path, body)
    assert status != 500, answer
    if status >= 400:
        assert set(json.loads(answer)["error"]) >= {"message", "type"}


def test_a_client_that_goes_away_stops_the_engine_at_once() -> None:
    with (
        SimProcess(f"--model={MODEL}", "--replay-endpoint=", "--time-scale=0") as sim,
        ProxyProcess(f"--static-replicas={sim.url}") as proxy,
    ):
        sim.post("/sim/faults", {"delay_ms": 20})  # 50 tokens a second
        body = {"model": MODEL, "prompt": "Tell me a story", "max_tokens": 2000, "stream": True}
        request = _post(proxy.url, body)
        with urllib.request.urlopen(request, timeout=30) as resp:
            assert resp.readline().startswith(b"data: ")
            assert _running(sim) == 1
        deadline = time.monotonic() + 5
        while _running(sim) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert _running(sim) == 0


def _running(sim: SimProcess) -> int:
    return int(sim.metric("vllm:num_requests_running"))


def test_a_replica_with_another_tokenizer_is_flagged_in_readyz_and_metrics(
    tmp_path: Path,
) -> None:
    model_dir = write_tiny_model(tmp_path / "bpe")
    with (
        SimProcess(*SIM_ARGS, f"--tokenizer={model_dir}") as sim,
        ProxyProcess(f"--static-replicas={sim.url}") as proxy,
    ):
        deadline = time.monotonic() + 20
        while not (flagged := _readyz(proxy)["tokenizer_mismatch"]):
            assert time.monotonic() < deadline, "the probe never flagged the model"
            time.sleep(0.05)
        assert list(flagged) == [MODEL]
        _, _, metrics = proxy.request("/metrics", method="GET")
        assert f'kvroute_proxy_tokenizer_mismatch{{model="{MODEL}"}} 1.0' in metrics.decode()


# Qwen's way: any role; a content pasted as it is (a list of parts cannot be)
ANY_ROLE_CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def test_a_prompt_the_proxys_tokenizer_refuses_is_the_engines_to_judge(tmp_path: Path) -> None:
    """The proxy's tokenizer (here the built-in one, whose template takes neither a
    ``developer`` message nor an image part) is not the engine's to overrule: such a
    request is routed without its prompt's keys and answered by the engine, as directly."""
    model_dir = write_tiny_model(tmp_path / "bpe")
    write_config(model_dir, chat_template=ANY_ROLE_CHATML, eos_token="<|im_end|>")
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    chats = [
        [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
        [{"role": "user", "content": [{"type": "text", "text": "What is it?"}, image]}],
    ]
    with (
        SimProcess(*SIM_ARGS, f"--tokenizer={model_dir}") as sim,
        ProxyProcess(f"--static-replicas={sim.url}", "--debug-headers") as proxy,
    ):
        statuses = []
        for messages in chats:
            body = {"model": MODEL, "messages": messages, "max_tokens": 2}
            status, headers, answer = proxy.request("/v1/chat/completions", body)
            direct = sim.call("POST", "/v1/chat/completions", body)
            mine, theirs = json.loads(answer), direct[1]  # the answer, or the engine's error
            assert status == direct[0]
            assert mine.get("choices", mine.get("error")) == theirs.get(
                "choices", theirs.get("error")
            )
            assert headers["x-kvroute-prefix-blocks"] == "0/0"  # routed on no keys
            statuses.append(status)
    assert statuses == [200, 400]  # the engine's template takes the role, not the image


def _readyz(proxy: ProxyProcess) -> dict[str, Any]:
    return dict(json.loads(proxy.request("/readyz", method="GET")[2]))


def test_workers_share_one_port_scrape_as_one_and_stop_together(fleet: Any) -> None:
    """Each request and each scrape on a connection of its own, which the kernel hands
    to either worker: every scrape counts every worker's requests (a scrape of one worker
    alone would read as a counter reset to Prometheus)."""
    sims, _ = fleet
    with ProxyProcess(f"--static-replicas={sims[0].url}", "--workers=2") as proxy:
        body = {"model": MODEL, "prompt": "Hello", "max_tokens": 1}
        statuses = [proxy.request("/v1/completions", body)[0] for _ in range(20)]
        assert statuses == [200] * 20
        series = (
            f'{{outcome="ok",replica="{sims[0].url.removeprefix("http://")}",workload="default"}}'
        )
        for _ in range(8):
            status, _, text = proxy.request("/metrics", method="GET")
            assert status == 200
            assert f"kvroute_proxy_requests_total{series} 20.0\n" in text.decode()
        assert proxy.proc is not None
        proxy.proc.send_signal(signal.SIGTERM)
        assert proxy.proc.wait(timeout=15) == 0


def test_sigterm_lets_a_stream_finish_within_the_grace_and_cuts_it_after() -> None:
    """On SIGTERM the proxy takes no new connection and lets a stream in progress go on
    for ``--shutdown-grace-s``: a 100-token stream (about a second of modelled decode)
    ends whole with a 10 s grace, and is cut with 0.2 s; either way the proxy exits 0."""
    body = {"model": MODEL, "prompt": "Keep talking", "max_tokens": 100, "stream": True}
    with SimProcess(f"--model={MODEL}", "--time-scale=1", "--replay-endpoint=") as sim:
        for grace, whole in (("10", True), ("0.2", False)):
            args = (f"--static-replicas={sim.url}", f"--shutdown-grace-s={grace}")
            with ProxyProcess(*args) as proxy:
                assert proxy.proc is not None
                host, port = proxy.url.removeprefix("http://").split(":")
                conn = http.client.HTTPConnection(host, int(port), timeout=30)
                conn.request("POST", "/v1/completions", json.dumps(body), JSON)
                stream = conn.getresponse()
                assert stream.status == 200 and stream.readline().startswith(b"data: ")
                proxy.proc.send_signal(signal.SIGTERM)
                try:
                    rest = stream.read()
                except http.client.IncompleteRead as cut:
                    rest = cut.partial
                conn.close()
                assert rest.endswith(b"data: [DONE]\n\n") is whole
                assert proxy.proc.wait(timeout=15) == 0


def test_an_idle_client_connection_is_closed_after_keep_alive_s(fleet: Any) -> None:
    sims, _ = fleet
    with ProxyProcess(f"--static-replicas={sims[0].url}", "--keep-alive-s=0.3") as proxy:
        host, port = proxy.url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port)), timeout=10) as conn:
            conn.sendall(b"GET /healthz HTTP/1.1\r\nhost: p\r\n\r\n")
            answer = conn.recv(4096)
            while answer and not answer.endswith(b'{"status":"ok"}'):
                more = conn.recv(4096)
                assert more, answer
                answer += more
            assert answer.startswith(b"HTTP/1.1 200 ")
            assert conn.recv(4096) == b""  # closed by the proxy once idle (10 s at most)


def _raw(conn: socket.socket, data: bytes) -> bytes:
    """What the proxy answers ``data`` with, up to its close."""
    conn.sendall(data)
    answer = b""
    while more := conn.recv(65536):
        answer += more
    return answer


def test_the_proxys_flags_refuse_repeats_slow_heads_and_connections_over_the_cap(
    fleet: Any,
) -> None:
    """A second line of a header the proxy reads (its tenant header, the request id,
    authorization) is a 400; a head not whole within --header-timeout-s is a 408; a
    connection over --max-connections a 503 saying why."""
    sims, _ = fleet
    flags = ("--tenant-header=x-tenant", "--header-timeout-s=0.5", "--max-connections=2")
    with ProxyProcess(f"--static-replicas={sims[0].url}", *flags) as proxy:
        address = proxy.url.removeprefix("http://").split(":")
        host, port = address[0], int(address[1])
        for name in ("x-tenant", "x-request-id", "authorization", "host"):
            with socket.create_connection((host, port), timeout=10) as conn:
                head = f"GET /v1/models HTTP/1.1\r\nhost: p\r\n{name}: a\r\n{name}: b\r\n\r\n"
                answer = _raw(conn, head.encode())
            assert answer.startswith(b"HTTP/1.1 400 "), (name, answer[:60])
            assert b"more than one " + name.encode() in answer
        with socket.create_connection((host, port), timeout=10) as conn:
            started = time.monotonic()
            answer = _raw(conn, b"GET /v1/models HTTP/1.1\r\nhost: p\r\n")
            assert answer.startswith(b"HTTP/1.1 408 ") and time.monotonic() - started < 5
        with ExitStack() as held:
            for _ in range(2):
                conn = held.enter_context(socket.create_connection((host, port), timeout=10))
                conn.sendall(b"GET /healthz HTTP/1.1\r\nhost: p\r\n\r\n")
                assert conn.recv(4096).startswith(b"HTTP/1.1 200 ")
            with socket.create_connection((host, port), timeout=10) as conn:
                answer = _raw(conn, b"GET /healthz HTTP/1.1\r\nhost: p\r\n\r\n")
            assert answer.startswith(b"HTTP/1.1 503 ") and b"too_many_connections" in answer
        assert "a request's tenant is its x-tenant header" in proxy.stderr_text()


def test_a_proxy_without_keys_says_at_start_up_that_tenants_are_not_isolated(
    fleet: Any,
) -> None:
    _, proxy = fleet
    assert "tenants are not isolated" in proxy.stderr_text()


def test_other_v1_routes_reach_a_replica_and_request_ids_are_kept(fleet: Any) -> None:
    """A request's ``x-request-id``, kept or made up, is the one the replica names its
    answer after (``cmpl-`` or ``chatcmpl-`` and the header, as vLLM does)."""
    sims, proxy = fleet
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Render me"}]}
    status, _, via_proxy = proxy.request("/v1/chat/completions/render", body)
    direct = sims[0].post("/v1/chat/completions/render", body)
    assert status == 200
    assert json.loads(via_proxy)["token_ids"] == direct["token_ids"]
    completion = {"model": MODEL, "prompt": "Hi", "max_tokens": 1}
    status, headers, answer = proxy.request(
        "/v1/completions", completion, headers={"x-request-id": "my-request-7"}
    )
    assert status == 200 and headers["x-request-id"] == "my-request-7"
    assert json.loads(answer)["id"] == "cmpl-my-request-7"
    status, headers, answer = proxy.request("/v1/chat/completions", {**body, "max_tokens": 1})
    assert status == 200 and len(headers["x-request-id"]) == 32  # one was made up
    assert json.loads(answer)["id"] == f"chatcmpl-{headers['x-request-id']}"


def test_a_browser_page_on_an_allowed_origin_can_call_the_proxy(fleet: Any) -> None:
    sims, _ = fleet
    page = "http://localhost:5173"  # a chat UI's dev server, say
    args = (f"--static-replicas={sims[0].url}", f"--cors-allowed-origins={page}")
    with ProxyProcess(*args) as proxy:
        asked = {"origin": page, "access-control-request-method": "POST",
                 "access-control-request-headers": "content-type, x-request-id"}  # fmt: skip
        status, headers, _ = proxy.request("/v1/chat/completions", method="OPTIONS", headers=asked)
        assert status == 200
        assert headers["access-control-allow-origin"] == page
        assert headers["access-control-allow-headers"] == "content-type, x-request-id"
        body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
        status, headers, answer = proxy.request(
            "/v1/chat/completions", body, headers={"origin": page}
        )
        assert status == 200 and json.loads(answer)["choices"][0]["message"]["content"]
        assert headers["access-control-allow-origin"] == page
        assert "x-request-id" in headers["access-control-expose-headers"]
        other = {"origin": "http://elsewhere.example"}
        status, headers, _ = proxy.request("/v1/chat/completions", body, headers=other)
        assert status == 200 and "access-control-allow-origin" not in headers


def test_the_engines_own_routes_outside_v1_answer_as_the_engine_does(fleet: Any) -> None:
    """A client that counts tokens with vLLM's ``/tokenize`` (or asks ``/version``) gets
    the engine's answer through the proxy; an engine's admin route, which would act on
    one replica of many, is not forwarded."""
    sims, proxy = fleet
    body = {"model": MODEL, "prompt": "How many tokens is this?"}
    status, _, answer = proxy.request("/tokenize", body)
    assert status == 200
    assert json.loads(answer) == sims[0].call("POST", "/tokenize", body)[1]
    status, _, answer = proxy.request("/version", method="GET")
    assert status == 200 and json.loads(answer) == sims[0].call("GET", "/version")[1]
    status, _, answer = proxy.request("/reset_prefix_cache", {})
    assert (
        status == 404 and "No route /reset_prefix_cache" in json.loads(answer)["error"]["message"]
    )


def test_the_openai_client_lists_and_retrieves_the_served_models(fleet: Any) -> None:
    """As the engines list them: a card's ``max_model_len``, ``root`` and ``owned_by``
    are the engine's (chat front-ends size their context by ``max_model_len``)."""
    sims, proxy = fleet
    client = openai.OpenAI(base_url=f"{proxy.url}/v1", api_key="none", max_retries=0)
    direct = openai.OpenAI(base_url=f"{sims[0].url}/v1", api_key="none", max_retries=0)
    try:
        assert [model.id for model in client.models.list()] == [MODEL]
        engines = direct.models.list().data[0].model_dump()
        for card in (client.models.list().data[0], client.models.retrieve(MODEL)):
            listed = card.model_dump()
            assert list(listed) == list(engines)  # every field, in the engine's order
            assert {k: v for k, v in listed.items() if k not in ("created", "permission")} == {
                k: v for k, v in engines.items() if k not in ("created", "permission")
            }
        assert (engines["owned_by"], engines["max_model_len"]) == ("vllm", 4096)
        with pytest.raises(openai.NotFoundError) as missing:
            client.models.retrieve("org/no-such-model")
    finally:
        client.close()
        direct.close()
    error = missing.value.body
    assert isinstance(error, dict) and error["code"] == "model_not_found"
    assert "`org/no-such-model` does not exist" in error["message"]
    status, headers, answer = proxy.request("/v1/models", method="HEAD")  # as HTTP asks
    assert status == 200 and answer == b"" and int(headers["content-length"]) > 0
    status, headers, answer = proxy.request(f"/v1/models/{MODEL}", method="DELETE")
    assert status == 405 and "use GET" in json.loads(answer)["error"]["message"]
    assert headers["allow"] == "GET, HEAD"


def test_a_method_a_route_does_not_take_is_405_saying_what_it_allows(fleet: Any) -> None:
    """As HTTP asks of a 405 (RFC 9110: an ``Allow`` header), on the proxy's own routes
    too: a load balancer's probe sent with the wrong method learns it, not a 200."""
    _, proxy = fleet
    for method, path, allow in (
        ("GET", "/v1/chat/completions", "POST"),
        ("PUT", "/v1/completions", "POST"),
        ("POST", "/v1/models", "GET, HEAD"),
        ("DELETE", "/health", "GET, HEAD"),
        ("POST", "/healthz", "GET, HEAD"),
        ("PUT", "/readyz", "GET, HEAD"),
        ("POST", "/metrics", "GET, HEAD"),
    ):
        status, headers, answer = proxy.request(path, {}, method=method)
        assert (status, headers.get("allow")) == (405, allow), (method, path)
        assert json.loads(answer)["error"]["type"] == "invalid_request_error"
    assert proxy.request("/healthz", method="HEAD")[0] == 200


def test_a_replicas_redirect_to_itself_sends_the_client_back_to_the_proxy(fleet: Any) -> None:
    """A path with a trailing slash gets the engine's 307 to the route's own URL, built
    from the Host header the proxy sent (the replica's): the client is sent to that path on
    the proxy, never to the replica's address."""
    _, proxy = fleet
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 1}
    status, headers, _ = proxy.request("/v1/completions/?trace=1", body)
    assert status == 307 and headers["location"] == "/v1/completions?trace=1"
    status, _, answer = proxy.request(headers["location"], body)
    assert status == 200 and json.loads(answer)["choices"][0]["text"]


class _Redirecting(http.server.BaseHTTPRequestHandler):
    """A replica answering every request with a 307 to the request's ``x-to`` header,
    with ``{me}`` replaced by its own URL."""

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers["content-length"]))
        me = f"http://{self.headers['host']}"
        self.send_response(307)
        self.send_header("location", self.headers["x-to"].replace("{me}", me))
        self.send_header("content-length", "0")
        self.end_headers()

    def log_message(self, format: str, *args: Any) -> None:
        pass


def test_a_percent_encoded_inference_path_is_routed_as_the_engine_reads_it(fleet: Any) -> None:
    """The engines' servers decode a path's percent escapes: so does the proxy to know an
    inference route (the replica gets the path as the client wrote it)."""
    _, proxy = fleet
    body = {"model": MODEL, "prompt": "Encoded?", "max_tokens": 1}
    status, headers, answer = proxy.request("/v1/%63ompletions", body)
    assert status == 200 and json.loads(answer)["choices"][0]["text"]
    assert "x-kvroute-prefix-blocks" in headers  # routed, not merely forwarded


def test_a_redirect_elsewhere_is_passed_on_as_the_replica_gave_it() -> None:
    replica = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Redirecting)
    replica.daemon_threads = True
    threading.Thread(target=replica.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{replica.server_address[1]}"
    body = {"model": MODEL, "prompt": "Where?", "max_tokens": 1}
    try:
        with ProxyProcess(f"--static-replicas={url}", "--static-strategy=round_robin") as proxy:
            located = {
                to: proxy.request("/v1/completions", body, headers={"x-to": to})[1]["location"]
                for to in ("{me}/v1/other", "{me}", "{me}0/v1/other", "https://sso.example/login")
            }
    finally:
        replica.shutdown()
        replica.server_close()
    assert located == {
        "{me}/v1/other": "/v1/other",
        "{me}": "/",
        "{me}0/v1/other": f"{url}0/v1/other",  # another port: not the replica
        "https://sso.example/login": "https://sso.example/login",
    }


class _Echoing(http.server.BaseHTTPRequestHandler):
    """A replica answering every POST with the JSON body it was sent."""

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers["content-length"]))
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        pass


def test_the_engine_sees_the_tenants_salt_on_inference_and_forwarded_routes() -> None:
    """Behind --tenant-header, a body's cache_salt (and SGLang's extra_key, folded into
    it) reaches the engine as the salt derived from the tenant and it, on an inference
    route and on a forwarded one alike; a body naming none goes on as it came."""
    replica = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Echoing)
    replica.daemon_threads = True
    threading.Thread(target=replica.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{replica.server_address[1]}"
    alpha = {"x-tenant": "alpha"}
    try:
        with ProxyProcess(
            f"--static-replicas={url}", "--static-strategy=round_robin", "--tenant-header=x-tenant"
        ) as proxy:
            seen = {
                path: json.loads(proxy.request(path, {"model": MODEL, **fields}, headers=alpha)[2])
                for path, fields in (
                    ("/v1/completions", {"prompt": "Hi", "cache_salt": "beta"}),
                    ("/v1/responses", {"input": "Hi", "cache_salt": "beta", "extra_key": "k"}),
                    ("/v1/embeddings", {"input": "Hi"}),
                )
            }
    finally:
        replica.shutdown()
        replica.server_close()
    assert seen["/v1/completions"]["cache_salt"] == tenant_salt("alpha", "beta")
    assert seen["/v1/responses"]["cache_salt"] == tenant_salt("alpha", "betak")
    assert "extra_key" not in seen["/v1/responses"]
    assert seen["/v1/embeddings"] == {"model": MODEL, "input": "Hi"}


def test_health_answers_where_the_engines_probes_look(fleet: Any) -> None:
    _, proxy = fleet  # /health is vLLM's and SGLang's: probes pointed at them keep working
    assert proxy.request("/health", method="GET")[0] == 200
    assert proxy.request("/healthz", method="GET")[0] == 200


def test_no_replica_left_is_a_503_with_retry_after() -> None:
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{closed.getsockname()[1]}"  # nobody listens there
        with ProxyProcess(f"--static-replicas={url}", "--retry-after-s=3") as proxy:
            body = {"model": MODEL, "prompt": "Anyone?", "max_tokens": 1}
            status, headers, answer = proxy.request("/v1/completions", body)
    assert status == 503 and headers["retry-after"] == "3"
    error = json.loads(answer)["error"]
    assert error["code"] == "no_replica" and "cannot connect" in error["message"]


class _SilentReplica(http.server.BaseHTTPRequestHandler):
    """Lists the model, then takes every request and never answers it (until the test
    ends): an engine wedged mid-request."""

    released = threading.Event()

    def do_GET(self) -> None:
        cards = {"object": "list", "data": [{"id": MODEL, "object": "model", "owned_by": "vllm"}]}
        body = json.dumps(cards).encode()
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers["content-length"]))
        self.released.wait(60)
        self.close_connection = True

    def log_message(self, format: str, *args: Any) -> None:
        pass


def test_a_replica_that_never_answers_is_given_up_after_the_upstream_timeout() -> None:
    _SilentReplica.released.clear()
    silent = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _SilentReplica)
    silent.daemon_threads = True
    threading.Thread(target=silent.serve_forever, daemon=True).start()
    wedged = f"http://127.0.0.1:{silent.server_address[1]}"
    try:
        with (
            SimProcess(*SIM_ARGS) as sim,
            ProxyProcess(
                f"--static-replicas={wedged},{sim.url}",
                "--static-strategy=round_robin",
                "--upstream-timeout-s=0.3",
            ) as proxy,
        ):
            body = {"model": MODEL, "prompt": "Is anyone there?", "max_tokens": 2}
            answers = [proxy.request("/v1/completions", body) for _ in range(4)]
            retried = _proxy_metric(proxy, 'kvroute_proxy_retries_total{reason="timeout"}')
    finally:
        _SilentReplica.released.set()
        silent.shutdown()
        silent.server_close()
    assert [status for status, _, _ in answers] == [200] * 4
    assert all(json.loads(answer)["choices"][0]["text"] for _, _, answer in answers)
    assert 1 <= retried <= 4  # each one tried on the wedged replica first, given up, retried


def test_a_replica_dying_mid_stream_ends_the_stream_with_an_error_event() -> None:
    with (
        SimProcess(f"--model={MODEL}", "--replay-endpoint=", "--time-scale=0") as sim,
        ProxyProcess(f"--static-replicas={sim.url}") as proxy,
    ):
        sim.post("/sim/faults", {"delay_ms": 20})
        body = {"model": MODEL, "prompt": "Tell me a story", "max_tokens": 2000, "stream": True}
        request = _post(proxy.url, body)
        with urllib.request.urlopen(request, timeout=30) as resp:
            assert resp.readline().startswith(b"data: {")
            sim.call("POST", "/sim/faults", {"crash": True})
            rest = resp.read().decode()
        last = [e for e in rest.split("\n\n") if e.startswith("data: ")][-1]
        assert json.loads(last[6:])["error"]["type"] == "upstream_error"
        assert proxy.request("/healthz", method="GET")[0] == 200


def test_a_round_robin_proxy_counts_the_prompt_tokens_it_did_not_key_itself() -> None:
    """A static ``round_robin`` proxy does not key prompts it routes (nothing reads the
    keys), yet its fidelity counters hold every request's prompt tokens: the engine's
    usage, or its own count when the engine reports none (a stream that asked for
    ``continuous_usage_stats`` without ``include_usage``)."""
    with (
        SimProcess(*SIM_ARGS) as sim,
        ProxyProcess(f"--static-replicas={sim.url}", "--static-strategy=round_robin") as proxy,
    ):
        prompt = "The proxy routes this prompt without keying it. " * 4
        whole = {"model": MODEL, "prompt": prompt, "max_tokens": 2}
        counted = sim.post("/v1/completions", whole)["usage"]["prompt_tokens"]
        status, _, answer = proxy.request("/v1/completions", whole)
        assert status == 200 and json.loads(answer)["usage"]["prompt_tokens"] == counted
        options = {"include_usage": False, "continuous_usage_stats": True}
        stream = {**whole, "stream": True, "stream_options": options}
        events = _events(proxy.url, stream)
        assert all("usage" not in e for e in events[:-1])  # as the replica sends it
        assert _proxy_metric(proxy, "kvroute_proxy_prompt_tokens_total") == 2 * counted


def _proxy_metric(proxy: ProxyProcess, name: str) -> float:
    _, _, text = proxy.request("/metrics", method="GET")
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.decode().splitlines()
        if line.startswith(name + "{") or line.startswith(name + " ")
    )
