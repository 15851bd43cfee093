"""kvroute-sim in SGLang mode serves SGLang 0.5.23's native ``/generate`` (POST and PUT):
its body, its answers key for key (a batch's list, a stream's cumulative outputs), its
errors, and the same engine, cache and metrics as the OpenAI routes."""

from __future__ import annotations

import http.client
import itertools
import json
import re
from collections.abc import Iterator
from typing import Any

import pytest

from tests.unit.enginesim.simproc import SimProcess

pytestmark = pytest.mark.e2e

BLOCK = 16
HEX32 = re.compile(r"^[0-9a-f]{32}$")
# ``meta_info`` of a finished output with no logprobs, in SGLang's order
FINISHED_META = [
    "id", "finish_reason", "prompt_tokens", "weight_version", "num_retractions",
    "reasoning_tokens", "completion_tokens", "cached_tokens", "weight_versions",
    "cached_tokens_details", "dp_rank", "e2e_latency", "response_sent_to_client_ts",
]  # fmt: skip
RUNNING_META = [k for k in FINISHED_META if k not in ("weight_versions", "e2e_latency")]


@pytest.fixture(scope="module")
def sim() -> Iterator[SimProcess]:
    args = ("--instant", "--max-model-len=4096", f"--block-size={BLOCK}")
    with SimProcess(*args, "--event-format=sglang") as proc:
        yield proc


@pytest.fixture(scope="module")
def timed() -> Iterator[SimProcess]:
    """A simulator in modelled time (a tenth of it), so a stream sends a step at a time."""
    args = ("--time-scale=0.1", "--max-model-len=4096", f"--block-size={BLOCK}")
    with SimProcess(*args, "--event-format=sglang") as proc:
        yield proc


def generate(sim: SimProcess, body: dict[str, Any], method: str = "POST") -> Any:
    status, answer = sim.call(method, "/generate", body)
    assert status == 200, answer
    return answer


def raw(sim: SimProcess, method: str, path: str, body: Any) -> tuple[int, str, bytes]:
    """``(status, content type, body)`` of one request."""
    host = sim.url.removeprefix("http://")
    connection = http.client.HTTPConnection(host, timeout=30)
    try:
        headers = {"content-type": "application/json"}
        connection.request(method, path, json.dumps(body).encode(), headers)
        response = connection.getresponse()
        return response.status, response.getheader("content-type") or "", response.read()
    finally:
        connection.close()


def words(tag: str, count: int) -> str:
    """A text no other test of this module sends."""
    return " ".join(f"{tag}{i}" for i in range(count))


def tokens(sim: SimProcess, text: str) -> list[int]:
    return list(sim.post("/tokenize", {"prompt": text})["tokens"])


def hit(prompt_tokens: int) -> int:
    """What a prompt stored once hits again: its full blocks, short of its last token."""
    return (prompt_tokens - 1) // BLOCK * BLOCK


def test_a_whole_answer_is_sglangs_output_key_for_key(sim: SimProcess) -> None:
    text = words("shape", 30)
    status, content_type, body = raw(sim, "POST", "/generate", {
        "text": text, "sampling_params": {"max_new_tokens": 3, "temperature": 0},
    })  # fmt: skip
    assert (status, content_type) == (200, "application/json")
    answer = json.loads(body)
    assert list(answer) == ["text", "output_ids", "meta_info"]
    meta = answer["meta_info"]
    assert list(meta) == FINISHED_META
    assert HEX32.match(meta["id"])
    assert meta["finish_reason"] == {"type": "length", "length": 3}
    assert meta["prompt_tokens"] == len(tokens(sim, text))  # tokenized as /tokenize does
    assert (meta["completion_tokens"], len(answer["output_ids"])) == (3, 3)
    assert len(answer["text"].split()) == 3  # one filler word per token
    assert meta["weight_versions"] == [{"version": "default", "start": 0, "end": 3}]
    assert (meta["cached_tokens"], meta["cached_tokens_details"]) == (0, None)
    assert meta["e2e_latency"] >= 0 and meta["dp_rank"] is None


def test_without_max_new_tokens_sglangs_default_of_128_is_generated(sim: SimProcess) -> None:
    answer = generate(sim, {"input_ids": [5, 6, 7]}, method="PUT")  # PUT serves it too
    assert answer["meta_info"]["finish_reason"] == {"type": "length", "length": 128}
    assert len(answer["output_ids"]) == 128


def test_a_long_text_again_hits_its_blocks_as_does_the_completion_route(
    sim: SimProcess,
) -> None:
    text = words("cache", 200)
    body = {"text": text, "sampling_params": {"max_new_tokens": 2}}
    before = sim.metric("sglang:cached_tokens_total")
    first = generate(sim, body)["meta_info"]
    second = generate(sim, body)["meta_info"]
    prompt = first["prompt_tokens"]
    assert prompt > 4 * BLOCK and first["cached_tokens"] == 0
    assert second["cached_tokens"] == hit(prompt)
    assert second["cached_tokens_details"] == {"device": hit(prompt), "host": 0}
    completion = sim.post("/v1/completions", {"prompt": text, "max_tokens": 2})["usage"]
    assert completion["prompt_tokens"] == prompt  # the same tokens, so the same blocks
    assert completion["prompt_tokens_details"] == {"cached_tokens": hit(prompt)}
    assert sim.metric("sglang:cached_tokens_total") - before == 2 * hit(prompt)


def test_token_ids_and_the_text_they_encode_hit_each_others_blocks(sim: SimProcess) -> None:
    text, other = words("ids", 100), words("txt", 100)
    ids = tokens(sim, text)
    generate(sim, {"text": text, "sampling_params": {"max_new_tokens": 1}})
    by_ids = generate(sim, {"input_ids": ids, "sampling_params": {"max_new_tokens": 1}})
    assert by_ids["meta_info"]["cached_tokens"] == hit(len(ids))
    other_ids = tokens(sim, other)
    generate(sim, {"input_ids": other_ids, "sampling_params": {"max_new_tokens": 1}})
    by_text = generate(sim, {"text": other, "sampling_params": {"max_new_tokens": 1}})
    assert by_text["meta_info"]["cached_tokens"] == hit(len(other_ids))


def test_text_with_input_ids_is_served_with_the_ids_as_sglang_does(sim: SimProcess) -> None:
    answer = generate(sim, {"text": "ignored words here", "input_ids": [9, 8, 7, 6]})
    assert answer["meta_info"]["prompt_tokens"] == 4


def test_a_batch_answers_a_list_in_order_named_after_the_rid(sim: SimProcess) -> None:
    texts = [words("batch-a", 5), words("batch-b", 9)]
    body = {"text": texts, "rid": "job", "sampling_params": {"max_new_tokens": 2}}
    finished = sim.metric("sglang:e2e_request_latency_seconds_count")
    answers = generate(sim, body)
    assert sim.metric("sglang:e2e_request_latency_seconds_count") - finished == 2
    assert [a["meta_info"]["id"] for a in answers] == ["job_0", "job_1"]
    prompts = [len(tokens(sim, t)) for t in texts]
    assert [a["meta_info"]["prompt_tokens"] for a in answers] == prompts
    assert all(list(a["meta_info"]) == FINISHED_META for a in answers)
    assert generate(sim, {"text": []}) == []  # a batch of nothing runs nothing


def test_two_samples_follow_a_warm_up_and_both_hit_the_prompt(sim: SimProcess) -> None:
    prompt = list(range(20_000, 20_040))
    before = sim.metric("sglang:prompt_tokens_total")
    body = {"input_ids": prompt, "rid": "pair", "sampling_params": {"max_new_tokens": 2, "n": 2}}
    answers = generate(sim, body)
    assert isinstance(answers, list) and len(answers) == 2  # n > 1 makes it a batch
    ids = [a["meta_info"]["id"] for a in answers]
    assert all(HEX32.match(i) for i in ids) and ids[0] != ids[1]  # new uuids, not "pair_j"
    assert [a["meta_info"]["cached_tokens"] for a in answers] == [32, 32]
    assert sim.metric("sglang:prompt_tokens_total") - before == 3 * 40  # with the warm-up


def test_a_stream_sends_cumulative_outputs_then_done(timed: SimProcess) -> None:
    text = words("stream", 40)
    body = {"text": text, "stream": True, "sampling_params": {"max_new_tokens": 4}}
    status, content_type, raw_body = raw(timed, "POST", "/generate", body)
    assert (status, content_type) == (200, "text/event-stream; charset=utf-8")
    events = raw_body.decode().split("\n\n")
    assert events[-2:] == ["data: [DONE]", ""]
    outputs = [json.loads(e.removeprefix("data: ")) for e in events[:-2]]
    assert [len(o["output_ids"]) for o in outputs] == [1, 2, 3, 4]  # the whole so far
    for before, after in itertools.pairwise(outputs):
        assert after["output_ids"][: len(before["output_ids"])] == before["output_ids"]
        assert after["text"].startswith(before["text"])
    metas = [o["meta_info"] for o in outputs]
    assert [m["completion_tokens"] for m in metas] == [1, 2, 3, 4]
    assert [m["finish_reason"] for m in metas] == [
        None,
        None,
        None,
        {"type": "length", "length": 4},
    ]
    assert list(metas[0]) == RUNNING_META  # sent first: when it was sent
    assert [list(m) for m in metas[1:3]] == [RUNNING_META[:-1]] * 2
    assert list(metas[3]) == FINISHED_META[:-1]  # the last: spans and latency
    assert len({m["id"] for m in metas}) == 1 and "index" not in outputs[0]
    whole = timed.post("/generate", {**body, "stream": False})
    assert whole["text"] == outputs[-1]["text"]


def test_a_batch_stream_tags_each_output_with_its_index(timed: SimProcess) -> None:
    body = {"text": [words("left", 4), words("right", 6)], "stream": True,
            "sampling_params": {"max_new_tokens": 3}}  # fmt: skip
    events = timed.stream("/generate", body)
    assert events[-1] == "[DONE]"
    by_index: dict[int, list[int]] = {0: [], 1: []}
    for output in events[:-1]:
        assert list(output) == ["text", "output_ids", "meta_info", "index"]
        by_index[output["index"]].append(output["meta_info"]["completion_tokens"])
    assert by_index == {0: [1, 2, 3], 1: [1, 2, 3]}


ERRORS = [
    ({"sampling_params": {"max_new_tokens": 1}},
     "Either text, input_ids or input_embeds should be provided."),
    ({"input_embeds": [[0.5]]}, "input_embeds is provided while disable_radix_cache is False"),
    ({"input_ids": []}, "input_ids cannot be empty."),
    ({"text": ""}, "texts cannot be empty and tokenizer must be initialized"),
    ({"input_ids": [1] * 4096}, "The input (4096 tokens) is longer than the model's context"),
    ({"input_ids": [1] * 4000, "sampling_params": {"max_new_tokens": 200}},
     "Requested token count exceeds the model's maximum context length of 4096 tokens"),
    ({"text": "x", "sampling_params": {"temperature": -1}},
     "temperature must be a non-negative finite number, got -1.0."),
    ({"text": "x", "sampling_params": {"max_new_tokens": -1}},
     "max_new_tokens must be at least 0, got -1."),
    ({"text": ["a", "b"], "rid": ["only-one"]},
     "The specified rids length mismatch with the batch_size for batch processing."),
    ({"text": "x", "return_logprob": True}, "kvroute-sim does not simulate logprobs"),
]  # fmt: skip


@pytest.mark.parametrize(("body", "message"), ERRORS)
def test_sglangs_value_errors_are_400s_whole_and_error_events_streamed(
    sim: SimProcess, body: dict[str, Any], message: str
) -> None:
    status, answer = sim.call("POST", "/generate", body)
    assert status == 400
    assert list(answer) == ["error"] and list(answer["error"]) == ["message"]
    assert answer["error"]["message"].startswith(message)
    # streamed, the 200 is sent before SGLang reads the request: an event, then [DONE]
    events = sim.stream("/generate", {**body, "stream": True})
    assert events == [answer, "[DONE]"]


def test_a_body_that_does_not_validate_is_refused_in_the_openai_routes_shape(
    sim: SimProcess,
) -> None:
    for body in (b"{not json", b'{"text": 5}', b'{"input_ids": [1, "a"]}', b'{"stream": null}'):
        status, answer = sim.call("POST", "/generate", raw=body)
        assert status == 400, body
        assert set(answer) == {"object", "message", "type", "param", "code"}
        assert (answer["type"], answer["code"]) == ("Bad Request", 400)
    status, answer = sim.call("GET", "/generate")
    assert (status, answer) == (405, {"detail": "Method Not Allowed"})


def test_a_rid_in_use_is_refused_as_sglang_refuses_it(sim: SimProcess) -> None:
    status, answer = sim.call("POST", "/generate", {"text": ["a", "b"], "rid": ["r", "r"]})
    assert (status, answer) == (
        400, {"error": {"message": "Duplicate request IDs detected within the request: ['r']"}},
    )  # fmt: skip


def test_an_injected_failure_is_a_500_in_sglangs_http_exception_shape(sim: SimProcess) -> None:
    assert sim.call("POST", "/sim/faults", {"fail_requests": 1})[0] == 200
    status, answer = sim.call("POST", "/generate", {"text": "x", "stream": True})
    assert status == 500
    assert answer == {
        "object": "error", "message": "Injected failure (kvroute-sim fault).",
        "type": "500", "param": None, "code": 500,
    }  # fmt: skip
    assert generate(sim, {"text": "x"})["meta_info"]["completion_tokens"] == 128


def test_vllm_mode_has_no_generate_route() -> None:
    with SimProcess("--instant") as vllm:
        assert vllm.call("POST", "/generate", {"text": "x"}) == (404, {"detail": "Not Found"})
