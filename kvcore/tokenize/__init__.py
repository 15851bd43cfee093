"""Tokenization as the engines do it: a ``Tokenizer`` protocol and two implementations.

- :class:`BuiltinTokenizer`: deterministic, no model files (demos, tests, ``enginesim``);
- :class:`HFTokenizer`: a model's ``tokenizer.json`` and its Jinja chat template;
- :class:`PrefixTokenCache`: either of them, tokenizing and keying only a prompt's new tail.

``load_tokenizer("builtin")`` or ``load_tokenizer("/path/to/model")`` picks one.
"""

from __future__ import annotations

from kvcore.tokenize.base import (
    ChatTemplateError,
    SegmentableTokenizer,
    Tokenizer,
    TokenizerError,
)
from kvcore.tokenize.builtin import BuiltinTokenizer
from kvcore.tokenize.hf import HFTokenizer
from kvcore.tokenize.prefix_cache import CacheStats, Encoded, PrefixTokenCache

BUILTIN = "builtin"

__all__ = [
    "BUILTIN",
    "BuiltinTokenizer",
    "CacheStats",
    "ChatTemplateError",
    "Encoded",
    "HFTokenizer",
    "PrefixTokenCache",
    "SegmentableTokenizer",
    "Tokenizer",
    "TokenizerError",
    "load_tokenizer",
]


def load_tokenizer(spec: str) -> Tokenizer:
    """``"builtin"``, or a directory holding a model's ``tokenizer.json``."""
    if spec == BUILTIN:
        return BuiltinTokenizer()
    if not spec:
        raise TokenizerError("tokenizer spec is empty: use 'builtin' or a model directory")
    return HFTokenizer(spec)
