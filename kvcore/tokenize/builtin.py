"""A tokenizer that needs no model files, for demos, tests and ``enginesim``.

Both the simulated engine and the proxy use it (``--tokenizer builtin``), so it must be
deterministic and fully specified; the rule is in :class:`BuiltinTokenizer`'s docstring
and anyone can reimplement it from there.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from itertools import accumulate
from typing import Any

import xxhash

from kvcore.tokenize.base import ChatTemplateError, last_match, utf8_offsets

VOCAB_SIZE = 32_000
FIRST_ORDINARY_ID = 256
PAD, BOS, EOS = "<pad>", "<s>", "</s>"
SPECIAL_TOKENS: dict[str, int] = {
    PAD: 0,
    BOS: 1,
    EOS: 2,
    "<|system|>": 3,
    "<|user|>": 4,
    "<|assistant|>": 5,
    "<|tool|>": 6,
    "<|end|>": 7,
}
ROLE_TOKENS = {"system": "<|system|>", "user": "<|user|>", "assistant": "<|assistant|>"}
ROLE_TOKENS["tool"] = "<|tool|>"

_SPECIAL_RE = re.compile("|".join(re.escape(s) for s in SPECIAL_TOKENS))
_PIECE_RE = re.compile(r"\s*(?:\w{1,8}|[^\w\s])|\s+")
# Pieces start with their whitespace and special tokens hold none, so tokenization is
# local at every switch from non-whitespace to whitespace (decided by the two characters).
_CUT_RE = re.compile(r"(?<=\S)(?=\s)")
_hash = xxhash.xxh3_64_intdigest


def piece_id(piece: str) -> int:
    """The id of one ordinary piece: ``256 + xxh3_64(UTF-8) % (32000 - 256)``."""
    return FIRST_ORDINARY_ID + _hash(piece.encode("utf-8")) % (VOCAB_SIZE - FIRST_ORDINARY_ID)


class BuiltinTokenizer:
    """Deterministic word-level tokenizer with a fixed vocabulary of 32,000 ids.

    Splitting, in order:

    1. The special tokens ``<pad>`` (0), ``<s>`` (1, BOS), ``</s>`` (2, EOS),
       ``<|system|>`` (3), ``<|user|>`` (4), ``<|assistant|>`` (5), ``<|tool|>`` (6) and
       ``<|end|>`` (7) are cut out wherever they appear, leftmost first, and get their id.
       Ids 8-255 are reserved and never produced.
    2. The text between them is cut into pieces by the Python regular expression
       ``\\s*(?:\\w{1,8}|[^\\w\\s])|\\s+`` (``re.findall``, Unicode ``\\w``/``\\s``): a piece
       is any leading whitespace followed by up to 8 word characters or by one other
       character; whitespace at the very end is a piece of its own. So a short word
       with its leading space is one token, a long word one token per 8 characters, and
       each punctuation mark one token.
    3. A piece's id is ``256 + xxh3_64(piece as UTF-8, seed=0) % 31744``.

    ``encode(text, add_special_tokens=True)`` prepends BOS (1); EOS is never added.

    The chat template renders, with ``<|role|>`` for roles system, user, assistant and
    tool::

        <s>[<|system|>\\nTools:\\n{one JSON line per tool}<|end|>\\n]
        <|role|>\\n{content}<|end|>\\n   (once per message, in order)
        [<|assistant|>\\n]               (when add_generation_prompt)

    A message's content is a string or a list of ``{"type": "text", "text": ...}`` parts
    (joined with nothing); an assistant message's ``tool_calls`` follow its content, one
    JSON line each. JSON here is ``json.dumps(obj, sort_keys=True, separators=(",", ":"))``.
    """

    name = "builtin"
    _ids_memo_limit = 1 << 16  # pieces memoised (about 10 MB), then the memo restarts
    _words_memo_limit = 1 << 16  # words memoised with their ids, then the memo restarts
    eos_token_id: int | None = SPECIAL_TOKENS[EOS]
    bos_token_id = SPECIAL_TOKENS[BOS]
    vocab_size = VOCAB_SIZE

    def __init__(self) -> None:
        self._ids: dict[str, int] = {}  # memo of piece_id: ids repeat, hashing is slower
        self._spaced: dict[str, tuple[int, ...]] = {}  # word -> the ids of " " + word
        self._firsts: dict[str, tuple[int, ...]] = {}  # word -> its ids starting a text

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        ids = [self.bos_token_id] if add_special_tokens else []
        if "<" not in text and self._add_words(ids, text):
            return ids
        ids += self._split_text(text, 0)
        return ids

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> str:
        parts = [BOS]
        if tools:
            lines = "".join(_json(tool) + "\n" for tool in tools)
            parts.append(f"<|system|>\nTools:\n{lines}<|end|>\n")
        parts.extend(_render_message(i, message) for i, message in enumerate(messages))
        if add_generation_prompt:
            parts.append("<|assistant|>\n")
        return "".join(parts)

    def _encode_text(self, text: str, start: int = 0) -> list[int]:
        if "<" not in text:
            words: list[int] = []
            if self._add_words(words, text[start:] if start else text):
                return words
        return self._split_text(text, start)

    def _split_text(self, text: str, start: int) -> list[int]:
        """The ids of ``text[start:]`` by the rule: special tokens, then pieces."""
        if "<" not in text:  # every special token starts with "<": no search for one
            return self._piece_ids(_PIECE_RE.findall(text, start))
        ids: list[int] = []
        for match in _SPECIAL_RE.finditer(text, start):
            ids += self._piece_ids(_PIECE_RE.findall(text, start, match.start()))
            ids.append(SPECIAL_TOKENS[match.group()])
            start = match.end()
        ids += self._piece_ids(_PIECE_RE.findall(text, start))
        return ids

    def _add_words(self, ids: list[int], text: str) -> bool:
        """Add to ``ids`` the ids of a ``text`` of words between single spaces (no other
        whitespace, none at either end), word by word, and say so; ``False`` (``ids`` as
        they were) for any other text.

        Pieces never cross a switch from non-whitespace to whitespace, so such a text's
        pieces are its first word's, then each `` word``'s, which never change: their ids
        are remembered by word (the regular expression costs ~0.1 us a piece, a lookup a
        few ns)."""
        if not text.isprintable():  # every whitespace character but " " is unprintable
            return False
        words = text.split(" ")
        if "" in words:  # two spaces in a row, or one at either end (or no text)
            return False
        first = self._firsts.get(words[0])
        if first is None:
            first = self._first_word(words[0])
        given = len(ids)
        ids += first
        spaced = self._spaced
        try:
            for word in words[1:]:  # a loop: faster than chain(map(...)), most on few words
                ids += spaced[word]
        except KeyError:  # a word not seen yet: its pieces found once
            if len(spaced) > self._words_memo_limit:
                spaced.clear()
            for word in words[1:]:
                if word not in spaced:
                    spaced[word] = tuple(self._piece_ids(_PIECE_RE.findall(" " + word)))
            del ids[given:]
            ids += first
            for word in words[1:]:
                ids += spaced[word]
        return True

    def _first_word(self, word: str) -> tuple[int, ...]:
        """The ids of ``word`` at the start of a text (no space before it)."""
        ids = self._firsts.get(word)
        if ids is None:
            if len(self._firsts) > self._words_memo_limit:
                self._firsts.clear()
            ids = self._firsts[word] = tuple(self._piece_ids(_PIECE_RE.findall(word)))
        return ids

    def _piece_ids(self, pieces: list[str]) -> list[int]:
        memo = self._ids
        try:
            return list(map(memo.__getitem__, pieces))
        except KeyError:
            if len(memo) > self._ids_memo_limit:
                memo.clear()
            for piece in pieces:
                if piece not in memo:
                    memo[piece] = piece_id(piece)
            return list(map(memo.__getitem__, pieces))

    def last_cut(self, text: str, shared: int) -> int:
        """The last offset before ``shared`` between a non-whitespace and a whitespace
        character (the whitespace is inside ``text[:shared]``)."""
        return last_match(_CUT_RE, text, shared)

    def encode_from(self, text: str, start: int) -> list[int] | None:
        return self._encode_text(text, start)

    def token_starts(self, text: str, start: int, ids: list[int]) -> list[int] | None:
        starts: list[int] = []
        position = start
        for match in _SPECIAL_RE.finditer(text, start):
            starts += _piece_starts(_PIECE_RE.findall(text, position, match.start()), position)
            starts.append(match.start())
            position = match.end()
        starts += _piece_starts(_PIECE_RE.findall(text, position), position)
        return utf8_offsets(text, starts) if len(starts) == len(ids) else None

    def special_wrap(self) -> tuple[list[int], list[int]] | None:
        return [self.bos_token_id], []


def _piece_starts(pieces: list[str], start: int) -> list[int]:
    """Where each of ``pieces``, found from offset ``start``, starts."""
    return list(accumulate(map(len, pieces[:-1]), initial=start)) if pieces else []


def _render_message(index: int, message: Mapping[str, Any]) -> str:
    role = message.get("role")
    if role not in ROLE_TOKENS:
        raise ChatTemplateError(f"messages[{index}].role must be one of {sorted(ROLE_TOKENS)}")
    text = _content_text(index, message.get("content"))
    calls = message.get("tool_calls") or []
    text += "".join("\n" + _json(call) for call in calls)
    return f"{ROLE_TOKENS[role]}\n{text}<|end|>\n"


def _content_text(index: int, content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(_is_text_part(p) for p in content):
        return "".join(str(part["text"]) for part in content)
    raise ChatTemplateError(f"messages[{index}].content must be a string or a list of text parts")


def _is_text_part(part: Any) -> bool:
    return isinstance(part, Mapping) and part.get("type") == "text" and "text" in part


def _json(value: Any) -> str:
    try:
        return json.dumps(value, sort_keys=True, separators=(",", ":"))
    except (TypeError, ValueError) as exc:
        raise ChatTemplateError(f"not JSON-serialisable: {exc}") from exc
