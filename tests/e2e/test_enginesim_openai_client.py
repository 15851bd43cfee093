"""kvroute-sim answers the official OpenAI Python client the way a vLLM server does.

Users point real clients at the fleet; the simulator must parse with them, streamed and
not, with vLLM's cache accounting and vLLM's error statuses.
"""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest

from tests.unit.enginesim.simproc import SimProcess

pytestmark = pytest.mark.e2e

MODEL = "sim-model"
SYSTEM = "You are a careful assistant who answers in one line. " * 120


@pytest.fixture(scope="module")
def client() -> Iterator[openai.OpenAI]:
    with (
        SimProcess("--instant", f"--model={MODEL}", "--max-model-len=4096") as sim,
        openai.OpenAI(base_url=f"{sim.url}/v1", api_key="unused", max_retries=0) as c,
    ):
        yield c


def chat(client: openai.OpenAI, question: str) -> openai.types.chat.ChatCompletion:
    return client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}],
        max_tokens=4,
    )


def test_the_model_list_names_the_served_model(client: openai.OpenAI) -> None:
    assert [m.id for m in client.models.list()] == [MODEL]


def test_a_second_chat_with_the_same_system_prompt_reports_it_cached(
    client: openai.OpenAI,
) -> None:
    first, second = chat(client, "What is a KV cache?"), chat(client, "And prefix caching?")
    assert first.usage is not None and second.usage is not None
    assert first.usage.completion_tokens == 4 and first.choices[0].message.content
    cached = second.usage.prompt_tokens_details
    assert cached is not None and cached.cached_tokens is not None
    # Whole 16-token blocks of the shared system prompt, and nothing of the new question.
    assert cached.cached_tokens % 16 == 0
    assert first.usage.prompt_tokens - 32 < cached.cached_tokens < second.usage.prompt_tokens


def test_a_stream_delivers_every_token_then_the_usage(client: openai.OpenAI) -> None:
    stream = client.completions.create(
        model=MODEL,
        prompt="Once upon a time",
        max_tokens=6,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 6
    assert len(text.split()) == 6
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


def test_bad_requests_raise_the_clients_own_errors_with_vllms_statuses(
    client: openai.OpenAI,
) -> None:
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.completions.create(model="no-such-model", prompt="x", max_tokens=1)
    with pytest.raises(openai.BadRequestError, match="maximum context length"):
        client.completions.create(model=MODEL, prompt="word " * 5000, max_tokens=1)
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.completions.create(model=MODEL, prompt="x", max_tokens=-1)
    assert chat(client, "still serving?").choices[0].message.content
