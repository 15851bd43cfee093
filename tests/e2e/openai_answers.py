"""What the official ``openai`` client gets from one base URL, for comparing the proxy's
answers with a replica's own: chat and completions, streamed and not."""

from __future__ import annotations

from typing import Any

import openai


def client_of(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)


def openai_answers(url: str, model: str, system: str) -> tuple[Any, ...]:
    """Content, chunks (without the fields that differ between two runs) and models."""
    messages = [{"role": "system", "content": system}, {"role": "user", "content": "Hi?"}]
    with client_of(url) as client:
        chat = client.chat.completions.create(model=model, messages=messages, max_tokens=5)  # type: ignore[arg-type]
        completion = client.completions.create(model=model, prompt="Once upon", max_tokens=4)
        chunks = client.chat.completions.create(
            model=model,
            messages=messages,
            max_tokens=6,
            stream=True,  # type: ignore[arg-type]
        )
        streamed = [c.model_dump(exclude={"id", "created"}) for c in chunks]
        with_usage = client.completions.create(
            model=model, prompt="Once", max_tokens=3, stream=True,
            stream_options={"include_usage": True},
        )  # fmt: skip
        usage_chunks = [c.model_dump(exclude={"id", "created", "usage"}) for c in with_usage]
        models = sorted(m.id for m in client.models.list())
    return (chat.choices[0].message.content, completion.choices[0].text, streamed,
            usage_chunks, models)  # fmt: skip
