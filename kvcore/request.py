"""An OpenAI-shaped request body, read the way engines read it, for routing.

The proxy and the admin API's explain endpoint must turn the same request into the same
token ids, block keys and session id, or an explanation would describe a different
decision than the one the proxy makes: both call this module. Token ids follow vLLM: a
chat request's ``messages`` are rendered with the model's chat template
(``add_generation_prompt`` true unless the body says otherwise, ``tools`` passed to the
template) and encoded without special tokens; a completion's ``prompt`` text is encoded
with them; a ``prompt`` of token ids is taken as is. SGLang's native ``/generate``
(``kind="generate"``) carries its prompt in ``input_ids`` (token ids, taken as is) or else
``text`` (encoded with special tokens, as SGLang's tokenizer manager encodes it and as
its completions route does, so the two share cache blocks). A batch of prompts is routed
by its first; :func:`later_prompts` reads the others (what the proxy's prefill books
count).
Errors are :class:`InvalidRequest` (a ``ValueError``) naming the field, and the
tokenizer's :class:`~kvcore.tokenize.TokenizerError` for a chat its template refuses.
"""

from __future__ import annotations

from array import array
from collections.abc import Mapping, Sequence
from typing import Any, Literal, NamedTuple

from kvcore.keys import chain_keys
from kvcore.tokenize import Encoded, PrefixTokenCache, Tokenizer
from kvcore.workload import SessionAffinityWorkload, Workload

MAX_TOKEN_ID = 2**32
Kind = Literal["chat", "completion", "generate"]


class InvalidRequest(ValueError):
    """A request body that cannot be tokenized; ``field`` names the culprit."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


class PromptText(NamedTuple):
    """The text an engine encodes for a request, and whether it adds special tokens."""

    text: str
    add_special_tokens: bool


def prompt_input(
    body: Mapping[str, Any], tokenizer: Tokenizer, kind: Kind | None = None
) -> PromptText | list[int]:
    """What the engine tokenizes for ``body``: the rendered chat or the completion text,
    or the prompt's token ids. ``kind`` is the endpoint's; by default, a body with
    ``messages`` is a chat."""
    if kind == "chat" or (kind is None and "messages" in body):
        if "messages" not in body:
            raise InvalidRequest("messages", "a chat request needs 'messages'")
        return _chat_text(body, tokenizer)
    if kind == "generate":
        field, prompt = prompt_field(body, kind)
        return _completion_input(prompt, field)
    if "prompt" in body:
        return _completion_input(body["prompt"])
    raise InvalidRequest("messages", "a request needs 'messages' (chat) or 'prompt'")


def prompt_field(body: Mapping[str, Any], kind: Kind) -> tuple[str, Any]:
    """The field holding a completion's or ``/generate`` request's prompt (or batch of
    them), and its value (None when absent): a completion's ``prompt``; ``/generate``'s
    ``input_ids`` unless absent or null (SGLang reads them first), else its ``text``."""
    if kind == "generate":
        ids = body.get("input_ids")
        if ids is not None:
            return "input_ids", ids
        return "text", body.get("text")
    return "prompt", body.get("prompt")


def prompt_token_ids(
    body: Mapping[str, Any], tokenizer: Tokenizer, kind: Kind | None = None
) -> list[int]:
    """The token ids the engine will compute for ``body`` (chat or completion)."""
    prompt = prompt_input(body, tokenizer, kind)
    if isinstance(prompt, list):
        return prompt
    return tokenizer.encode(prompt.text, add_special_tokens=prompt.add_special_tokens)


def prompt_keys(
    body: Mapping[str, Any],
    cache: PrefixTokenCache,
    *,
    root: int,
    block_size: int,
    kind: Kind | None = None,
) -> Encoded:
    """The token ids of ``body`` and their block keys chained from ``root``, through
    ``cache`` (only what no recent prompt began with is tokenized and hashed)."""
    text = None if kind in (None, "chat") else prompt_field(body, kind)[1]
    if isinstance(text, str):  # the usual completion, without building its PromptText
        return cache.encode_keyed(text, add_special_tokens=True, root=root, block_size=block_size)
    return keyed(prompt_input(body, cache.tokenizer, kind), cache, root=root, block_size=block_size)


def keyed(
    prompt: PromptText | list[int], cache: PrefixTokenCache, *, root: int, block_size: int
) -> Encoded:
    """The token ids of one prompt and their block keys chained from ``root``."""
    if isinstance(prompt, list):
        tokens = array("I", prompt)
        return Encoded(tokens, chain_keys(root, tokens, block_size))
    return cache.encode_keyed(
        prompt.text,
        add_special_tokens=prompt.add_special_tokens,
        root=root,
        block_size=block_size,
    )


def later_prompts(
    body: Mapping[str, Any], kind: Kind = "completion"
) -> list[PromptText | list[int]]:
    """A completion batch's (or ``/generate`` batch's) prompts after the first (routing's
    subject), each as the engine encodes it; [] for anything but a batch. An element that
    is no prompt is left out: the engine refuses the whole batch for it."""
    batch = prompt_field(body, kind)[1]
    if not isinstance(batch, list) or len(batch) < 2 or not isinstance(batch[0], str | list):
        return []
    prompts: list[PromptText | list[int]] = []
    for prompt in batch[1:]:
        if isinstance(prompt, str):
            prompts.append(PromptText(prompt, add_special_tokens=True))
        elif isinstance(prompt, list) and prompt and _are_token_ids(prompt):
            prompts.append(list(prompt))
    return prompts


def _chat_text(body: Mapping[str, Any], tokenizer: Tokenizer) -> PromptText:
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
    return PromptText(text, add_special_tokens=False)


def _completion_input(prompt: Any, field: str = "prompt") -> PromptText | list[int]:
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # a batch: routed by its first prompt
    if isinstance(prompt, str):
        return PromptText(prompt, add_special_tokens=True)
    if isinstance(prompt, list) and prompt and _are_token_ids(prompt):
        return list(prompt)
    raise InvalidRequest(field, "must be a string, token ids, or a batch (a list) of either")


def _are_token_ids(values: Sequence[Any]) -> bool:
    """Integers (not booleans) in [0, 2**32), checked in C: ids are often thousands."""
    return set(map(type, values)) == {int} and min(values) >= 0 and max(values) < MAX_TOKEN_ID


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
