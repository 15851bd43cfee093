"""SGLang's native ``/generate`` through the proxy of a whole fleet (real NATS, etcd,
control plane, a sidecar beside each ``kvroute-sim --event-format sglang`` replica), as an
RL rollout or any SGLang client sends it: the answer is the replica's own, whole or
streamed; a prompt whose prefix one replica caches lands there, and the engine's
``meta_info.cached_tokens`` equal the router's prediction within 2%, for ``text`` and
for ``input_ids``; ``/generate`` and ``/v1/completions`` of one text share the cache."""

from __future__ import annotations

import http.client
import json
from collections.abc import Iterator
from contextlib import ExitStack
from typing import Any
from urllib.parse import urlsplit

import pytest

from tests.e2e.fullstack import FullStack, wait_for
from tests.e2e.test_fullstack import fidelity, matched_blocks
from tests.unit.enginesim.simproc import SimProcess

pytestmark = [pytest.mark.e2e, pytest.mark.integration]

MODEL = "sim-model"
SIM_ARGS = ("--instant", "--max-model-len=8192", "--event-format=sglang", f"--model={MODEL}")
ENV = {"KVROUTE_LOAD_INTERVAL_S": "0.2"}
RUBRIC = "Score the rollout on correctness, then on brevity, then on tone. " * 40
# varies between two runs of one request: ids, clocks
UNSTABLE = {"id", "e2e_latency", "response_sent_to_client_ts"}


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FullStack]:
    with ExitStack() as started:
        sims = [started.enter_context(SimProcess(*SIM_ARGS)) for _ in range(2)]
        fleet = started.enter_context(
            FullStack(sims, tmp_path_factory.mktemp("fleet"), ENV, engine_kind="sglang")
        )
        wait_for(lambda: fleet.readyz()["replicas"] == 2, "both replicas in the proxy")
        yield fleet


def generate(stack: FullStack, body: dict[str, Any]) -> tuple[dict[str, str], Any]:
    status, headers, answer = stack.request("/generate", body)
    assert status == 200, answer
    return headers, json.loads(answer)


def stable(answer: dict[str, Any]) -> dict[str, Any]:
    meta = {k: v for k, v in answer["meta_info"].items() if k not in UNSTABLE}
    return {**answer, "meta_info": meta}


def events(url: str, body: dict[str, Any]) -> tuple[str, list[Any]]:
    """A stream's content type and its events (``[DONE]`` as the string)."""
    parts = urlsplit(url)
    connection = http.client.HTTPConnection(parts.hostname or "", parts.port, timeout=30)
    try:
        connection.request("POST", "/generate", json.dumps(body), JSON)
        response = connection.getresponse()
        assert response.status == 200
        raw = response.read().decode()
    finally:
        connection.close()
    assert raw.endswith("data: [DONE]\n\n")
    data = [event.removeprefix("data: ") for event in raw.split("\n\n") if event]
    return response.getheader("content-type", ""), [
        d if d == "[DONE]" else json.loads(d) for d in data
    ]


JSON = {"content-type": "application/json"}


def test_an_answer_whole_or_streamed_is_the_replicas_own(stack: FullStack) -> None:
    body = {"text": "Roll out one step: ", "sampling_params": {"max_new_tokens": 5}}
    headers, via_proxy = generate(stack, body)
    replica = stack.engines[int(headers["x-kvroute-replica"].removeprefix("r"))]
    status, direct = replica.call("POST", "/generate", body)
    assert status == 200
    assert stable(via_proxy) == stable(direct)
    assert list(via_proxy["meta_info"]) == list(direct["meta_info"])  # SGLang's key order
    assert len(via_proxy["output_ids"]) == 5
    streamed = {**body, "stream": True}
    (kind, through), (direct_kind, straight) = (
        events(url, streamed) for url in (stack.proxy_url, replica.url)
    )
    assert kind == direct_kind == "text/event-stream; charset=utf-8"
    assert [e if e == "[DONE]" else stable(e) for e in through] == [
        e if e == "[DONE]" else stable(e) for e in straight
    ]
    assert through[-2]["text"] == via_proxy["text"] and len(through) == 6  # 5 outputs, DONE


def test_a_cached_prefix_draws_text_and_input_ids_as_the_engine_reports_them(
    stack: FullStack,
) -> None:
    first = {"text": RUBRIC + "Rollout 0.", "sampling_params": {"max_new_tokens": 2}}
    headers, _ = generate(stack, first)
    owner = headers["x-kvroute-replica"]
    sim = stack.engines[int(owner.removeprefix("r"))]

    def ask(question: str) -> dict[str, Any]:
        return {"text": RUBRIC + question, "sampling_params": {"max_new_tokens": 2}}

    # the engine's events reach the proxy through sidecar, NATS and control plane
    wait_for(lambda: matched_blocks(generate(stack, ask("Ready?"))[0]) > 0, "residency")
    counted_before = fidelity(stack)
    predicted = measured = 0
    for i in range(6):
        body = ask(f"Rollout {i + 1}: score it.")
        if i % 2:  # the same prompt as token ids, as RL frameworks send it
            status, tokens = sim.call("POST", "/tokenize", {"model": MODEL, "prompt": body["text"]})
            assert status == 200
            body = {"input_ids": tokens["tokens"], "sampling_params": body["sampling_params"]}
        headers, answer = generate(stack, body)
        assert headers["x-kvroute-replica"] == owner
        predicted += matched_blocks(headers) * 16
        measured += answer["meta_info"]["cached_tokens"]
    status, rubric = sim.call("POST", "/tokenize", {"model": MODEL, "prompt": RUBRIC})
    assert status == 200
    assert measured >= 6 * (len(rubric["tokens"]) // 16 * 16)  # the whole rubric's blocks
    assert abs(predicted - measured) <= 0.02 * measured
    counted = [
        after - before for after, before in zip(fidelity(stack), counted_before, strict=True)
    ]
    assert counted == [predicted, measured]  # what the proxy reports is what clients saw
    status, headers, answer = stack.request(
        "/v1/completions", {"model": MODEL, "prompt": RUBRIC + "As a completion.", "max_tokens": 2}
    )
    assert status == 200 and headers["x-kvroute-replica"] == owner
    assert json.loads(answer)["usage"]["prompt_tokens_details"]["cached_tokens"] >= (
        len(rubric["tokens"]) // 16 * 16
    )


def test_put_is_taken_as_sglang_takes_it_and_other_methods_told_which_are(
    stack: FullStack,
) -> None:
    body = {"text": "Roll out one step: ", "sampling_params": {"max_new_tokens": 3}}
    status, _, answer = stack.request("/generate", body, method="PUT")
    assert status == 200 and len(json.loads(answer)["output_ids"]) == 3
    status, headers, answer = stack.request("/generate", method="GET")
    assert (status, headers["allow"]) == (405, "POST, PUT")
    assert "use POST, PUT" in json.loads(answer)["error"]["message"]


def test_a_body_without_a_prompt_is_refused_in_openais_shape(stack: FullStack) -> None:
    status, _, answer = stack.request("/generate", {"sampling_params": {"max_new_tokens": 2}})
    assert status == 400
    error = json.loads(answer)["error"]
    assert error["param"] == "text" and "'text' or 'input_ids' is required" in error["message"]
