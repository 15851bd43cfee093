"""One OpenAI request's engine requests: choice order, vLLM's usage sums and its single
cached-token count, and streamed deltas."""

from __future__ import annotations

import asyncio

import pytest

from enginesim import protocol as p
from enginesim.choices import DISCONNECTED, Choices
from enginesim.engine import RequestHandle
from enginesim.request import SimRequest


def choices(prompts: list[list[int]], n: int, cached: list[int], max_tokens: int = 2) -> Choices:
    progress = asyncio.Event()
    handles = []
    for k, cached_tokens in enumerate(cached):
        req = SimRequest(f"r{k}", prompts[k // n], max_tokens)
        req.num_cached_tokens = cached_tokens
        handles.append(RequestHandle(req, True, 0.0, progress=progress))
    return Choices("cmpl-1", handles, n)


def text_of(tokens: list[int]) -> str:
    return "".join(f"<{t}>" for t in tokens)


def emit(group: Choices, k: int, *tokens: int) -> None:
    group.handles[k].req.output.extend(tokens)
    group.handles[k].notify()


def test_usage_counts_each_prompt_once_every_choice_and_the_last_requests_cache() -> None:
    group = choices([[1] * 40, [2] * 41], n=2, cached=[0, 32, 16, 32])
    for k in range(4):
        group.handles[k].req.output.extend([7, 8, 9])
    assert group.final_usage() == p.usage(81, 12, 32)
    assert group.texts(text_of) == ["<7><8><9>"] * 4


async def test_a_stream_reports_the_first_output_seens_cache_and_each_choices_end() -> None:
    group = choices([[1] * 40], n=2, cached=[48, 0])
    deltas = group.deltas(text_of)
    emit(group, 1, 5)  # the second sample's first token comes first
    assert await anext(deltas) == (1, ["<5>"], False)
    emit(group, 0, 5, 6)
    emit(group, 1, 6)
    assert [await anext(deltas), await anext(deltas)] == [
        (0, ["<5>", "<6>"], True),
        (1, ["<6>"], True),
    ]
    with pytest.raises(StopAsyncIteration):
        await anext(deltas)
    assert group.stream_usage() == p.usage(40, 4, 0)  # choice 1's count: its output came first
    assert group.final_usage() == p.usage(40, 4, 0)


async def test_an_engine_restart_yields_none_and_a_disconnect_just_ends() -> None:
    for error, want in (("engine restarted", [None]), (DISCONNECTED, [])):
        group = choices([[1] * 20], n=2, cached=[0, 0])
        for handle in group.handles:
            handle.error = error
        group.handles[0].notify()
        assert [d async for d in group.deltas(text_of)] == want
        with pytest.raises(p.InjectedFailure, match=error):
            await group.until_done()
