"""kvroute-sim streams in modelled time: a model's own tokenizer, client disconnects, and
an engine restart in the middle of a stream."""

from __future__ import annotations

import http.client
import json
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from bench.micro.model_files import write_tiny_model
from kvcore.tokenize import load_tokenizer
from tests.unit.enginesim.simproc import SimProcess

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def slow_sim() -> Iterator[SimProcess]:
    # 10 ms per output token: a 1,000-token answer streams for about 10 s
    with SimProcess("--time-scale=1", "--num-blocks=512") as sim:
        yield sim


def open_stream(sim: SimProcess, body: dict) -> tuple[http.client.HTTPConnection, object]:
    host, port = sim.url.removeprefix("http://").rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    conn.request("POST", "/v1/completions", json.dumps(body),
                 {"content-type": "application/json"})  # fmt: skip
    response = conn.getresponse()
    assert response.status == 200
    return conn, response


def read_event(response) -> str:
    line = b""
    while not line.startswith(b"data: "):
        line = response.readline()
        assert line, "stream ended early"
    return line[6:].strip().decode()


def wait_for_state(sim: SimProcess, ok, timeout: float = 10.0) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        state = sim.call("GET", "/sim/state")[1]
        if ok(state):
            return state
    raise AssertionError(f"state never reached: {state}")


def test_a_disconnected_stream_is_aborted_and_frees_its_blocks(slow_sim: SimProcess) -> None:
    conn, response = open_stream(
        slow_sim, {"prompt": list(range(64)), "max_tokens": 1000, "stream": True}
    )
    json.loads(read_event(response))
    assert slow_sim.call("GET", "/sim/state")[1]["running"] == 1
    conn.close()
    state = wait_for_state(slow_sim, lambda s: s["running"] == 0)
    assert state["num_free_blocks"] == state["usable_blocks"] == state["num_blocks"] - 1
    # the prompt's blocks stay cached for the next request
    assert len(state["cached_block_hashes"]) >= 4


def test_two_samples_stream_side_by_side_and_a_disconnect_aborts_both(
    slow_sim: SimProcess,
) -> None:
    conn, response = open_stream(
        slow_sim, {"prompt": list(range(700, 764)), "max_tokens": 1000, "n": 2, "stream": True}
    )
    first = [json.loads(read_event(response))["choices"] for _ in range(6)]
    assert all(len(choices) == 1 for choices in first)  # one choice per event, as vLLM
    assert {choices[0]["index"] for choices in first} == {0, 1}  # step by step, not one then 1
    assert slow_sim.call("GET", "/sim/state")[1]["running"] == 2
    conn.close()
    state = wait_for_state(slow_sim, lambda s: s["running"] == 0)
    assert state["num_free_blocks"] == state["usable_blocks"] == state["num_blocks"] - 1


def test_an_engine_restart_ends_running_streams_with_an_error(slow_sim: SimProcess) -> None:
    conn, response = open_stream(
        slow_sim, {"prompt": list(range(500, 600)), "max_tokens": 1000, "stream": True}
    )
    json.loads(read_event(response))
    slow_sim.post("/sim/faults", {"restart": True})
    rest = []
    while (event := read_event(response)) != "[DONE]":
        rest.append(json.loads(event))
    conn.close()
    assert "error" in rest[-1] and "restart" in rest[-1]["error"]["message"]
    assert wait_for_state(slow_sim, lambda s: s["running"] == 0)["cached_block_hashes"] == []


def test_a_model_tokenizer_directory_is_used_for_chat(tmp_path: Path) -> None:
    model_dir = write_tiny_model(tmp_path / "tiny")
    tokenizer = load_tokenizer(str(model_dir))
    messages = [{"role": "user", "content": "the cat sat on the mat"}]
    expected = tokenizer.encode(tokenizer.apply_chat_template(messages), add_special_tokens=False)
    with SimProcess("--instant", f"--tokenizer={model_dir}") as sim:
        answer = sim.post("/v1/chat/completions", {"messages": messages, "max_tokens": 2})
        assert answer["usage"]["prompt_tokens"] == len(expected)
        assert sim.post("/tokenize", {"messages": messages})["tokens"] == expected
        assert sim.call("GET", "/model_info")[1]["model_path"] == str(model_dir)


def test_a_missing_tokenizer_directory_is_refused_at_start(tmp_path: Path) -> None:
    sim = SimProcess(f"--tokenizer={tmp_path / 'nothing'}")
    with pytest.raises(RuntimeError, match=r"exit 2\).*tokenizer"):
        sim.__enter__()


def test_a_chat_stream_begins_with_the_first_token_as_vllm_does() -> None:
    """vLLM and SGLang send a chat stream's role event with the first output, after the
    prompt's prefill; a proxy reads that first event as the first token (its prefill
    books settle then). Modelled prefill here: the prompt's tokens at 2,000 per second."""
    body = {
        "messages": [{"role": "user", "content": "tell me more about caches " * 200}],
        "max_tokens": 2,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    with SimProcess("--prefill-rate=2000", "--prefill-overhead-ms=0") as sim:
        host, port = sim.url.removeprefix("http://").rsplit(":", 1)
        conn = http.client.HTTPConnection(host, int(port), timeout=30)
        started = time.monotonic()
        conn.request("POST", "/v1/chat/completions", json.dumps(body),
                     {"content-type": "application/json"})  # fmt: skip
        response = conn.getresponse()
        first = json.loads(read_event(response))
        first_at = time.monotonic() - started
        events = [first]
        while (event := read_event(response)) != "[DONE]":
            events.append(json.loads(event))
        conn.close()
    assert first["choices"][0]["delta"]["role"] == "assistant"
    prompt_tokens = events[-1]["usage"]["prompt_tokens"]
    assert prompt_tokens > 800
    assert first_at >= prompt_tokens / 2000
