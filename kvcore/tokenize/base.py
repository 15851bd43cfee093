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
    """A tokenizer that can resume mid-text at *safe cut points*.

    A cut point ``p`` of a text is a character offset where tokenization is local:
    tokenizing ``text[:p]`` and ``text[p:]`` (the latter with :meth:`encode_from`, which
    knows it is mid-text) and concatenating gives exactly the tokens of ``text``, whatever
    follows ``p``; so a token of ``text`` starts at ``p``.
    """

    def last_cut(self, text: str, shared: int) -> int:
        """The last cut point of ``text`` that every text beginning with ``text[:shared]``
        shares (whether it is one depends only on those characters); 0 when none."""
        ...

    def encode_from(self, text: str, start: int) -> list[int] | None:
        """Tokens of ``text[start:]`` (no special tokens; ``start`` is 0 or a cut point);
        ``None`` when that cannot be done exactly."""
        ...

    def token_starts(self, text: str, start: int, ids: list[int]) -> list[int] | None:
        """Where each of ``ids`` (``encode_from(text, start)``) starts, as an offset in
        ``text``'s UTF-8 bytes (exact even for a byte-level token that starts inside a
        character); ``None`` when that is not known."""
        ...

    def special_wrap(self) -> tuple[list[int], list[int]] | None:
        """Ids ``add_special_tokens=True`` puts before and after a text, if known."""
        ...


def last_match(
    pattern: re.Pattern[str], text: str, end: int, unsafe: Callable[[int], bool] | None = None
) -> int:
    """The last zero-width match of ``pattern`` that ``text[:end]`` alone decides (its
    lookahead cannot see past ``end``) and ``unsafe`` does not refuse; 0 when none.

    Searches backwards in growing windows, so the cost follows the distance to the
    match, not the length of the text.
    """
    high, window = end, 64
    while high > 0:
        low = max(0, high - window)
        found = 0
        for match in pattern.finditer(text, low, end):
            position = match.start()
            if position >= high:
                break
            if position and (unsafe is None or not unsafe(position)):
                found = position
        if found:
            return found
        high, window = low, window * 4
    return 0


def utf8_offsets(text: str, offsets: list[int]) -> list[int]:
    """Character offsets (ascending) of ``text`` as offsets in its UTF-8 bytes."""
    if text.isascii():
        return offsets
    result, previous, size = [], 0, 0
    for offset in offsets:
        size += len(text[previous:offset].encode("utf-8", "surrogatepass"))
        result.append(size)
        previous = offset
    return result
