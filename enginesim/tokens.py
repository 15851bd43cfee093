"""Prompts to token ids the way the engines do it, and the filler the engine "generates".

Completion prompts are text (encoded with special tokens) or already token ids (vLLM
accepts a list of ints as ``prompt``); chat requests are rendered with the model's chat
template and encoded without special tokens, as vLLM does. The tokenizer is
``kvcore.tokenize``'s (``--tokenizer builtin`` or a model directory), so the proxy and
the engine agree on token ids exactly as they would with a real model.

``max_token_id`` is the highest prompt token id vLLM would serve with this tokenizer.

Generated text is deterministic filler: a cycle of short words, each of which the
tokenizer encodes as one token, so that the output's token ids and its text agree and a
later chat turn that quotes the answer tokenizes back to the same ids.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from kvcore.tokenize import HFTokenizer, Tokenizer, load_tokenizer

FILLER_WORDS = (
    " lorem", " ipsum", " dolor", " sit", " amet", " sed", " do", " tempor",
    " ut", " labore", " et", " magna", " aliqua", " enim", " ad", " minim",
)  # fmt: skip
_FALLBACK = ((1000, " x"),)


class PromptTokenizer:
    def __init__(self, spec: str) -> None:
        self.tokenizer: Tokenizer = load_tokenizer(spec)
        self.filler = _filler(self.tokenizer)
        self._text = dict(self.filler)
        self.max_token_id = _max_token_id(self.tokenizer)

    @property
    def filler_ids(self) -> list[int]:
        return [token for token, _ in self.filler]

    def encode_prompt(self, prompt: str, *, add_special_tokens: bool = True) -> list[int]:
        return self.tokenizer.encode(prompt, add_special_tokens=add_special_tokens)

    def encode_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = True,
    ) -> list[int]:
        text = self.tokenizer.apply_chat_template(
            messages, add_generation_prompt=add_generation_prompt, tools=tools
        )
        return self.tokenizer.encode(text, add_special_tokens=False)

    def text_of(self, token_ids: Sequence[int]) -> str:
        """The text of filler tokens (what the engine "generated")."""
        return "".join(self._text.get(t, "") for t in token_ids)


def _filler(tokenizer: Tokenizer) -> tuple[tuple[int, str], ...]:
    seen: dict[int, str] = {}
    for word in FILLER_WORDS:
        ids = tokenizer.encode(word, add_special_tokens=False)
        if len(ids) == 1 and ids[0] not in seen and ids[0] != tokenizer.eos_token_id:
            seen[ids[0]] = word
    return tuple(seen.items()) or _FALLBACK


def _max_token_id(tokenizer: Tokenizer) -> int:
    """The highest prompt token id vLLM serves (``renderers/base.py``,
    ``validate_token_ids``): the larger of the tokenizer's highest id (added tokens
    included) and the model's ``vocab_size`` - 1 (``config.json``, or its
    ``text_config``). The built-in tokenizer is its own model: ``vocab_size`` - 1."""
    if not isinstance(tokenizer, HFTokenizer):
        return int(getattr(tokenizer, "vocab_size", 2**32)) - 1
    highest = max(tokenizer.fast.get_vocab(with_added_tokens=True).values(), default=-1)
    return max(highest, _model_vocab_size(tokenizer.directory) - 1)


def _model_vocab_size(directory: Path) -> int:
    try:
        config = json.loads((directory / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return 0
    text = config.get("text_config") if isinstance(config, dict) else None
    for holder in (config, text):
        if isinstance(holder, dict) and isinstance(holder.get("vocab_size"), int):
            return int(holder["vocab_size"])
    return 0
