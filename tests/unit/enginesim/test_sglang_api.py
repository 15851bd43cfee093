"""SGLang mode's answers: usage sums, ids, chunk shapes and order, errors and checks, as
SGLang 0.5.23's OpenAI server gives them (facts in ``enginesim/sglang_api.py``)."""

from __future__ import annotations

import asyncio
import json

import msgspec
import pytest

from enginesim import protocol as p
from enginesim import sglang_api as sg
from enginesim.choices import Choices
from enginesim.engine import RequestHandle
from enginesim.request import SimRequest


def group(prompts: list[list[int]], n: int, cached: list[int], outputs: int = 2) -> Choices:
    progress = asyncio.Event()
    handles = []
    for k, cached_tokens in enumerate(cached):
        req = SimRequest(f"rid{k}", prompts[k // max(n, 1)], outputs)
        req.num_cached_tokens = cached_tokens
        handles.append(RequestHandle(req, True, 0.0, progress=progress))
    return Choices("rid0", handles, max(n, 1))


def text_of(tokens: list[int]) -> str:
    return "".join(f" w{t}" for t in tokens)


def finish(choices: Choices) -> None:
    for handle in choices.handles:
        handle.req.output.extend([7] * handle.req.max_tokens)


def test_usage_sums_each_prompts_first_sample_cached_tokens_too() -> None:
    choices = group([[1] * 40, [2] * 24], n=2, cached=[32, 32, 16, 16])
    finish(choices)
    for streamed in (False, True):
        assert sg.usage(choices, 2, streamed=streamed) == {
            "prompt_tokens": 64,
            "total_tokens": 72,
            "completion_tokens": 8,
            "prompt_tokens_details": {"cached_tokens": 48},
            "reasoning_tokens": 0,
            "completion_tokens_details": None,
        }


def test_n_below_one_trips_sglangs_sums() -> None:
    choices = group([[1] * 40], n=0, cached=[32])
    finish(choices)
    with pytest.raises(p.BadRequest) as caught:  # range(0, 1, 0)
        sg.usage(choices, 0, streamed=False)
    assert sg.error_body(caught.value) == {
        "object": "error",
        "message": "range() arg 3 must not be zero",
        "type": "BadRequest",
        "param": None,
        "code": 400,
    }
    with pytest.raises(ZeroDivisionError):  # index % 0
        sg.usage(choices, 0, streamed=True)
    whole = sg.usage(choices, -1, streamed=False)  # range(0, 1, -1) is empty
    assert (whole["prompt_tokens"], whole["completion_tokens"]) == (0, 2)
    assert whole["prompt_tokens_details"] is None  # 0 cached: SGLang reports no details
    assert sg.usage(choices, -1, streamed=True)["prompt_tokens"] == 40  # 0 % -1 == 0


def test_a_whole_answer_carries_the_first_requests_id_and_its_weight_version() -> None:
    choices = group([[1] * 40], n=2, cached=[32, 32], outputs=3)
    finish(choices)
    body = sg.completion_body(choices, 2, "m", text_of)
    assert body["id"] == "rid0" and list(body) == [
        "id", "object", "created", "model", "choices", "usage", "metadata",
    ]  # fmt: skip
    assert body["choices"][1] == {
        "index": 1,
        "text": " w7 w7 w7",
        "logprobs": None,
        "finish_reason": "length",
        "matched_stop": None,
    }
    assert body["metadata"] == {
        "weight_version": "default",
        "weight_versions": [{"version": "default", "start": 0, "end": 3}],
    }
    chat = sg.chat_body(choices, 2, "m", text_of)
    assert chat["object"] == "chat.completion"
    assert chat["choices"][0]["message"] == {
        "role": "assistant",
        "content": " w7 w7 w7",
        "reasoning_content": None,
    }
    assert "stop_reason" not in chat["choices"][0]


def emit(choices: Choices, k: int, *tokens: int) -> None:
    choices.handles[k].req.output.extend(tokens)
    choices.handles[k].notify()


def events(chunks: list[bytes]) -> list[dict | str]:
    out: list[dict | str] = []
    for chunk in chunks:
        assert chunk.startswith(b"data: ") and chunk.endswith(b"\n\n")
        text = chunk[6:-2].decode()
        out.append(text if text == "[DONE]" else json.loads(text))
    return out


async def collect(stream, feed) -> list[dict | str]:
    task = asyncio.ensure_future(_drain(stream))
    await feed()
    return events(await task)


async def _drain(stream) -> list[bytes]:
    return [chunk async for chunk in stream]


async def test_a_completion_stream_sends_each_choice_under_its_own_id() -> None:
    choices = group([[1] * 20], n=2, cached=[16, 16])

    async def feed() -> None:
        emit(choices, 1, 5)
        await asyncio.sleep(0)
        emit(choices, 0, 5, 6)
        emit(choices, 1, 6)

    stream = sg.completion_chunks(choices, 2, "m", text_of, p.UsageAsked(True, False))
    got = await collect(stream, feed)
    assert got[-1] == "[DONE]"
    texts = [(e["id"], e["choices"][0]["index"], e["choices"][0]["text"],
              e["choices"][0]["finish_reason"]) for e in got[:-2]]  # fmt: skip
    assert texts == [
        ("rid1", 1, " w5", None),
        ("rid0", 0, " w5", None),
        ("rid0", 0, " w6", "length"),
        ("rid1", 1, " w6", "length"),
    ]
    assert all(e["usage"] is None and "matched_stop" in e["choices"][0] for e in got[:-2])
    usage = got[-2]
    assert usage["id"] == "rid1" and usage["choices"] == []  # the last output's id
    assert usage["usage"] == {  # dumped without nulls
        "prompt_tokens": 20,
        "total_tokens": 24,
        "completion_tokens": 4,
        "prompt_tokens_details": {"cached_tokens": 16},
        "reasoning_tokens": 0,
    }


async def test_a_chat_stream_sends_a_role_with_each_choices_first_output_and_ends_after() -> None:
    choices = group([[1] * 20], n=2, cached=[16, 16])

    async def feed() -> None:
        emit(choices, 1, 5)
        await asyncio.sleep(0)
        emit(choices, 1, 6)
        await asyncio.sleep(0)
        emit(choices, 0, 5, 6)

    stream = sg.chat_chunks(choices, 2, "m", text_of, p.NO_USAGE)
    got = await collect(stream, feed)
    shown = [(e["id"], e["choices"][0]["index"], e["choices"][0]["delta"],
              e["choices"][0]["finish_reason"]) for e in got[:-1]]  # fmt: skip
    nothing = {"reasoning_content": None}
    assert shown == [
        ("rid1", 1, {**nothing, "role": "assistant", "content": ""}, None),
        ("rid1", 1, {**nothing, "content": " w5"}, None),
        ("rid1", 1, {**nothing, "content": " w6"}, None),
        ("rid0", 0, {**nothing, "role": "assistant", "content": ""}, None),
        ("rid0", 0, {**nothing, "content": " w5"}, None),
        ("rid0", 0, {**nothing, "content": " w6"}, None),
        ("rid0", 1, nothing, "length"),  # in the order they finished, the last id
        ("rid0", 0, nothing, "length"),
    ]
    assert all("usage" not in e and e["choices"][0]["matched_stop"] is None for e in got[:-1])
    assert got[-1] == "[DONE]"


async def test_an_engine_failure_mid_stream_is_an_error_event_in_sglangs_shape() -> None:
    choices = group([[1] * 20], n=1, cached=[0])
    choices.handles[0].error = "engine restarted"

    async def feed() -> None:
        choices.handles[0].notify()

    got = await collect(
        sg.completion_chunks(choices, 1, "m", text_of, p.UsageAsked(True, False)), feed
    )
    assert got == [
        {
            "error": {
                "object": "error",
                "message": "engine restarted",
                "type": "InternalServerError",
                "param": None,
                "code": 500,
            }
        },
        "[DONE]",
    ]


@pytest.mark.parametrize(
    ("options", "stream", "final", "continuous"),
    [
        (None, True, False, False),
        ({}, True, False, False),  # include_usage defaults to false in SGLang
        ({"include_usage": None}, True, False, False),
        ({"include_usage": True}, True, True, False),
        ({"include_usage": True}, False, True, False),  # nothing ties it to stream
        ({"continuous_usage_stats": True}, True, False, True),  # read on its own
        ({"include_usage": False, "continuous_usage_stats": True}, True, False, True),
        ({"include_usage": True, "continuous_usage_stats": None}, True, True, False),
    ],
)
def test_sglang_asks_for_a_usage_chunk_only_with_include_usage_true(
    options, stream, final, continuous
) -> None:
    raw = msgspec.json.encode({"prompt": "x", "stream": stream, "stream_options": options})
    assert sg.stream_usage(p.decode_completion(raw)) == (final, continuous)


def test_stream_options_of_the_wrong_type_do_not_validate() -> None:
    body = p.decode_completion(b'{"prompt": "x", "stream_options": {"include_usage": 3}}')
    with pytest.raises(p.BadRequest) as caught:
        sg.stream_usage(body)
    assert sg.error_body(caught.value)["type"] == "Bad Request"
    assert "`$.stream_options.include_usage`" in caught.value.message


@pytest.mark.parametrize("prompt", ["", [], [0], ["", ""], [[], []]])
def test_sglang_refuses_a_prompt_whose_items_are_all_empty(prompt) -> None:
    with pytest.raises(p.BadRequest) as caught:
        sg.check_prompt(prompt)
    assert sg.error_body(caught.value) == {
        "object": "error",
        "message": "Prompt cannot be empty",
        "type": "BadRequestError",
        "param": None,
        "code": 400,
    }


@pytest.mark.parametrize("prompt", [" ", [0, 1], ["a", ""], [[], [1]]])
def test_sglang_takes_a_prompt_with_anything_in_it(prompt) -> None:
    sg.check_prompt(prompt)


def test_sglangs_length_refusals() -> None:
    with pytest.raises(p.BadRequest, match=r"^The input \(100 tokens\) is longer than the "
                       r"model's context length \(100 tokens\)\.$"):  # fmt: skip
        sg.check_length(100, None, 100)
    with pytest.raises(p.BadRequest) as caught:
        sg.check_length(90, 11, 100)
    assert caught.value.message == (
        "Requested token count exceeds the model's maximum context length of 100 tokens. "
        "You requested a total of 101 tokens: 90 tokens from the input messages and 11 "
        "tokens for the completion. Please reduce the number of tokens in the input "
        "messages or the completion to fit within the limit."
    )
    sg.check_length(90, 10, 100)
    sg.check_length(99, None, 100)  # a chat without max_tokens: only the input counts


def test_sglang_checks_only_the_temperatures_sign_and_finiteness() -> None:
    for bad in (-0.5, float("inf"), float("nan")):
        with pytest.raises(p.BadRequest, match="temperature must be a non-negative finite"):
            sg.check_temperature(bad)
    for fine in (None, 0.0, 2.5):
        sg.check_temperature(fine)
    with pytest.raises(p.BadRequest, match=r"got `null` - at `\$.n`"):
        sg.check_n(None)
    assert sg.check_n(0) == 0


def test_token_ids_are_refused_only_where_the_simulator_cannot_hash_them() -> None:
    sg.check_token_ids([0, 50_000, 2**32 - 1])  # SGLang has no vocabulary check
    for bad in ([-1], [2**32]):
        with pytest.raises(p.BadRequest, match=f"Token id {bad[0]} cannot be served"):
            sg.check_token_ids(bad)


def test_request_ids_are_uuid4_hex() -> None:
    rid = sg.request_id()
    assert len(rid) == 32 and int(rid, 16) >= 0 and rid != sg.request_id()


async def test_n_zero_fails_a_completion_streams_usage_and_breaks_a_chat_stream() -> None:
    for chunks, broken in ((sg.completion_chunks, False), (sg.chat_chunks, True)):
        choices = group([[1] * 20], n=0, cached=[0], outputs=1)

        async def feed(choices: Choices = choices) -> None:
            emit(choices, 0, 5)

        stream = chunks(choices, 0, "m", text_of, p.UsageAsked(True, False))
        if broken:
            with pytest.raises(sg.BrokenStream, match="integer modulo by zero"):
                await collect(stream, feed)
        else:
            got = await collect(stream, feed)
            assert got[-2] == json.loads(
                sg.stream_error("integer modulo by zero", "BadRequestError", 400)[6:]
            )
            assert got[-1] == "[DONE]"


@pytest.mark.parametrize(
    ("options", "where"),
    [
        (b"5", "Expected `object | null`, got `int` - at `$.stream_options`"),
        (b'{"include_usage": "yes"}', "Expected `bool | null`, got `str` - at "
         "`$.stream_options.include_usage`"),
    ],
)  # fmt: skip
def test_stream_options_of_a_wrong_type_name_where_they_are_wrong(
    options: bytes, where: str
) -> None:
    body = msgspec.json.decode(
        b'{"prompt": "x", "stream": true, "stream_options": %s}' % options, type=p.CompletionRequest
    )
    with pytest.raises(p.BadRequest) as caught:
        sg.stream_usage(body)
    assert caught.value.message == f"Invalid request: {where}"
    assert sg.error_body(caught.value)["type"] == "Bad Request"
