"""LiteLLM's Router in front of ``kvroute up``, configured as docs/clients.md says:
``openai/<model>`` with ``api_base`` at the proxy.

What a LiteLLM user notices: chat completions whole, streamed and async; text
completions (``atext_completion``: the Router's synchronous ``text_completion`` fails
before sending in LiteLLM 1.110.2, its bug); the engines' cached tokens passed through in
``usage.prompt_tokens_details.cached_tokens``; kvroute's headers under LiteLLM's
``llm_provider-`` prefix; and kvroute's errors as LiteLLM's exception classes.
"""

from __future__ import annotations

import asyncio
from typing import Any

import litellm
import openai
import pytest
from fleet import MODEL, Fleet
from litellm import Router

SYSTEM = "You answer every question in one careful, short sentence. " * 40


def router_for(fleet: Fleet, model: str = MODEL) -> Router:
    deployment = {"model": f"openai/{model}", "api_base": fleet.base_url, "api_key": "none"}
    return Router(
        model_list=[{"model_name": "kvroute", "litellm_params": deployment}], num_retries=0
    )


def chat(question: str) -> list[dict[str, str]]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]


def test_cached_tokens_pass_through_whole_streamed_and_async(fleet: Fleet) -> None:
    router = router_for(fleet)
    router.completion(model="kvroute", messages=chat("First?"), max_tokens=2)  # caches SYSTEM
    whole = router.completion(model="kvroute", messages=chat("Second?"), max_tokens=2)
    direct = openai.OpenAI(base_url=fleet.base_url, api_key="none").chat.completions.create(
        model=MODEL,
        messages=chat("Second?"),
        max_tokens=2,  # type: ignore[arg-type]
    )
    cached = whole.usage.prompt_tokens_details.cached_tokens
    assert cached > len(SYSTEM.split())  # the system prompt, at least, was cached
    assert direct.usage is not None and direct.usage.prompt_tokens_details is not None
    assert cached == direct.usage.prompt_tokens_details.cached_tokens  # what the engine said
    assert whole.choices[0].message.content

    chunks = list(
        router.completion(
            model="kvroute",
            messages=chat("Second?"),
            max_tokens=3,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert len(text.split()) == 3
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == cached

    answer = asyncio.run(
        router.acompletion(model="kvroute", messages=chat("Second?"), max_tokens=2)
    )
    assert answer.usage.prompt_tokens_details.cached_tokens == cached


def test_text_completions_through_the_async_router(fleet: Fleet) -> None:
    router = router_for(fleet)
    answer = asyncio.run(router.atext_completion(model="kvroute", prompt="Hello", max_tokens=3))
    assert len(answer.choices[0].text.split()) == 3
    assert answer.usage.completion_tokens == 3


def test_kvroutes_headers_arrive_renamed(fleet: Fleet) -> None:
    answer = router_for(fleet).completion(model="kvroute", messages=chat("Where?"), max_tokens=1)
    headers = answer._hidden_params["additional_headers"]
    assert headers["llm_provider-x-kvroute-replica"] in {"r0", "r1"}
    assert "x-kvroute-replica" not in headers


@pytest.mark.parametrize(
    ("model", "extra", "error"),
    [
        ("no-such-model", {}, litellm.NotFoundError),
        (MODEL, {"temperature": -5}, litellm.BadRequestError),
        (
            MODEL,
            {"messages": [{"role": "user", "content": "word " * 40_000}]},
            litellm.ContextWindowExceededError,
        ),
    ],
    ids=["unknown-model", "bad-parameter", "over-the-context-length"],
)
def test_kvroutes_errors_are_litellms_exceptions(
    fleet: Fleet, model: str, extra: dict[str, Any], error: type[Exception]
) -> None:
    body: dict[str, Any] = {"messages": chat("Fail?"), "max_tokens": 2, **extra}
    with pytest.raises(error):
        router_for(fleet, model).completion(model="kvroute", **body)
