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


def fresh(start: int, length: int) -> list[int]:
    """Token ids no other test of this module sends."""
    return list(range(start, start + length))


def test_a_batch_of_prompts_with_two_samples_each_is_four_choices_in_order(
    client: openai.OpenAI,
) -> None:
    first, second = fresh(26_000, 40), fresh(27_000, 24)
    answer = client.completions.create(model=MODEL, prompt=[first, second], n=2, max_tokens=3)
    assert [c.index for c in answer.choices] == [0, 1, 2, 3]  # prompt i, sample j: i * 2 + j
    assert all(c.finish_reason == "length" and len(c.text.split()) == 3 for c in answer.choices)
    assert answer.usage is not None and answer.usage.prompt_tokens_details is not None
    # each prompt counted once, every choice's tokens; and, as vLLM, not a sum of cached
    # tokens but the last request's: the second prompt's second sample, which hits the one
    # full block its first sample allocated
    assert (answer.usage.prompt_tokens, answer.usage.completion_tokens) == (64, 12)
    assert answer.usage.total_tokens == 76
    assert answer.usage.prompt_tokens_details.cached_tokens == 16


def test_a_batch_of_texts_counts_what_each_text_alone_counts(client: openai.OpenAI) -> None:
    texts = ["Once upon a time there was", "A batch of two"]
    alone = [client.completions.create(model=MODEL, prompt=t, max_tokens=2) for t in texts]
    batch = client.completions.create(model=MODEL, prompt=texts, max_tokens=2)
    assert [c.text for c in batch.choices] == [a.choices[0].text for a in alone]
    assert batch.usage is not None and all(a.usage is not None for a in alone)
    assert batch.usage.prompt_tokens == sum(a.usage.prompt_tokens for a in alone if a.usage)


def test_a_streamed_batch_ends_each_choice_once_and_reports_the_first_outputs_cache(
    client: openai.OpenAI,
) -> None:
    first, second = fresh(28_000, 40), fresh(29_000, 24)
    stream = client.completions.create(
        model=MODEL, prompt=[first, second], n=2, max_tokens=3, stream=True,
        stream_options={"include_usage": True},
    )  # fmt: skip
    chunks = list(stream)
    texts: dict[int, str] = {}
    ends: dict[int, list[str]] = {}
    for chunk in chunks[:-1]:
        (choice,) = chunk.choices  # vLLM sends one choice per chunk
        texts[choice.index] = texts.get(choice.index, "") + choice.text
        if choice.finish_reason is not None:
            ends.setdefault(choice.index, []).append(choice.finish_reason)
    assert sorted(texts) == [0, 1, 2, 3] and all(len(t.split()) == 3 for t in texts.values())
    assert ends == {k: ["length"] for k in range(4)}
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and usage is not None
    assert (usage.prompt_tokens, usage.completion_tokens) == (64, 12)
    # streamed, vLLM reports the first output's count: the first prompt's first sample, cold
    assert usage.prompt_tokens_details is None  # vLLM reports no details for 0 cached


def test_chat_with_two_samples_shares_the_prompt(client: openai.OpenAI) -> None:
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Two ways?"}]
    one = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4)  # type: ignore[arg-type]
    two = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, n=2)  # type: ignore[arg-type]
    assert [c.index for c in two.choices] == [0, 1]
    assert all(c.message.content == one.choices[0].message.content for c in two.choices)
    assert one.usage is not None and two.usage is not None
    assert two.usage.prompt_tokens == one.usage.prompt_tokens  # once, not n times
    assert two.usage.completion_tokens == 8
    assert two.usage.prompt_tokens_details is not None
    assert two.usage.prompt_tokens_details.cached_tokens == (one.usage.prompt_tokens - 1) // 16 * 16


def test_a_chat_stream_with_two_samples_sends_a_role_per_choice_first(
    client: openai.OpenAI,
) -> None:
    messages = [{"role": "user", "content": "Stream two answers."}]
    chunks = list(
        client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=3, n=2, stream=True,  # type: ignore[arg-type]
            stream_options={"include_usage": True},
        )
    )  # fmt: skip
    roles = [(c.choices[0].index, c.choices[0].delta.role) for c in chunks[:2]]
    assert roles == [(0, "assistant"), (1, "assistant")]
    content: dict[int, str] = {0: "", 1: ""}
    finished = []
    for chunk in chunks[2:-1]:
        (choice,) = chunk.choices
        content[choice.index] += choice.delta.content or ""
        if choice.finish_reason:
            finished.append((choice.index, choice.finish_reason))
    assert all(len(text.split()) == 3 for text in content.values())
    assert sorted(finished) == [(0, "length"), (1, "length")]
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 6


def test_two_greedy_samples_are_refused_as_vllm_refuses_them(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError, match="n must be 1 when using greedy sampling"):
        client.completions.create(model=MODEL, prompt="x", n=2, temperature=0, max_tokens=1)
    with pytest.raises(openai.BadRequestError, match="n must be at least 1"):
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "x"}], n=0, max_tokens=1
        )


def test_more_than_1024_prompts_and_ids_out_of_the_vocabulary_are_vllms_400s(
    client: openai.OpenAI,
) -> None:
    with pytest.raises(openai.BadRequestError, match="prompt list length 1025 exceeds") as caught:
        client.completions.create(model=MODEL, prompt=["x"] * 1025, max_tokens=1)
    assert "VLLM_MAX_COMPLETION_PROMPTS" in str(caught.value)
    assert (
        len(client.completions.create(model=MODEL, prompt=["x"] * 1024, max_tokens=1).choices)
        == 1024
    )
    for prompt, bad in (([5, 32_000], 32_000), ([[5], [-3, 9]], -3), ([2**32], 2**32)):
        with pytest.raises(openai.BadRequestError, match=f"Token id {bad} is out of vocabulary"):
            client.completions.create(model=MODEL, prompt=prompt, max_tokens=1)  # type: ignore[arg-type]
    edge = client.completions.create(model=MODEL, prompt=[0, 31_999], max_tokens=1)
    assert edge.usage is not None and edge.usage.prompt_tokens == 2


def test_a_stream_carries_vllms_refusal_of_a_token_id_to_the_client(
    client: openai.OpenAI,
) -> None:
    stream = client.completions.create(model=MODEL, prompt=[5, 32_000], max_tokens=1, stream=True)
    with pytest.raises(openai.APIError, match="Token id 32000 is out of vocabulary"):
        list(stream)
