"""kvroute-sim in SGLang mode answers the official OpenAI client as SGLang 0.5.23 does:
``n`` and batches (a warm-up per prompt, then the samples), SGLang's usage sums, its
stream order and ids (named after a client's ``rid``), its error shape, and none of
vLLM's refusals."""

from __future__ import annotations

import contextlib
import http.client
import json
import re
from collections.abc import Iterator

import openai
import pytest
from fastapi.exceptions import RequestValidationError

from tests.unit.enginesim.simproc import SimProcess

pytestmark = pytest.mark.e2e

MODEL = "sim-model"
JSON = {"content-type": "application/json"}
HEX32 = re.compile(r"^[0-9a-f]{32}$")


@pytest.fixture(scope="module")
def sim() -> Iterator[SimProcess]:
    args = ("--instant", f"--model={MODEL}", "--max-model-len=4096", "--block-size=16")
    with SimProcess(*args, "--event-format=sglang") as proc:
        yield proc


@pytest.fixture(scope="module")
def client(sim: SimProcess) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{sim.url}/v1", api_key="unused", max_retries=0) as c:
        yield c


def fresh(start: int, length: int) -> list[int]:
    """Token ids no other test of this module sends."""
    return list(range(start, start + length))


def test_a_batch_with_two_samples_sums_each_prompts_first_sample_after_its_warm_up(
    sim: SimProcess, client: openai.OpenAI
) -> None:
    first, second = fresh(1_000, 40), fresh(2_000, 24)
    before = sim.metric("sglang:prompt_tokens_total"), sim.metric("sglang:cached_tokens_total")
    answer = client.completions.create(model=MODEL, prompt=[first, second], n=2, max_tokens=3)
    assert [c.index for c in answer.choices] == [0, 1, 2, 3]  # prompt i, sample j: i * 2 + j
    assert all(c.finish_reason == "length" and len(c.text.split()) == 3 for c in answer.choices)
    assert HEX32.match(answer.id)
    usage = answer.usage
    assert usage is not None and usage.prompt_tokens_details is not None
    assert (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens) == (64, 12, 76)
    # the warm-up cached each prompt's full blocks, so each first sample hit them: 32 + 16,
    # summed (vLLM would say one request's count)
    assert usage.prompt_tokens_details.cached_tokens == 48
    # SGLang counts the warm-ups: 40 + 24 prompt tokens more than the four samples' own
    prompt, cached = (sim.metric("sglang:prompt_tokens_total") - before[0],
                      sim.metric("sglang:cached_tokens_total") - before[1])  # fmt: skip
    assert (prompt, cached) == (3 * 64, 2 * 48)


def test_a_whole_answer_has_sglangs_fields(sim: SimProcess) -> None:
    body = {"model": MODEL, "prompt": fresh(3_000, 20), "max_tokens": 2}
    answer = sim.post("/v1/completions", body)
    assert list(answer) == ["id", "object", "created", "model", "choices", "usage", "metadata"]
    assert (
        answer["choices"][0]["matched_stop"] is None and "stop_reason" not in answer["choices"][0]
    )
    assert answer["usage"]["reasoning_tokens"] == 0
    assert answer["usage"]["completion_tokens_details"] is None
    assert answer["metadata"]["weight_version"] == "default"


def test_a_streamed_prompt_with_two_samples_sends_each_under_its_own_id(
    client: openai.OpenAI,
) -> None:
    stream = client.completions.create(
        model=MODEL, prompt=fresh(4_000, 40), n=2, max_tokens=3, stream=True,
        stream_options={"include_usage": True},
    )  # fmt: skip
    chunks = list(stream)
    ids: dict[int, set[str]] = {0: set(), 1: set()}
    ends: dict[int, list[str]] = {}
    for chunk in chunks[:-1]:
        (choice,) = chunk.choices
        ids[choice.index].add(chunk.id)
        if choice.finish_reason is not None:
            ends.setdefault(choice.index, []).append(choice.finish_reason)
    assert all(len(v) == 1 for v in ids.values()) and ids[0] != ids[1]
    assert ends == {0: ["length"], 1: ["length"]}
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and usage is not None
    assert (usage.prompt_tokens, usage.completion_tokens) == (40, 6)
    assert usage.prompt_tokens_details is not None
    assert usage.prompt_tokens_details.cached_tokens == 32  # the first sample, warmed


def test_stream_options_without_include_usage_send_no_usage_chunk(
    client: openai.OpenAI,
) -> None:
    for options in ({}, {"include_usage": False}):
        stream = client.completions.create(
            model=MODEL, prompt="Once upon a time", max_tokens=2, stream=True,
            stream_options=options,  # type: ignore[arg-type]
        )  # fmt: skip
        assert all(chunk.usage is None for chunk in stream)


def test_a_chat_stream_sends_each_role_with_its_first_output_and_the_ends_after(
    client: openai.OpenAI,
) -> None:
    chunks = list(
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Stream two answers."}],
            max_tokens=3, n=2, stream=True, stream_options={"include_usage": True},
        )
    )  # fmt: skip
    seen: list[tuple[int, str]] = []
    for chunk in chunks[:-1]:
        (choice,) = chunk.choices
        if choice.delta.role:
            seen.append((choice.index, "role"))
        elif choice.delta.content:
            assert choice.finish_reason is None  # SGLang ends a choice in a chunk of its own
            seen.append((choice.index, "content"))
        else:
            assert choice.finish_reason == "length"
            seen.append((choice.index, "end"))
    for index in (0, 1):
        mine = [what for i, what in seen if i == index]
        assert mine == ["role", "content", "content", "content", "end"]
    assert [what for _, what in seen][-2:] == ["end", "end"]  # after every output
    usage = chunks[-1].usage
    assert usage is not None and usage.completion_tokens == 6 and usage.prompt_tokens < 20


def test_what_vllm_refuses_sglang_serves(client: openai.OpenAI) -> None:
    greedy = client.completions.create(model=MODEL, prompt="x", n=2, temperature=0, max_tokens=1)
    assert len(greedy.choices) == 2
    hot = client.completions.create(model=MODEL, prompt="x", temperature=2.5, max_tokens=1)
    assert hot.choices[0].finish_reason == "length"
    beyond = client.completions.create(model=MODEL, prompt=[5, 40_000], max_tokens=1)
    assert beyond.usage is not None and beyond.usage.prompt_tokens == 2  # no vocabulary check
    many = client.completions.create(model=MODEL, prompt=["x"] * 1100, max_tokens=1)
    assert len(many.choices) == 1100  # no bound on a batch


def test_n_below_one_fails_as_sglangs_sums_fail(sim: SimProcess, client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError, match=r"range\(\) arg 3 must not be zero"):
        client.completions.create(model=MODEL, prompt="x", n=0, max_tokens=1)
    negative = client.completions.create(model=MODEL, prompt="x", n=-1, max_tokens=1)
    assert negative.usage is not None and negative.usage.prompt_tokens == 0
    with pytest.raises(openai.InternalServerError, match="list index out of range"):
        client.completions.create(model=MODEL, prompt=["x", "y"], n=0, max_tokens=1)


def test_errors_have_sglangs_shape_and_types(sim: SimProcess) -> None:
    cases = [
        ({"prompt": [0]}, "Prompt cannot be empty", "BadRequestError"),
        (
            {"prompt": "x", "temperature": -1},
            "temperature must be a non-negative",
            "BadRequestError",
        ),
        ({"prompt": [1] * 4096}, "The input (4096 tokens) is longer than", "BadRequestError"),
        ({"prompt": "x", "max_tokens": 0}, "max_tokens", "Bad Request"),
        ({"prompt": [-1]}, "Token id -1 cannot be served", "BadRequestError"),
    ]
    for extra, needle, error_type in cases:
        code, answer = sim.call("POST", "/v1/completions", {"model": MODEL, **extra})
        assert code == 400, answer
        assert set(answer) == {"object", "message", "type", "param", "code"}
        assert answer["object"] == "error" and needle in answer["message"]
        assert (answer["type"], answer["code"]) == (error_type, 400)
    code, answer = sim.call("POST", "/v1/chat/completions", {"messages": []})
    assert (code, answer["message"], answer["type"]) == (
        400, "Messages cannot be empty.", "BadRequestError",
    )  # fmt: skip


def test_the_openai_client_raises_its_own_errors_on_sglangs_shape(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError, match="Requested token count exceeds"):
        client.completions.create(model=MODEL, prompt=[1] * 4000, max_tokens=200)


def test_sglang_checks_no_model_name_and_answers_with_the_requests(
    sim: SimProcess, client: openai.OpenAI
) -> None:
    other = client.completions.create(model="any-name", prompt="x", max_tokens=1)
    assert other.model == "any-name"
    chunks = list(
        client.chat.completions.create(
            model="another", messages=[{"role": "user", "content": "x"}], max_tokens=1, stream=True
        )
    )
    assert {chunk.model for chunk in chunks} == {"another"}
    assert sim.post("/v1/completions", {"prompt": "x", "max_tokens": 1})["model"] == "default"


def test_n_zero_breaks_a_streams_usage_as_sglang_does(sim: SimProcess) -> None:
    """Streamed, n = 0 fails SGLang's usage sum (index % 0): a completion stream says so
    in an error event; a chat stream, which catches only ValueError, breaks off."""
    body = {"prompt": "x", "n": 0, "max_tokens": 1, "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    events = sim.stream("/v1/completions", body)
    assert events[-2:] == [
        {
            "error": {
                "object": "error",
                "message": "integer modulo by zero",
                "type": "BadRequestError",
                "param": None,
                "code": 400,
            }
        },
        "[DONE]",
    ]
    assert events[0]["choices"][0]["finish_reason"] == "length"
    chat = {"messages": [{"role": "user", "content": "x"}], "n": 0, "max_tokens": 1,
            "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
    with pytest.raises(http.client.IncompleteRead) as caught:
        sim.stream("/v1/chat/completions", chat)
    assert b'"finish_reason":"length"' in caught.value.partial
    assert b"[DONE]" not in caught.value.partial
    assert sim.call("GET", "/health")[0] == 200


def test_chat_with_two_samples_counts_the_prompt_once_and_the_warmed_cache(
    client: openai.OpenAI,
) -> None:
    messages = [{"role": "system", "content": "You answer twice. " * 40},
                {"role": "user", "content": "Two ways?"}]  # fmt: skip
    two = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, n=2)  # type: ignore[arg-type]
    assert [c.index for c in two.choices] == [0, 1]
    assert all(c.message.content and c.finish_reason == "length" for c in two.choices)
    usage = two.usage
    assert usage is not None and usage.completion_tokens == 8
    assert usage.prompt_tokens_details is not None
    # one prompt: its first sample's count, every full block the warm-up cached
    assert usage.prompt_tokens_details.cached_tokens == (usage.prompt_tokens - 1) // 16 * 16
    assert HEX32.match(two.id)


def test_tokenize_answers_on_both_of_sglangs_paths_in_its_shape(sim: SimProcess) -> None:
    """SGLang serves /v1/tokenize and /tokenize with one handler (TokenizeResponse:
    tokens, count, max_model_len; no model check), which the proxy's tokenizer probe asks
    first of an SGLang engine."""
    answers = [sim.post(path, {"prompt": "hello there"}) for path in ("/v1/tokenize", "/tokenize")]
    assert answers[0] == answers[1]
    assert list(answers[0]) == ["tokens", "count", "max_model_len"]
    assert answers[0]["count"] == len(answers[0]["tokens"]) > 0
    assert answers[0]["max_model_len"] == 4096
    named = sim.post("/v1/tokenize", {"model": "any-name", "prompt": "hello there"})
    assert named == answers[0]


def test_continuous_usage_rides_on_content_chunks_whatever_include_usage_says(
    sim: SimProcess,
) -> None:
    """SGLang reads continuous_usage_stats on its own: a completion stream puts each
    choice's usage so far on every chunk (without prompt_tokens_details), a chat stream on
    its content chunks alone (with the cached tokens); only include_usage adds the
    usage-only chunk at the end."""
    options = {"continuous_usage_stats": True}
    body = {
        "prompt": "Once upon a time",
        "max_tokens": 3,
        "stream": True,
        "stream_options": options,
    }
    events = sim.stream("/v1/completions", body)
    assert events[-1] == "[DONE]" and len(events) == 4  # three tokens, no usage chunk
    usages = [event["usage"] for event in events[:-1]]
    assert [u["completion_tokens"] for u in usages] == [1, 2, 3]
    prompt = usages[0]["prompt_tokens"]
    assert prompt > 0 and [u["total_tokens"] for u in usages] == [
        prompt + 1,
        prompt + 2,
        prompt + 3,
    ]
    assert list(usages[0]) == [
        "prompt_tokens", "total_tokens", "completion_tokens", "prompt_tokens_details",
        "reasoning_tokens", "completion_tokens_details",
    ]  # fmt: skip
    assert usages[0]["prompt_tokens_details"] is None
    assert events[2]["choices"][0]["finish_reason"] == "length"  # the finish chunk has it too

    chat = {"messages": [{"role": "user", "content": "Count with me."}], "max_tokens": 2,
            "stream": True, "stream_options": {**options, "include_usage": True}}  # fmt: skip
    events = sim.stream("/v1/chat/completions", chat)
    role, first, second, end, final, done = events
    assert done == "[DONE]"
    assert "usage" not in role and "usage" not in end  # omitted, not null: a msgspec struct
    assert end["choices"][0]["finish_reason"] == "length"
    assert [first["usage"]["completion_tokens"], second["usage"]["completion_tokens"]] == [1, 2]
    assert first["usage"]["prompt_tokens_details"] is None  # none cached: no details
    assert final["choices"] == [] and final["usage"]["completion_tokens"] == 2


def test_a_chat_asking_for_no_tokens_is_served_as_a_prefill_a_completion_is_refused(
    sim: SimProcess, client: openai.OpenAI
) -> None:
    messages = [{"role": "user", "content": "Warm the cache with this."}]
    whole = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=0)  # type: ignore[arg-type]
    (choice,) = whole.choices
    assert (choice.message.content, choice.finish_reason) == ("", "length")
    assert whole.usage is not None and whole.usage.completion_tokens == 0
    assert whole.usage.total_tokens == whole.usage.prompt_tokens > 0
    chunks = list(
        client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=0, stream=True,  # type: ignore[arg-type]
            stream_options={"include_usage": True},
        )
    )  # fmt: skip
    role, end, final = chunks
    assert role.choices[0].delta.role == "assistant"
    assert end.choices[0].finish_reason == "length"
    assert final.usage is not None and final.usage.completion_tokens == 0
    # the prefill cached the prompt's whole blocks, as SGLang's own warm-ups do
    details = final.usage.prompt_tokens_details  # SGLang: none when 0 cached
    cached = 0 if details is None else details.cached_tokens
    assert cached == (final.usage.prompt_tokens - 1) // 16 * 16
    code, answer = sim.call(
        "POST", "/v1/chat/completions", {"messages": messages, "max_completion_tokens": -1}
    )
    assert (code, answer["message"], answer["type"]) == (
        400, "max_new_tokens must be at least 0, got -1.", "BadRequestError",
    )  # fmt: skip
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.completions.create(model=MODEL, prompt="x", max_tokens=0)


def test_a_lora_adapter_in_the_model_name_is_refused_as_without_enable_lora(
    sim: SimProcess, client: openai.OpenAI
) -> None:
    """SGLang reads ``name:adapter`` as a LoRA adapter (after the served name and a colon,
    else after the first colon), which a server without --enable-lora refuses; a name
    with an empty adapter is the base model."""
    for model, adapter in ((f"{MODEL}:tuned", "tuned"), ("other:a:b", "a:b"), ("x: pad ", "pad")):
        code, answer = sim.call(
            "POST", "/v1/chat/completions",
            {"model": model, "messages": [{"role": "user", "content": "x"}], "max_tokens": 1},
        )  # fmt: skip
        assert (code, answer["type"]) == (400, "BadRequestError")
        assert answer["message"].startswith(
            f"LoRA adapter '{adapter}' was requested, but LoRA is not enabled."
        )
    with pytest.raises(openai.BadRequestError, match="LoRA is not enabled"):
        client.completions.create(model=f"{MODEL}:tuned", prompt="x", max_tokens=1)
    assert client.completions.create(model="base:", prompt="x", max_tokens=1).model == "base:"


def test_answers_are_named_after_the_rid_exactly_as_sglang_names_them(
    sim: SimProcess, client: openai.OpenAI
) -> None:
    """SGLang's engine request takes the body's ``rid`` as its id, which names the answer
    and every chunk, with no ``cmpl-`` or ``chatcmpl-``; a batch's prompts are ``rid_i``;
    the samples of ``n > 1`` get new uuids; without a rid, each is a uuid hex."""
    completion = {"prompt": fresh(5_000, 20), "max_tokens": 2}
    chat = {"messages": [{"role": "user", "content": "Name me."}], "max_tokens": 2}
    usage = {"stream": True, "stream_options": {"include_usage": True}}
    assert sim.post("/v1/completions", {**completion, "rid": "cmpl-7"})["id"] == "cmpl-7"
    assert sim.post("/v1/chat/completions", {**chat, "rid": "my chat"})["id"] == "my chat"
    for path, body in (("/v1/completions", completion), ("/v1/chat/completions", chat)):
        events = sim.stream(path, {**body, **usage, "rid": "streamed"})
        assert events[-1] == "[DONE]" and {e["id"] for e in events[:-1]} == {"streamed"}
    named = client.completions.create(
        model=MODEL, prompt="Once", max_tokens=1, extra_body={"rid": "via-client"}
    )
    assert named.id == "via-client"

    batch = {"prompt": [fresh(5_100, 3), fresh(5_200, 3)], "max_tokens": 2, "rid": "b"}
    assert sim.post("/v1/completions", batch)["id"] == "b_0"
    ids: dict[int, set[str]] = {0: set(), 1: set()}
    for event in sim.stream("/v1/completions", {**batch, **usage})[:-2]:
        ids[event["choices"][0]["index"]].add(event["id"])
    assert ids == {0: {"b_0"}, 1: {"b_1"}}
    listed = sim.post("/v1/completions", {**batch, "rid": ["first", "second"]})
    assert listed["id"] == "first"

    sampled = sim.post("/v1/completions", {**completion, "n": 2, "rid": "sampled"})
    assert HEX32.match(sampled["id"])  # regenerate_rid: the samples are named anew
    made_up = [sim.post("/v1/chat/completions", chat)["id"] for _ in range(2)]
    assert all(HEX32.match(rid) for rid in made_up) and made_up[0] != made_up[1]


def test_sglang_reads_no_request_id_header_unless_told_to(sim: SimProcess) -> None:
    """``x-override-rid`` is read only with SGLANG_ENABLE_REQUEST_HEADER_OVERRIDES (off
    by default), and vLLM's ``X-Request-Id`` never."""
    chat = {"messages": [{"role": "user", "content": "Headers?"}], "max_tokens": 1}
    headers = {"x-override-rid": "from-header", "X-Request-Id": "trace-1"}
    assert sim.post("/v1/chat/completions", {**chat, "rid": "body"}, headers)["id"] == "body"
    assert HEX32.match(sim.post("/v1/chat/completions", chat, headers)["id"])


def test_a_chat_takes_x_override_rid_over_the_body_where_sglang_is_told_to_read_it() -> None:
    """SGLANG_ENABLE_REQUEST_HEADER_OVERRIDES (here ``--request-header-overrides``): the
    header replaces a chat's rid, body or not; a completion does not read it (0.5.23)."""
    args = ("--instant", "--max-model-len=4096", "--event-format=sglang")
    with SimProcess(*args, "--request-header-overrides") as sim:
        chat = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
        header = {"x-override-rid": "hdr-1"}
        assert sim.post("/v1/chat/completions", {**chat, "rid": "body"}, header)["id"] == "hdr-1"
        events = sim.stream("/v1/chat/completions", {**chat, "stream": True}, header)
        assert events[-1] == "[DONE]" and {e["id"] for e in events[:-1]} == {"hdr-1"}
        two = sim.post("/v1/chat/completions", {**chat, "n": 2}, header)
        assert HEX32.match(two["id"])  # hdr-1_0 and hdr-1_1 name the prompt; samples anew
        completion = {"prompt": "x", "max_tokens": 1}
        assert sim.post("/v1/completions", {**completion, "rid": "body"}, header)["id"] == "body"
        assert HEX32.match(sim.post("/v1/completions", completion, header)["id"])


def test_a_rid_sglang_cannot_take_is_refused_with_its_error(sim: SimProcess) -> None:
    one, two = {"prompt": "x", "max_tokens": 1}, {"prompt": ["x", "y"], "max_tokens": 1}
    cases = [
        ({**one, "rid": 7}, 400, "Bad Request",
         "Invalid request: Expected `str | array | null`, got `int` - at `$.rid`"),
        ({**one, "rid": ["a", 1]}, 400, "Bad Request",
         "Invalid request: Expected `str`, got `int` - at `$.rid[1]`"),
        ({**one, "rid": ["a"]}, 500, "InternalServerError",
         "Internal server error: unhashable type: 'list'"),
        ({**one, "rid": ["a", "a"]}, 400, "BadRequestError",
         "Duplicate request IDs detected within the request: ['a']"),
        ({**two, "rid": ["a"]}, 400, "BadRequestError",
         "The specified rids length mismatch with the batch_size for batch processing."),
        ({**two, "rid": ["a", "a"], "stream": True}, 400, "BadRequestError",
         "Duplicate request IDs detected within the request: ['a']"),
    ]  # fmt: skip
    for body, status, error_type, message in cases:
        code, answer = sim.call("POST", "/v1/completions", body)
        assert (code, answer["type"], answer["message"]) == (status, error_type, message)


@contextlib.contextmanager
def streaming(sim: SimProcess, body: dict[str, object]) -> Iterator[None]:
    """While inside, ``body``'s stream runs (its first event read, the rest slowed by a
    fault); on leaving, the fault is lifted and the stream read to its end."""
    sim.post("/sim/faults", {"delay_ms": 100})
    host, port = sim.url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    try:
        conn.request("POST", "/v1/completions", json.dumps(body), JSON)
        running = conn.getresponse()
        assert running.status == 200 and running.readline().startswith(b"data: ")
        try:
            yield
        finally:
            sim.call("DELETE", "/sim/faults")
        assert running.read().endswith(b"data: [DONE]\n\n")
    finally:
        sim.call("DELETE", "/sim/faults")
        conn.close()


def test_a_rid_in_flight_is_refused_until_its_request_ends(sim: SimProcess) -> None:
    """SGLang keeps a rid taken while its request runs ("Duplicate request ID detected"),
    and free again once it ended: the simulator's own engine ids never collide."""
    body = {"prompt": fresh(6_000, 8), "max_tokens": 40, "stream": True, "rid": "busy"}
    with streaming(sim, body):
        code, answer = sim.call("POST", "/v1/completions", {**body, "stream": False})
        assert (code, answer["type"], answer["message"]) == (
            400, "BadRequestError", "Duplicate request ID detected: busy",
        )  # fmt: skip
    again = sim.post("/v1/completions", {**body, "stream": False, "max_tokens": 1})
    assert again["id"] == "busy"


def test_a_body_not_declared_json_is_refused_in_sglangs_shape(sim: SimProcess) -> None:
    """SGLang's ``validate_json_request`` error names the header; its validation handler
    answers with ``str()`` of the exception and of its errors, in its own error shape."""
    host = sim.url.removeprefix("http://")
    body = json.dumps({"model": MODEL, "prompt": "Declared?", "max_tokens": 1})
    error = {
        "loc": ["header", "content-type"],
        "msg": "Unsupported Media Type: Only 'application/json' is allowed",
        "type": "value_error",
    }
    exc = RequestValidationError(errors=[error])
    for path in ("/v1/completions", "/v1/tokenize"):
        connection = http.client.HTTPConnection(host, timeout=30)
        try:
            connection.request("POST", path, body, {"content-type": "text/plain"})
            answer = connection.getresponse()
            status, refused = answer.status, json.loads(answer.read())
        finally:
            connection.close()
        assert status == 400
        assert refused == {
            "object": "error",
            "message": f"{exc} {exc.errors()}",  # as FastAPI itself writes them
            "type": "Bad Request",
            "param": None,
            "code": 400,
        }


def test_the_model_list_is_sglangs_model_cards(sim: SimProcess) -> None:
    """SGLang's ``ModelCard``: no permission list, owned by ``sglang``."""
    card = sim.call("GET", "/v1/models")[1]["data"][0]
    assert list(card) == ["id", "object", "created", "owned_by", "root", "parent", "max_model_len"]
    assert (card["id"], card["owned_by"], card["max_model_len"]) == (MODEL, "sglang", 4096)
    assert card["created"] > 1_700_000_000


def raw_call(sim: SimProcess, method: str, path: str) -> tuple[int, dict[str, str], bytes]:
    host = sim.url.removeprefix("http://")
    connection = http.client.HTTPConnection(host, timeout=30)
    try:
        connection.request(method, path)
        answer = connection.getresponse()
        return answer.status, {k.lower(): v for k, v in answer.getheaders()}, answer.read()
    finally:
        connection.close()


def test_flush_cache_is_sglangs_on_get_and_post_and_refused_while_a_request_runs(
    sim: SimProcess,
) -> None:
    """SGLang's ``/flush_cache``: GET or POST, one plain text without a content type,
    400 with the same text when requests are running (and nothing flushed); vLLM's
    ``/reset_prefix_cache`` is not SGLang's."""
    text = (
        b"Cache flushed.\nPlease check backend logs for more details. "
        b"(When there are running or waiting requests, the operation will not be performed.)\n"
    )
    for method in ("GET", "POST"):
        sim.post("/v1/completions", {"prompt": fresh(7_000, 64), "max_tokens": 1})
        assert sim.call("GET", "/sim/state")[1]["cached_block_hashes"]
        status, headers, body = raw_call(sim, method, "/flush_cache")
        assert (status, body, "content-type" in headers) == (200, text, False)
        assert sim.call("GET", "/sim/state")[1]["cached_block_hashes"] == []
    with streaming(sim, {"prompt": fresh(7_100, 8), "max_tokens": 40, "stream": True}):
        status, _, refused = raw_call(sim, "POST", "/flush_cache")
        assert (status, refused) == (400, text)
    assert sim.call("POST", "/reset_prefix_cache")[0] == 404


def test_one_models_card_is_served_as_sglang_serves_it(
    sim: SimProcess, client: openai.OpenAI
) -> None:
    """SGLang's ``GET /v1/models/{model:path}``: the listed card, or its 404 naming the
    model (the rest of the path, slashes and all; ``/v1/models/`` asks for '')."""
    assert client.models.retrieve(MODEL).owned_by == "sglang"
    status, card = sim.call("GET", f"/v1/models/{MODEL}")
    listed = sim.call("GET", "/v1/models")[1]["data"][0]
    assert status == 200 and {**card, "created": 0} == {**listed, "created": 0}
    with pytest.raises(openai.NotFoundError) as missing:
        client.models.retrieve("other-model")
    assert missing.value.body == {
        "message": "The model 'other-model' does not exist",
        "type": "invalid_request_error",
        "param": "model",
        "code": "model_not_found",
    }
    for path, name in (("/v1/models/org/model", "org/model"), ("/v1/models/", "")):
        status, answer = sim.call("GET", path)
        assert (status, answer["error"]["message"]) == (404, f"The model '{name}' does not exist")
    status, headers, _ = raw_call(sim, "POST", f"/v1/models/{MODEL}")
    assert (status, headers["allow"]) == (405, "GET")
