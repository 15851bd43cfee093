"""What a completion's ``prompt`` may hold, and vLLM's refusals of ``n``, temperature,
too many prompts and token ids out of the vocabulary."""

from __future__ import annotations

import pytest

from enginesim import protocol as p

MORE_N = "To increase this limit, set the VLLM_MAX_N_SEQUENCES environment variable."


def decode(raw: bytes) -> p.CompletionRequest | p.CompletionBatchRequest:
    return p.decode_completion(raw)


@pytest.mark.parametrize(
    ("raw", "prompts"),
    [
        (b'{"prompt": "one"}', ["one"]),
        (b'{"prompt": [1, 2, 3]}', [[1, 2, 3]]),
        (b'{"prompt": ["one", "two"]}', ["one", "two"]),
        (b'{"prompt": [[1, 2], [3]]}', [[1, 2], [3]]),
        (b'{"prompt": ["only"]}', ["only"]),
    ],
)
def test_a_batch_is_one_prompt_per_item_and_token_ids_are_one_prompt(raw, prompts) -> None:
    assert p.completion_prompts(decode(raw)) == prompts


def test_a_batch_mixing_texts_and_token_ids_is_a_400_on_prompt() -> None:
    with pytest.raises(p.BadRequest) as caught:
        p.completion_prompts(decode(b'{"prompt": ["one", [2]]}'))
    assert caught.value.param == "prompt" and caught.value.status == 400


@pytest.mark.parametrize(
    ("raw", "where"),
    [
        (b'{"prompt": [1, "two"]}', "got `str` - at `$.prompt[1]`"),  # as before batches
        (b'{"prompt": [[1], 2]}', "got `int` - at `$.prompt[1]`"),
        (b'{"prompt": [[1.5]]}', "got `float` - at `$.prompt[0][0]`"),
        (b'{"prompt": 7}', "got `int` - at `$.prompt`"),
    ],
)
def test_what_is_neither_text_nor_token_ids_fails_to_decode_where_it_is(raw, where) -> None:
    with pytest.raises(p.BadRequest, match="Invalid request") as caught:
        decode(raw)
    assert caught.value.message.endswith(where)


def test_n_defaults_to_one_and_null_means_one_in_chat_only() -> None:
    assert p.check_sampling(None, None) == 1
    chat = p.decode_body(b'{"messages": [], "n": null}', p.ChatRequest)
    assert chat.n is None
    with pytest.raises(p.BadRequest, match="Invalid request"):
        decode(b'{"prompt": "x", "n": null}')


@pytest.mark.parametrize(
    ("n", "temperature", "message", "param"),
    [
        (0, None, "n must be at least 1, got 0.", None),
        (16385, None, f"n must be at most 16384, got 16385. {MORE_N}", None),
        (0, 0.0, "n must be at least 1, got 0.", None),  # n is checked first
        (2, -1.0, "temperature must be non-negative, got -1.0.", "temperature"),
        (2, 2.5, "temperature must be in [0, 2], got 2.5.", "temperature"),
        (2, float("inf"), "temperature must be a finite number, got inf.", "temperature"),
        (2, 0.0, "n must be 1 when using greedy sampling, got 2.", None),
        (2, 1e-6, "n must be 1 when using greedy sampling, got 2.", None),
    ],
)
def test_vllms_sampling_refusals(n, temperature, message, param) -> None:
    with pytest.raises(p.BadRequest) as caught:
        p.check_sampling(n, temperature)
    assert (caught.value.message, caught.value.param) == (message, param)


@pytest.mark.parametrize(("n", "temperature"), [(1, 0.0), (2, None), (3, 0.7), (16384, 2.0)])
def test_what_vllm_accepts(n: int, temperature: float | None) -> None:
    assert p.check_sampling(n, temperature) == n


@pytest.mark.parametrize(
    ("raw", "prompts"),
    [
        (b'{"prompt": [1, -2]}', [[1, -2]]),
        (b'{"prompt": [[-1], [4294967296]]}', [[-1], [2**32]]),
        (b'{"prompt": [18446744073709551616]}', [[2**64]]),
    ],
)
def test_any_integer_decodes_as_a_token_id_for_the_engine_to_judge(raw, prompts) -> None:
    assert p.completion_prompts(decode(raw)) == prompts


@pytest.mark.parametrize(
    ("prompt", "message"),
    [
        ([5, -2, 40_000], "Token id -2 is out of vocabulary"),  # the lowest first, if < 0
        ([5, 32_000, 40_000], "Token id 40000 is out of vocabulary"),  # then the highest
        ([2**64], f"Token id {2**64} is out of vocabulary"),
    ],
)
def test_vllms_refusal_of_a_token_id_out_of_the_vocabulary(prompt, message) -> None:
    with pytest.raises(p.BadRequest) as caught:
        p.check_token_ids(prompt, 31_999)
    assert (caught.value.message, caught.value.param, caught.value.status) == (message, None, 400)
    assert isinstance(caught.value, p.EngineInputError)  # the engine's: an event in a stream


def test_the_vocabularys_edges_are_served() -> None:
    p.check_token_ids([0, 31_999], 31_999)


def test_vllm_refuses_more_than_1024_prompts_in_a_batch_and_not_1024_ids() -> None:
    at_most = decode(b'{"prompt": [' + b",".join([b'"x"'] * 1024) + b"]}")
    assert len(p.completion_prompts(at_most, p.MAX_COMPLETION_PROMPTS)) == 1024
    ids = decode(b'{"prompt": [' + b",".join([b"7"] * 2000) + b"]}")
    assert p.completion_prompts(ids, p.MAX_COMPLETION_PROMPTS) == [[7] * 2000]
    over = decode(b'{"prompt": [' + b",".join([b"[7]"] * 1025) + b"]}")
    with pytest.raises(p.RequestValidatorError) as caught:
        p.completion_prompts(over, p.MAX_COMPLETION_PROMPTS)
    assert caught.value.param == "prompt"
    assert caught.value.reason == (
        "prompt list length 1025 exceeds the maximum allowed count of 1024. To increase "
        "this limit, set the VLLM_MAX_COMPLETION_PROMPTS environment variable."
    )
    assert len(p.completion_prompts(over)) == 1025  # no bound given: SGLang's


def test_a_request_validators_refusal_is_worded_as_vllms_validation_handler_words_it() -> None:
    raw = b'{"model": "m", "prompt": [' + b",".join([b'"x"'] * 1025) + b'], "max_tokens": 1}'
    with pytest.raises(p.RequestValidatorError) as caught:
        p.completion_prompts(decode(raw), p.MAX_COMPLETION_PROMPTS)
    reason = (
        "prompt list length 1025 exceeds the maximum allowed count of 1024. To increase this "
        "limit, set the VLLM_MAX_COMPLETION_PROMPTS environment variable."
    )
    assert caught.value.with_body(raw).body() == {
        "error": {
            "message": "1 validation error:\n  {'type': 'value_error', 'loc': 'body', 'msg': "
            f"'Value error, {reason} (parameter=prompt)', 'input': '<dict of 3 items>', "
            f"'ctx': {{'error': VLLMValidationError('{reason}')}}}}",
            "type": "Bad Request",
            "param": "prompt",
            "code": 400,
        }
    }


def test_stream_options_without_stream_are_a_request_validators_refusal() -> None:
    raw = b'{"prompt": "x", "stream_options": {"include_usage": true}}'
    with pytest.raises(p.RequestValidatorError) as caught:
        p.stream_usage(decode(raw))
    message = caught.value.with_body(raw).message
    assert message.startswith("1 validation error:\n  {'type': 'value_error', 'loc': 'body', ")
    assert "'msg': 'Value error, Stream options can only be defined when `stream=True`. " in message
    assert message.endswith(
        "(parameter=stream_options)', 'input': '<dict of 2 items>', 'ctx': {'error': "
        "VLLMValidationError('Stream options can only be defined when `stream=True`.')}}"
    )
    assert caught.value.param == "stream_options" and caught.value.error_type == "Bad Request"
