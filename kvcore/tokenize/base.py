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

from collections.abc import Mapping, Sequence
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
