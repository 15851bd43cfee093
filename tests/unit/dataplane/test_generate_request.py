"""SGLang's native ``/generate`` through the proxy: its prompt (``text`` or
``input_ids``) keyed as the engine computes it, so that it and a completion of the same
text land on the same cache blocks; its body forwarded as it came; the tokens it reports
in ``meta_info`` read from a whole answer and from a stream, whose bytes pass untouched."""

from __future__ import annotations

import json
from typing import Any

import pytest

from dataplane.http_errors import BadRequest
from dataplane.openai_request import parse_inference
from dataplane.relay import GenerateRelay, Usage, generate_usage_of
from kvcore.keys import chain_keys, root_key
from kvcore.request import later_prompts, prompt_token_ids
from kvcore.tokenize import BuiltinTokenizer
from tests.unit.dataplane.test_routing_prepare import LONG, _prepare, _router


def _generate(body: dict[str, Any]) -> Any:
    return parse_inference(json.dumps(body).encode(), "generate")


def test_text_is_keyed_as_the_same_completion_prompt_and_input_ids_as_given() -> None:
    router = _router(16, [])
    completion = _prepare(router, {"model": "m", "prompt": LONG}, "completion")
    # SGLang's body names no model: the proxy's default (its only one); "m" here
    text = _prepare(router, {"model": "m", "text": LONG, "sampling_params": {}}, "generate")
    assert text.block_keys == completion.block_keys and text.prompt_tokens > 16 * 4
    ids = prompt_token_ids({"prompt": LONG}, BuiltinTokenizer(), "completion")
    by_ids = _prepare(router, {"model": "m", "input_ids": ids}, "generate")
    assert by_ids.block_keys == completion.block_keys
    assert by_ids.block_keys == chain_keys(root_key(model="org/m"), ids, 16)
    batch = _prepare(router, {"model": "m", "text": [LONG, "a second prompt"]}, "generate")
    assert batch.block_keys == completion.block_keys  # a batch is routed by its first


def test_a_batchs_later_prompts_are_read_from_text_or_input_ids() -> None:
    texts = later_prompts({"text": ["first", "second", "third"]}, "generate")
    assert [p.text for p in texts] == ["second", "third"]  # type: ignore[union-attr]
    assert later_prompts({"input_ids": [[1, 2], [3, 4]], "text": None}, "generate") == [[3, 4]]
    assert later_prompts({"text": "one"}, "generate") == []


def test_a_generate_body_is_never_asked_for_usage_but_takes_a_tenants_salt() -> None:
    body = {"text": "Hi", "stream": True, "sampling_params": {"n": 2}}
    request = _generate(body)
    assert request.stream and not request.adds_usage
    assert request.upstream_body(include_usage=request.adds_usage, cache_salt=None) == request.raw
    salted = json.loads(request.upstream_body(include_usage=request.adds_usage, cache_salt="t2"))
    assert salted == {**body, "cache_salt": "t2"}  # SGLang's /generate reads it
    assert request.fans_out and not request.is_batch  # n samples, from sampling_params
    assert _generate({"input_ids": [[1, 2], [3]]}).is_batch
    assert not _generate({"input_ids": [1, 2, 3]}).fans_out


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"sampling_params": {}}, "text"),
        ({"text": None, "input_ids": None}, "text"),
        ({"text": 7}, "text"),
        ({"text": [1, 2]}, "text"),
        ({"text": []}, "text"),
        ({"input_ids": "1 2 3"}, "input_ids"),
        ({"input_ids": [1, -2]}, "input_ids"),
        ({"input_ids": [[1], []]}, "input_ids"),
        ({"input_ids": [True, 2]}, "input_ids"),
    ],
)
def test_a_generate_body_without_a_prompt_to_route_is_refused_naming_the_field(
    body: dict[str, Any], field: str
) -> None:
    with pytest.raises(BadRequest) as refused:
        _generate(body)
    assert refused.value.param == field


def test_the_tokens_a_whole_answer_reports_are_read_from_its_meta_info() -> None:
    answer = {
        "text": " and so", "output_ids": [5, 6],
        "meta_info": {"id": "a", "finish_reason": {"type": "length", "length": 2},
                      "prompt_tokens": 300, "completion_tokens": 2, "cached_tokens": 288},
    }  # fmt: skip
    assert generate_usage_of(json.dumps(answer).encode()) == Usage(300, 288)
    second = {**answer, "meta_info": {"prompt_tokens": 9, "cached_tokens": 0}}
    assert generate_usage_of(json.dumps([answer, second]).encode()) == Usage(300, 288)
    for other in (b'{"error": {"message": "no"}}', b"[]", b"not json", b'{"meta_info": 3}'):
        assert generate_usage_of(other) is None


def test_a_stream_passes_byte_for_byte_and_its_last_event_tells_the_tokens() -> None:
    meta = {"prompt_tokens": 40, "cached_tokens": 32}
    events = [
        {"text": "a", "meta_info": {**meta, "completion_tokens": 1}},
        {"text": "ab", "meta_info": {**meta, "completion_tokens": 2}},
    ]
    stream = b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events)
    stream += b"data: [DONE]\n\n"
    for size in (1, 7, 64, len(stream)):  # however the bytes arrive
        relay = GenerateRelay()
        pieces = [stream[i : i + size] for i in range(0, len(stream), size)]
        forwarded = b"".join(relay.feed(piece) for piece in pieces) + relay.flush()
        assert forwarded == stream
        assert relay.usage == Usage(40, 32)
    relay = GenerateRelay()
    relay.feed(b'data: {"error": {"message": "too long"}}\n\ndata: [DONE]\n\n')
    assert relay.usage is None
