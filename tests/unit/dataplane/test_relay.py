"""Responses reach the client as the engine sent them, minus only the usage the proxy asked for."""

from __future__ import annotations

import json
from itertools import pairwise

from hypothesis import given, settings
from hypothesis import strategies as st

from dataplane.relay import SseRelay, usage_of

TOKEN = b'data: {"id":"c","choices":[{"index":0,"text":" x"}]}\n\n'
USAGE = (
    b'data: {"id":"c","choices":[],"usage":{"prompt_tokens":40,'
    b'"prompt_tokens_details":{"cached_tokens":32}}}\n\n'
)
DONE = b"data: [DONE]\n\n"
STREAM = TOKEN * 3 + USAGE + DONE


def relay(chunks: list[bytes], strip: bool) -> tuple[bytes, SseRelay]:
    r = SseRelay(strip_usage=strip)
    out = b"".join(r.feed(c) for c in chunks) + r.flush()
    return out, r


@settings(max_examples=60)
@given(cuts=st.lists(st.integers(0, len(STREAM)), max_size=8))
def test_however_the_stream_is_cut_the_client_gets_the_same_events(cuts: list[int]) -> None:
    bounds = [0, *sorted(cuts), len(STREAM)]
    chunks = [STREAM[a:b] for a, b in pairwise(bounds)]
    kept, r = relay(chunks, strip=False)
    stripped, s = relay(chunks, strip=True)
    assert kept == STREAM
    assert stripped == TOKEN * 3 + DONE
    assert r.usage is not None and s.usage is not None
    assert (s.usage.prompt_tokens, s.usage.cached_tokens) == (40, 32)


def test_complete_events_are_forwarded_at_once_and_a_partial_one_waits() -> None:
    r = SseRelay(strip_usage=True)
    assert r.feed(TOKEN + TOKEN[:10]) == TOKEN
    assert r.feed(TOKEN[10:]) == TOKEN
    assert r.feed(b'data: not json with "usage"\n\n') == b'data: not json with "usage"\n\n'
    assert r.usage is None


def test_usage_of_a_body_and_of_what_is_not_json() -> None:
    body = {"choices": [], "usage": {"prompt_tokens": 5, "prompt_tokens_details": None}}
    usage = usage_of(json.dumps(body).encode())
    assert usage is not None and (usage.prompt_tokens, usage.cached_tokens) == (5, None)
    assert usage_of(b"<html>") is None and usage_of(b'{"error": {}}') is None
    assert usage_of(b'{"usage": ' + b'{"a": ' * 20_000) is None  # past the parser's depth


def test_sglang_chunks_with_null_usage_pass_untouched_and_its_usage_chunk_is_read() -> None:
    # SGLang's completion chunks all carry "usage": null; only its last has the usage
    token = b'data: {"id":"c","choices":[{"index":0,"text":" \\"usage\\":{}"}],"usage":null}\n\n'
    spaced = b'data: {"id": "c", "choices": [{"index": 0, "text": " y"}], "usage": null}\n\n'
    stream = token + spaced + USAGE + DONE
    r = SseRelay(strip_usage=True)
    assert r.feed(token + spaced) == token + spaced
    assert r.usage is None
    assert r.feed(USAGE + DONE) == DONE
    assert r.usage is not None and (r.usage.prompt_tokens, r.usage.cached_tokens) == (40, 32)
    kept, k = relay([stream], strip=False)
    assert kept == stream and k.usage is not None and k.usage.cached_tokens == 32


def test_only_a_whole_answers_or_a_usage_chunks_usage_is_the_requests_final_one() -> None:
    """A chunk's usage so far (``continuous_usage_stats``) never says what was cached:
    only the usage chunk (no choices) or a whole answer's usage is final."""
    running = (
        b'data: {"id":"c","choices":[{"index":0,"text":" x"}],'
        b'"usage":{"prompt_tokens":40,"completion_tokens":1}}\n\n'
    )
    _, so_far = relay([running * 2 + DONE], strip=False)
    _, ended = relay([running * 2 + USAGE + DONE], strip=True)
    assert so_far.usage is not None and not so_far.usage.final
    assert ended.usage is not None and ended.usage.final and ended.usage.cached_tokens == 32
    whole = usage_of(b'{"choices":[],"usage":{"prompt_tokens":9,"prompt_tokens_details":null}}')
    assert whole is not None and whole.final and whole.cached_tokens is None
