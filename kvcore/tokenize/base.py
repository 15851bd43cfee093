"""What every tokenizer offers the router, and the errors tokenization raises.

The proxy and ``enginesim`` must turn a request into exactly the token ids the engine
will see, because block keys are computed from them. Engines tokenize chat requests in
two steps (render the model's chat template to text, then encode that text without
adding special tokens, as vLLM does for ``/v1/chat/completions``); completion prompts
are encoded with special tokens. The :class:`Tokenizer` protocol is that contract.

Errors::

    TokenizerError (ValueError)      files missing or invalid, unknown spec
     └── ChatTemplateError           a chat request the template cannot render
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol, runtime_checkable


class TokenizerError(ValueError):
    """A tokenizer cannot be loaded or cannot tokenize this input."""


class ChatTemplateError(TokenizerError):
    """The chat template refused or failed to render these messages (a client error)."""


@runtime_checkable
class Tokenizer(Protocol):
    """Turns prompts into the token ids an engine would compute for them."""

    name: str
    eos_token_id: int | None

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; special tokens (BOS...) only when asked."""
        ...

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> str:
        """The chat prompt as text, to be encoded with ``add_special_tokens=False``."""
        ...


@runtime_checkable
class SegmentableTokenizer(Tokenizer, Protocol):
    """A tokenizer that can be run piecewise between *safe cut points*.

    A cut point ``p`` of a text is a character offset where tokenization is local:
    tokenizing ``text[:p]`` and ``text[p:]`` (the latter with :meth:`encode_segments`'s
    ``at_start=False``) and concatenating gives exactly the tokens of ``text``, whatever
    follows ``p``. Whether ``p`` is a cut point may depend only on ``text[:p + 1]``.
    """

    def cut_points(self, text: str, min_gap: int) -> list[int]:
        """Cut points of ``text``, greedily from the start, at least ``min_gap`` apart."""
        ...

    def encode_segments(self, segments: list[str], *, at_start: bool) -> list[list[int]] | None:
        """Tokens of each segment (no special tokens), each following a cut point unless
        it is the first and ``at_start``; ``None`` when that cannot be done exactly."""
        ...

    def special_wrap(self) -> tuple[list[int], list[int]] | None:
        """Ids ``add_special_tokens=True`` puts before and after a text, if known."""
        ...


def thinned_cuts(
    pattern: re.Pattern[str], text: str, min_gap: int, unsafe: Callable[[int], bool] | None = None
) -> list[int]:
    """Positions of ``pattern``'s zero-width matches, greedily at least ``min_gap`` apart.

    Each choice depends only on the text up to one character past it, so two texts that
    share a prefix share the cut points found inside it.
    """
    cuts: list[int] = []
    position = max(min_gap, 1)
    while (match := pattern.search(text, position)) is not None:
        cut = match.start()
        if unsafe is not None and unsafe(cut):
            position = cut + 1
            continue
        cuts.append(cut)
        position = cut + max(min_gap, 1)
    return cuts
