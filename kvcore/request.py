"""An OpenAI-shaped request body, read the way engines read it, for routing.

The proxy and the admin API's explain endpoint must turn the same request into the same
token ids and session id, or an explanation would describe a different decision than the
one the proxy makes. Token ids follow vLLM: a chat request's ``messages`` are rendered
with the model's chat template (``add_generation_prompt`` true unless the body says
otherwise, ``tools`` passed to the template) and encoded without special tokens; a
completion's ``prompt`` text is encoded with them; a ``prompt`` of token ids is taken
as is. Errors are :class:`InvalidRequest` (a ``ValueError``) naming the field.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from kvcore.tokenize import Tokenizer
from kvcore.workload import SessionAffinityWorkload, Workload

MAX_TOKEN_ID = 2**32


class InvalidRequest(ValueError):
    """A request body that cannot be tokenized; ``field`` names the culprit."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


def prompt_token_ids(body: Mapping[str, Any], tokenizer: Tokenizer) -> list[int]:
    """The token ids the engine will compute for ``body`` (chat or completion)."""
    if "messages" in body:
        return _chat_tokens(body, tokenizer)
    if "prompt" in body:
        return _completion_tokens(body["prompt"], tokenizer)
    raise InvalidRequest("messages", "a request needs 'messages' (chat) or 'prompt'")


def _chat_tokens(body: Mapping[str, Any], tokenizer: Tokenizer) -> list[int]:
    messages = body["messages"]
    if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
        raise InvalidRequest("messages", "must be a list of message objects")
    tools = body.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise InvalidRequest("tools", "must be a list")
    generation = body.get("add_generation_prompt", True)
    if not isinstance(generation, bool):
        raise InvalidRequest("add_generation_prompt", "must be true or false")
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=generation, tools=tools)
    return tokenizer.encode(text, add_special_tokens=False)


def _completion_tokens(prompt: Any, tokenizer: Tokenizer) -> list[int]:
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return tokenizer.encode(prompt, add_special_tokens=True)
    if isinstance(prompt, list) and _are_token_ids(prompt):
        return list(prompt)
    raise InvalidRequest("prompt", "must be a string, a list of one string or token ids")


def _are_token_ids(values: Sequence[Any]) -> bool:
    return all(
        isinstance(v, int) and not isinstance(v, bool) and 0 <= v < MAX_TOKEN_ID for v in values
    )


def session_id(
    workload: Workload, headers: Mapping[str, str], body: Mapping[str, Any]
) -> str | None:
    """The session id a ``session_affinity`` workload keys on (header names lower-case)."""
    if not isinstance(workload, SessionAffinityWorkload):
        return None
    key = workload.session_key
    if key.startswith("body."):
        value = body.get(key.removeprefix("body."))
        return None if value is None else str(value)
    return headers.get(key)
