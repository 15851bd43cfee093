"""kvroute-sim as a real process: the OpenAI API, the prefix cache seen through usage and
metrics, bad input, and the faults a sidecar's tests rely on."""

from __future__ import annotations

import http.client
import json
import re
import time
import urllib.parse
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from tests.e2e.proxyproc import http_request
from tests.unit.enginesim.simproc import SimProcess, cached_tokens

pytestmark = pytest.mark.e2e
PREFIX = list(range(10_000, 12_000))  # 2,000 tokens = 125 blocks of 16


@pytest.fixture(scope="module")
def sim() -> Iterator[SimProcess]:
    with SimProcess("--instant", "--model=sim-model", "--max-model-len=8192") as proc:
        yield proc


def complete(sim: SimProcess, prompt, **extra):
    return sim.post("/v1/completions", {"model": "sim-model", "prompt": prompt, **extra})


def test_second_request_reports_the_shared_2000_token_prefix_as_cached(sim: SimProcess) -> None:
    hits, queries = (
        sim.metric("vllm:prefix_cache_hits_total"),
        sim.metric("vllm:prefix_cache_queries_total"),
    )
    first = complete(sim, [*PREFIX, 1, 2, 3], max_tokens=4)
    second = complete(sim, [*PREFIX, 9, 8, 7, 6, 5], max_tokens=4)
    # as vLLM: details only when something was cached (it tests the count's truth)
    assert (
        "prompt_tokens_details" in first["usage"]
        and first["usage"]["prompt_tokens_details"] is None
    )
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == 2000
    assert second["usage"]["prompt_tokens"] == 2005
    assert sim.metric("vllm:prefix_cache_hits_total") - hits == 2000
    assert sim.metric("vllm:prefix_cache_queries_total") - queries == 2003 + 2005


def test_salts_separate_tenants(sim: SimProcess) -> None:
    prompt = list(range(20_000, 20_320))

    def cached(salt: str) -> int:
        answer = complete(sim, prompt, max_tokens=2, cache_salt=salt)
        return cached_tokens(answer["usage"])

    assert cached("tenant-a") == 0
    assert cached("tenant-b") == 0
    assert cached("tenant-a") == 304


def test_chat_stream_with_usage_and_text_tokenization(sim: SimProcess) -> None:
    messages = [{"role": "system", "content": "You are terse. " * 60},
                {"role": "user", "content": "Name a colour."}]  # fmt: skip
    counted = sim.post("/tokenize", {"model": "sim-model", "messages": messages})
    body = {"model": "sim-model", "messages": messages, "max_tokens": 5, "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    cold = sim.stream("/v1/chat/completions", body)[-2]["usage"]
    assert "prompt_tokens_details" not in cold  # vLLM dumps the usage chunk without nulls
    events = sim.stream("/v1/chat/completions", body)
    assert events[-1] == "[DONE]"
    assert events[0]["choices"][0]["delta"]["role"] == "assistant"
    text = "".join(e["choices"][0]["delta"].get("content", "") for e in events[1:-2])
    assert len(text.split()) == 5
    assert events[-3]["choices"][0]["finish_reason"] == "length"
    use = events[-2]["usage"]
    assert use["prompt_tokens"] == counted["count"] and use["completion_tokens"] == 5
    assert use["prompt_tokens_details"]["cached_tokens"] == (counted["count"] - 1) // 16 * 16


def test_answers_are_named_after_the_x_request_id_header_as_vllm_names_them(
    sim: SimProcess,
) -> None:
    """vLLM's ``_base_request_id`` after ``chatcmpl-`` or ``cmpl-``: the ``X-Request-Id``
    header, else the body's ``request_id``, else 32 random hex digits; the body's must be
    a string, header or not."""
    chat = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    completion = {"prompt": [5, 6, 7], "max_tokens": 2}
    header = {"X-Request-Id": "trace-42"}
    named = sim.post("/v1/chat/completions", {**chat, "request_id": "body-1"}, header)
    assert named["id"] == "chatcmpl-trace-42"
    assert sim.post("/v1/completions", completion, header)["id"] == "cmpl-trace-42"
    usage = {"stream": True, "stream_options": {"include_usage": True}}
    for path, body, rid in [("/v1/completions", completion, "cmpl-trace-42"),
                            ("/v1/chat/completions", chat, "chatcmpl-trace-42")]:  # fmt: skip
        events = sim.stream(path, {**body, **usage}, header)
        assert events[-1] == "[DONE]" and {e["id"] for e in events[:-1]} == {rid}
    assert sim.post("/v1/chat/completions", {**chat, "request_id": "body-1"})["id"] == (
        "chatcmpl-body-1"
    )
    assert sim.post("/v1/completions", {**completion, "request_id": "body-2"})["id"] == (
        "cmpl-body-2"
    )
    made_up = [sim.post("/v1/chat/completions", chat)["id"] for _ in range(2)]
    assert all(re.fullmatch("chatcmpl-[0-9a-f]{32}", rid) for rid in made_up)
    assert made_up[0] != made_up[1]
    code, answer = sim.call(
        "POST", "/v1/completions", {**completion, "request_id": 7}, headers=header
    )
    assert code == 400
    assert answer["error"]["message"] == (
        "Invalid request: Expected `str`, got `int` - at `$.request_id`"
    )


@pytest.mark.parametrize(
    ("options", "usage"),
    [({}, True), ({"include_usage": None}, False), ({"continuous_usage_stats": False}, True)],
)
def test_stream_options_ask_for_usage_unless_it_is_turned_off(
    sim: SimProcess, options: dict[str, object], usage: bool
) -> None:
    """As vLLM's StreamOptions: given at all, include_usage is true unless false or null."""
    body = {"model": "sim-model", "prompt": [5, 6, 7], "max_tokens": 2, "stream": True,
            "stream_options": options}  # fmt: skip
    events = sim.stream("/v1/completions", body)
    assert events[-1] == "[DONE]"
    assert ("usage" in events[-2]) is usage
    whole = {"model": "sim-model", "prompt": [5, 6, 7], "max_tokens": 2, "stream_options": {}}
    assert sim.call("POST", "/v1/completions", whole)[0] == 200  # {}: allowed unstreamed


@pytest.mark.parametrize("include_usage", [True, False])
def test_continuous_usage_stats_put_the_choices_usage_so_far_in_every_chunk(
    sim: SimProcess, include_usage: bool
) -> None:
    """As vLLM's ``should_include_usage``: only with ``include_usage`` on, each chunk (the
    chat's role chunk included, at 0 completion tokens) carries its choice's usage so far,
    without ``prompt_tokens_details``; the final usage chunk still ends the stream."""
    options = {"include_usage": include_usage, "continuous_usage_stats": True}
    body = {"model": "sim-model", "prompt": [5, 6, 7], "max_tokens": 3, "n": 2, "stream": True,
            "stream_options": options}  # fmt: skip
    events = sim.stream("/v1/completions", body)[:-1]
    chat = {"model": "sim-model", "messages": [{"role": "user", "content": "Hi"}],
            "max_tokens": 2, "stream": True, "stream_options": options}  # fmt: skip
    chat_events = sim.stream("/v1/chat/completions", chat)[:-1]
    if not include_usage:
        assert not any("usage" in e for e in [*events, *chat_events])
        return
    *chunks, final = events
    assert final["choices"] == [] and final["usage"]["completion_tokens"] == 6
    so_far = {0: [], 1: []}
    for chunk in chunks:
        so_far[chunk["choices"][0]["index"]].append(chunk["usage"])
    for index in (0, 1):
        assert so_far[index] == [
            {"prompt_tokens": 3, "total_tokens": 3 + k, "completion_tokens": k} for k in (1, 2, 3)
        ]
    *chat_chunks, chat_final = chat_events
    prompt = chat_final["usage"]["prompt_tokens"]
    assert [c["usage"]["completion_tokens"] for c in chat_chunks] == [0, 1, 2]
    assert chat_chunks[0]["usage"] == {"prompt_tokens": prompt, "total_tokens": prompt,
                                       "completion_tokens": 0}  # fmt: skip


def test_text_completion_matches_tokenize(sim: SimProcess) -> None:
    prompt = "The quick brown fox jumps over the lazy dog. " * 20
    counted = sim.post("/tokenize", {"prompt": prompt})
    answer = complete(sim, prompt, max_tokens=3)
    assert answer["usage"]["prompt_tokens"] == counted["count"] == len(counted["tokens"])
    assert counted["max_model_len"] == 8192
    assert answer["choices"][0]["finish_reason"] == "length"
    assert len(answer["choices"][0]["text"].split()) == 3


def test_n_samples_are_n_engine_requests_that_hit_the_blocks_the_first_allocated(
    sim: SimProcess,
) -> None:
    # vLLM v1 fans n out into n requests, each looked up in the prefix cache: the first
    # misses, the others hit the prompt's 6 full blocks (99 tokens, capped at prompt - 1).
    prompt = list(range(24_000, 24_100))
    metrics = ("vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total",
               "vllm:generation_tokens_total")  # fmt: skip
    before = [sim.metric(m) for m in metrics]
    answer = complete(sim, prompt, max_tokens=4, n=3)
    assert [sim.metric(m) - b for m, b in zip(metrics, before, strict=True)] == [300, 192, 12]
    assert [c["index"] for c in answer["choices"]] == [0, 1, 2]
    assert answer["usage"]["prompt_tokens"] == 100  # the prompt once, not n times
    assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] == 96  # the last sample's


def test_a_batch_with_one_prompt_too_long_is_refused_whole(sim: SimProcess) -> None:
    queries = sim.metric("vllm:prefix_cache_queries_total")
    code, answer = sim.call("POST", "/v1/completions", {"prompt": [[1, 2, 3], list(range(8190))],
                                                         "max_tokens": 5})  # fmt: skip
    assert code == 400 and "maximum context length" in answer["error"]["message"]
    assert sim.metric("vllm:prefix_cache_queries_total") == queries
    rendered = sim.post("/v1/completions/render", {"prompt": [[5, 6], [7]]})
    assert [r["token_ids"] for r in rendered] == [[5, 6], [7]]


@pytest.mark.parametrize(
    ("path", "raw", "status", "needle"),
    [
        ("/v1/completions", b'{"prompt": [1, 2', 400, "Malformed JSON"),
        ("/v1/completions", b'{"prompt": "a", "x": ' + b"[" * 20_000, 400, "parsing the body"),
        ("/v1/completions", b'{"max_tokens": 3}', 400, "prompt"),
        ("/v1/completions", b'{"prompt": [1, -2]}', 400, "Token id -2 is out of vocabulary"),
        ("/v1/completions", b'{"prompt": [[1], [32000]]}', 400, "Token id 32000 is out of"),
        ("/v1/completions", b'{"prompt": []}', 400, "empty"),
        ("/v1/completions", b'{"prompt": [1], "max_tokens": 0}', 400, "max_tokens"),
        ("/v1/completions", b'{"prompt": "hi", "model": "other"}', 404, "other"),
        ("/v1/completions", b'{"prompt": [1], "cache_salt": "a/b"}', 400, "cache_salt"),
        ("/v1/completions", b"[1, 2, 3]", 400, "Invalid request"),
        ("/v1/completions", b'{"prompt": [1], "n": 0}', 400, "n must be at least 1"),
        ("/v1/completions", b'{"prompt": [1], "n": 2, "temperature": 0}', 400, "greedy"),
        ("/v1/completions", b'{"prompt": [[1], []]}', 400, "empty"),
        ("/v1/completions", b'{"prompt": [[1], "two"]}', 400, "prompt must be"),
        (
            "/v1/completions",
            b'{"prompt": [1], "stream_options": {"include_usage": true}}',
            400,
            "Stream options can only be defined when `stream=True`.",
        ),
        (
            "/v1/completions",
            b'{"prompt": [1], "stream": true, "stream_options": 5}',
            400,
            "at `$.stream_options`",
        ),
        ("/v1/chat/completions", b'{"messages": []}', 400, "messages"),
        ("/v1/chat/completions", b'{"messages": [{"content": "x"}]}', 400, "role"),
        ("/v1/chat/completions", b'{"messages": "hi"}', 400, "Invalid request"),
        ("/tokenize", b"{}", 400, "prompt or messages"),
    ],
)
def test_bad_input_gets_openai_errors(sim: SimProcess, path, raw, status, needle) -> None:
    code, answer = sim.call("POST", path, raw=raw)
    assert code == status
    assert needle in answer["error"]["message"]
    assert answer["error"]["code"] == status
    assert sim.call("GET", "/health")[0] == 200


def test_prompt_longer_than_max_model_len_is_400(sim: SimProcess) -> None:
    code, answer = sim.call("POST", "/v1/completions", {"prompt": list(range(8190)),
                                                         "max_tokens": 5})  # fmt: skip
    assert code == 400
    assert "maximum context length is 8192 tokens" in answer["error"]["message"]


@pytest.mark.parametrize("named", [{}, {"model": None}, {"model": ""}])
def test_a_request_naming_no_model_is_for_the_served_one(
    sim: SimProcess, named: dict[str, str | None]
) -> None:
    answer = sim.post("/v1/completions", {"prompt": "Whose?", "max_tokens": 1, **named})
    assert answer["model"] == "sim-model"
    assert sim.call("POST", "/v1/completions", {"prompt": "Whose?", "model": "x"})[0] == 404


def test_response_heads_are_the_engines_servers_own(sim: SimProcess) -> None:
    """uvicorn's ``date`` and ``server`` on every answer; a stream's content type with the
    charset Starlette adds to any ``text/*`` (and no header vLLM and SGLang do not send)."""
    body = {"prompt": "Heads", "max_tokens": 2}
    status, headers, _ = http_request(sim.url + "/v1/completions", body)
    assert (status, headers["content-type"], headers["server"]) == (
        200,
        "application/json",
        "uvicorn",
    )
    assert headers["date"].endswith(" GMT")
    status, headers, answer = http_request(sim.url + "/v1/completions", {**body, "stream": True})
    assert (status, headers["content-type"]) == (200, "text/event-stream; charset=utf-8")
    assert headers["transfer-encoding"] == "chunked" and "cache-control" not in headers
    assert answer.endswith(b"data: [DONE]\n\n")


def post_declared(url: str, body: bytes, content_type: str | None) -> tuple[int, Any]:
    """``(status, JSON answer)`` of a POST whose ``content-type`` is exactly
    ``content_type``, or absent (urllib would declare a form)."""
    parts = urllib.parse.urlsplit(url)
    connection = http.client.HTTPConnection(parts.netloc, timeout=30)
    try:
        headers = {"content-type": content_type} if content_type else {}
        connection.request("POST", parts.path, body, headers)
        answer = connection.getresponse()
        return answer.status, json.loads(answer.read())
    finally:
        connection.close()


def test_a_body_not_declared_json_is_refused_as_vllm_refuses_it(sim: SimProcess) -> None:
    """vLLM's ``validate_json_request``: the body's media type must be application/json
    (any parameters, any case); one sent with none is parsed as JSON first."""
    body = json.dumps({"prompt": "Declared?", "max_tokens": 1}).encode()
    for content_type in ("text/plain", "application/x-www-form-urlencoded", None):
        for path in ("/v1/completions", "/tokenize"):
            code, answer = post_declared(sim.url + path, body, content_type)
            error = answer["error"]
            assert (code, error["type"], error["param"]) == (400, "Bad Request", None)
            assert error["message"] == (
                "1 validation error:\n  Unsupported Media Type: Only 'application/json' is allowed"
            )
    declared = post_declared(sim.url + "/v1/completions", body, "Application/JSON; charset=utf-8")
    assert declared[0] == 200
    code, answer = post_declared(sim.url + "/v1/completions", b"{", None)
    assert code == 400 and "Unsupported Media Type" not in answer["error"]["message"]
    assert http_request(sim.url + "/v1/completions", method="GET")[0] == 405


def test_the_model_list_is_vllms_model_cards(sim: SimProcess) -> None:
    """vLLM's ``show_available_models``: each card made when asked, with one default
    ``ModelPermission``, fields in its models' order."""
    before = int(time.time())
    card = sim.call("GET", "/v1/models")[1]["data"][0]
    assert list(card) == ["id", "object", "created", "owned_by", "root", "parent",
                          "max_model_len", "permission"]  # fmt: skip
    assert (card["owned_by"], card["parent"]) == ("vllm", None)
    assert before <= card["created"] <= time.time()
    [permission] = card["permission"]
    assert re.fullmatch(r"modelperm-[0-9a-f]{32}", permission["id"])
    assert permission["object"] == "model_permission" and permission["organization"] == "*"
    assert (permission["allow_sampling"], permission["allow_fine_tuning"]) == (True, False)


def test_unknown_routes_and_methods_get_fastapis_own_answers(sim: SimProcess) -> None:
    """The engines' error handlers are registered for FastAPI's ``HTTPException``, which
    Starlette's router does not raise: an unknown path or a method its route does not take
    gets FastAPI's default ``{"detail": ...}``, not OpenAI's shape, and a 405 says what
    the route allows (FastAPI's routes do not add ``HEAD`` to a ``GET``)."""
    for method, path, status, detail, allow in (
        ("POST", "/nowhere", 404, "Not Found", None),
        ("POST", "/v1/tokenize", 404, "Not Found", None),  # vLLM's is /tokenize alone
        ("GET", "/v1/completions", 405, "Method Not Allowed", "POST"),
        ("POST", "/v1/models", 405, "Method Not Allowed", "GET"),
        ("DELETE", "/health", 405, "Method Not Allowed", "GET"),
    ):
        code, headers, body = http_request(sim.url + path, method=method)
        assert (code, json.loads(body)) == (status, {"detail": detail}), (method, path)
        assert headers.get("allow") == allow
    code, headers, body = http_request(sim.url + "/v1/models", method="HEAD")
    assert (code, headers["allow"]) == (405, "GET")
    code, headers, body = http_request(sim.url + "/health", method="GET")
    assert (code, body, "content-type" in headers) == (200, b"", False)  # as the engines'


def test_a_path_off_by_a_trailing_slash_is_redirected_as_fastapi_redirects_it(
    sim: SimProcess,
) -> None:
    """vLLM's and SGLang's FastAPI apps answer a route's path with a trailing slash too
    many (or too few), whatever the method, with a 307 to the route's own URL, built from
    the Host header the client sent."""
    for path, target in (
        ("/v1/completions/", "/v1/completions"),
        ("/v1/models/", "/v1/models"),
        ("/health/?probe=a%20b&x=1", "/health?probe=a%20b&x=1"),
    ):
        status, headers, body = http_request(sim.url + path, {"prompt": "x"},
                                             headers={"host": "engine.example:8000"})  # fmt: skip
        assert (status, body) == (307, b"")
        assert headers["location"] == f"http://engine.example:8000{target}"
    assert sim.call("POST", "/v1/nothing/")[0] == 404


def test_peer_router_probes(sim: SimProcess) -> None:
    assert sim.call("GET", "/v1/models")[1]["data"][0]["id"] == "sim-model"
    info = sim.call("GET", "/server_info")[1]
    assert info["page_size"] == 16 and info["kv_events"]["block_size"] == 16
    assert sim.call("GET", "/model_info")[1]["is_generation"] is True
    assert set(sim.call("GET", "/get_load")[1]) >= {"num_reqs", "num_waiting_reqs"}
    rendered = sim.post("/v1/completions/render", {"prompt": "hello there", "max_tokens": 7})
    assert rendered[0]["token_ids"] == sim.post("/tokenize", {"prompt": "hello there"})["tokens"]
    assert rendered[0]["sampling_params"]["max_tokens"] == 7
    assert "vllm:cache_config_info" in sim.call("GET", "/metrics")[1]
    sources = sim.call("GET", "/kv_event_sources")[1]
    assert sources["0"]["endpoint"] == sim.events and sources["0"]["replay_endpoint"] == sim.replay


def test_injected_failures_then_recovery(sim: SimProcess) -> None:
    state = sim.post("/sim/faults", {"fail_requests": 2})
    assert state["fail_requests"] == 2
    codes = [sim.call("POST", "/v1/completions", {"prompt": [1, 2, 3]})[0] for _ in range(3)]
    assert codes == [500, 500, 200]
    code, answer = sim.call("POST", "/sim/faults", {"slowdown": 0.5})
    assert code == 400 and "slowdown" in answer["error"]["message"]
    assert sim.call("POST", "/sim/faults", {"no_such_fault": True})[0] == 400


def test_held_steps_queue_requests_until_released(sim: SimProcess) -> None:
    """A held engine accepts a request and leaves it waiting, however long the caller
    looks, while its API and metrics answer; released, it serves it."""
    assert sim.post("/sim/faults", {"hold_steps": True})["steps_held"] is True
    try:
        with ThreadPoolExecutor(1) as pool:
            answer = pool.submit(complete, sim, list(range(31_000, 31_064)), max_tokens=1)
            deadline = time.monotonic() + 30
            while sim.metric("vllm:num_requests_waiting") != 1:
                assert time.monotonic() < deadline, "the request never reached the queue"
            assert not answer.done()
            assert sim.metric("vllm:num_requests_running") == 0
            sim.post("/sim/faults", {"hold_steps": False})
            assert answer.result(30)["usage"]["completion_tokens"] == 1
    finally:
        sim.call("DELETE", "/sim/faults")


def test_reset_prefix_cache_empties_the_cache(sim: SimProcess) -> None:
    prompt = list(range(30_000, 30_100))
    complete(sim, prompt, max_tokens=1)
    assert sim.call("POST", "/reset_prefix_cache")[0] == 200
    assert sim.call("GET", "/sim/state")[1]["cached_block_hashes"] == []
    again = complete(sim, prompt, max_tokens=1)
    assert cached_tokens(again["usage"]) == 0
    assert sim.call("POST", "/flush_cache")[0] == 404  # SGLang's name, not vLLM's


def test_restart_fault_empties_cache_and_counters_and_crash_fault_exits() -> None:
    with SimProcess("--instant") as sim:
        prompt = list(range(64))
        complete_any = {"prompt": prompt, "max_tokens": 1}
        for _ in range(2):
            sim.post("/v1/completions", complete_any)
        assert sim.metric("vllm:prefix_cache_hits_total") == 48
        assert sim.call("GET", "/sim/state")[1]["cached_block_hashes"]
        assert sim.post("/sim/faults", {"restart": True})["restarts"] == 1
        assert sim.call("GET", "/sim/state")[1]["cached_block_hashes"] == []
        assert sim.metric("vllm:prefix_cache_queries_total") == 0  # a new process's counters
        again = sim.post("/v1/completions", complete_any)
        assert cached_tokens(again["usage"]) == 0
        assert sim.metric("vllm:prefix_cache_queries_total") == 64
        sim.post("/sim/faults", {"crash": True})
        assert sim.proc is not None
        assert sim.proc.wait(timeout=10) == 70


def test_sglang_mode_serves_sglang_metric_names_in_modelled_time() -> None:
    args = ["--event-format=sglang", "--time-scale=0.01", "--block-size=4"]
    with SimProcess(*args) as sim:
        prompt = list(range(40))
        for _ in range(2):
            answer = sim.post("/v1/completions", {"prompt": prompt, "max_tokens": 3})
        assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] == 36
        assert sim.metric("sglang:cached_tokens_total") == 36
        assert sim.metric("sglang:prompt_tokens_total") == 80
        assert sim.metric("sglang:time_to_first_token_seconds_count") == 2
        assert sim.metric("sglang:cache_hit_rate") == pytest.approx(36 / 80)
        assert "vllm:" not in sim.call("GET", "/metrics")[1]
        assert sim.call("GET", "/server_info")[1]["page_size"] == 4


def test_invalid_settings_exit_with_status_2() -> None:
    sim = SimProcess("--num-blocks=10", "--max-model-len=9999")
    with pytest.raises(RuntimeError, match=r"exit 2\).*max_model_len 9999 exceeds the KV pool"):
        sim.__enter__()


def test_a_token_id_out_of_the_vocabulary_is_refused_after_the_length_and_sampling(
    sim: SimProcess,
) -> None:
    """vLLM renders (length), builds the sampling parameters, and only then its engine
    reads the token ids: a stream has begun by then and carries the refusal as an event."""
    queries = sim.metric("vllm:prefix_cache_queries_total")
    for extra, needle in (
        ({"prompt": [[*range(8190)], [40_000]]}, "maximum context length"),
        ({"prompt": [40_000], "n": 2, "temperature": 0}, "greedy sampling"),
        ({"prompt": [40_000], "n": 0}, "n must be at least 1"),
        ({"prompt": [7, 40_000]}, "Token id 40000 is out of vocabulary"),
    ):
        code, answer = sim.call("POST", "/v1/completions", {"max_tokens": 5, **extra})
        assert code == 400 and needle in answer["error"]["message"], answer
    events = sim.stream("/v1/completions", {"prompt": [[7], [-4]], "stream": True,
                                           "stream_options": {"include_usage": True}})  # fmt: skip
    assert events == [
        {
            "error": {
                "message": "Token id -4 is out of vocabulary",
                "type": "BadRequestError",
                "param": None,
                "code": 400,
            }
        },
        "[DONE]",
    ]
    assert sim.metric("vllm:prefix_cache_queries_total") == queries  # nothing was queued


def test_vllms_request_validators_answer_in_its_validation_errors_words(sim: SimProcess) -> None:
    """vLLM's prompt-count validator runs before its stream_options one (defined after it),
    and both are answered as pydantic validation errors."""
    body = {"prompt": [[1]] * 1025, "stream_options": {"include_usage": True}}
    code, answer = sim.call("POST", "/v1/completions", body)
    assert code == 400 and answer["error"]["type"] == "Bad Request"
    assert answer["error"]["param"] == "prompt"
    assert answer["error"]["message"].startswith(
        "1 validation error:\n  {'type': 'value_error', 'loc': 'body', 'msg': 'Value error, "
        "prompt list length 1025 exceeds the maximum allowed count of 1024."
    )
    assert (
        "'input': '<dict of 2 items>', 'ctx': {'error': VLLMValidationError("
        in (answer["error"]["message"])
    )
    chat = {"messages": [{"role": "user", "content": "x"}], "stream_options": {"a": 1}}
    code, answer = sim.call("POST", "/v1/chat/completions", chat)
    assert (code, answer["error"]["param"]) == (400, "stream_options")
    assert "(parameter=stream_options)', 'input': '<dict of 2 items>'" in answer["error"]["message"]
