"""A model's own tokenizer: HF ``tokenizer.json`` plus the chat template of its config.

This is what vLLM and SGLang run, minus ``transformers`` and torch: the fast tokenizer
from ``tokenizer.json`` and the Jinja chat template from ``tokenizer_config.json`` (or
``chat_template.jinja`` beside it, as newer models ship it).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping, Sequence
from itertools import accumulate
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as FastTokenizer
from tokenizers import pre_tokenizers

from kvcore.tokenize.base import ChatTemplateError, TokenizerError, last_match, utf8_offsets
from kvcore.tokenize.chat_template import Renderer, compile_chat_template

TOKENIZER_FILE = "tokenizer.json"
CONFIG_FILE = "tokenizer_config.json"
TEMPLATE_FILE = "chat_template.jinja"
_SPECIAL_NAMES = ("bos_token", "eos_token", "unk_token", "pad_token")
# A newline between two non-space characters: the byte-level regexes of GPT-2, Llama 3,
# Qwen and DeepSeek, and whitespace splitters, all end a pre-token there.
_CUT_RE = re.compile(r"(?<=\S\n)(?=\S)")
_ANCHOR = "a\n"
_CUTTING_PRE_TOKENIZERS = {"Split", "Whitespace", "WhitespaceSplit", "BertPreTokenizer"}
_LOCAL_PRE_TOKENIZERS = _CUTTING_PRE_TOKENIZERS | {"ByteLevel", "Digits", "Punctuation"}
_LOCAL_NORMALIZERS = {"NFC", "NFD", "NFKC", "NFKD", "Lowercase"}
_NEWLINES_TRIED = 16  # by last_cut before the regex's backward search takes over
_PROBES = ("ab\ncd", "a.\nb", "12\n34", "x\n's", "日本\n語", "a,\n(b", "q  r\ns t", "<\n>")


class HFTokenizer:
    """The tokenizer and chat template found in a model directory.

    ``directory`` must hold ``tokenizer.json``; ``tokenizer_config.json`` is read for
    ``chat_template`` (a string, or HF's list of ``{"name", "template"}`` where
    ``"default"`` is used, and ``"tool_use"`` when tools are passed) and for the special
    tokens ``bos_token``/``eos_token``/``unk_token``/``pad_token`` (strings or
    AddedToken-like dicts with ``"content"``). The template sees ``messages``,
    ``add_generation_prompt``, ``tools`` and those special tokens, as in ``transformers``.
    """

    def __init__(self, directory: str | Path) -> None:
        self.directory = Path(directory)
        self.name = self.directory.name
        self._fast = _load_fast_tokenizer(self.directory / TOKENIZER_FILE)
        config = _load_config(self.directory / CONFIG_FILE)
        self.special_tokens = _special_tokens(config)
        self.eos_token_id: int | None = self._token_id(self.special_tokens.get("eos_token"))
        self.bos_token_id: int | None = self._token_id(self.special_tokens.get("bos_token"))
        self._templates = _templates(config, self.directory / TEMPLATE_FILE)
        self._renderers = {name: compile_chat_template(src) for name, src in self._templates}
        self._lstrip_tokens, segmentable = _segmentation_facts(self._fast)
        self._lstrip_reach = max(map(len, self._lstrip_tokens), default=1) - 1
        self._anchor_ids = self._fast.encode(_ANCHOR, add_special_tokens=False).ids
        self._byte_lengths = _byte_lengths(self._fast)
        self.segmentable = segmentable and self._cuts_exact_after_added_tokens()

    @property
    def fast(self) -> FastTokenizer:
        """The underlying HF ``tokenizers.Tokenizer``."""
        return self._fast

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        return self._fast.encode_batch_fast([text], add_special_tokens=add_special_tokens)[0].ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """Token ids of each text, without special tokens (ids only: ``encode_batch_fast``
        skips the offsets this router never uses). One text per call: handing a batch to
        the library's thread pool was slower on a busy machine than the work itself."""
        encode = self._fast.encode_batch_fast
        return [encode([text], add_special_tokens=False)[0].ids for text in texts]

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> str:
        render = self._renderer(use_tools=bool(tools))
        variables: dict[str, Any] = dict(self.special_tokens)
        variables.update(
            messages=[dict(m) for m in messages],
            add_generation_prompt=add_generation_prompt,
            tools=[dict(t) for t in tools] if tools else None,
        )
        return render(variables)

    def last_cut(self, text: str, shared: int) -> int:
        """The last offset after a newline between two non-space characters that
        ``text[:shared]`` decides (0 when the tokenizer's pre-tokenizer or normalizer is
        not known to cut there)."""
        if not self.segmentable:
            return 0
        end = shared - self._lstrip_reach
        unsafe = self._before_lstrip_token(text) if self._lstrip_tokens else None
        return _last_newline_cut(text, end, unsafe) or last_match(_CUT_RE, text, end, unsafe)

    def encode_from(self, text: str, start: int) -> list[int] | None:
        """Encodes ``text[start:]`` in one call, after the anchor ``"a\\n"`` unless at
        the start, so that prefix-space rules see it mid-text, as it is."""
        anchor = _ANCHOR if start else ""
        width = len(self._anchor_ids) if start else 0
        tail = text[start:] if start else text
        ids = self._fast.encode_batch_fast([anchor + tail], add_special_tokens=False)[0].ids
        if ids[:width] != self._anchor_ids[:width]:
            return None
        return ids[width:] if width else ids

    def token_starts(self, text: str, start: int, ids: list[int]) -> list[int] | None:
        """From the UTF-8 length of byte-level tokens (unless a normalizer may change
        non-ASCII text), else from the offsets of the tokens encoded again (which cost
        about a third more)."""
        tail = text[start:]
        base = start if text.isascii() else len(text[:start].encode("utf-8", "surrogatepass"))
        starts = self._starts_by_bytes(ids, tail, base)
        if starts is not None:
            return starts
        anchor = _ANCHOR if start else ""
        width = len(self._anchor_ids) if start else 0
        encoding = self._fast.encode(anchor + tail, add_special_tokens=False)
        if encoding.ids[width:] != ids:
            return None
        shift = start - len(anchor)
        return utf8_offsets(text, [begin + shift for begin, _ in encoding.offsets[width:]])

    def _starts_by_bytes(self, ids: list[int], tail: str, base: int) -> list[int] | None:
        """Where each token starts in bytes, for a byte-level vocabulary (whose tokens
        spell their bytes); ``None`` for another, or for non-ASCII text that a normalizer
        may have changed."""
        lengths = self._byte_lengths
        ascii_tail = tail.isascii()
        if lengths is None or (self._fast.normalizer is not None and not ascii_tail):
            return None
        try:
            starts = list(accumulate(map(lengths.__getitem__, ids), initial=base))
        except IndexError:
            return None
        size = len(tail) if ascii_tail else len(tail.encode("utf-8", "surrogatepass"))
        if starts[-1] != base + size:
            return None
        starts.pop()
        return starts

    def special_wrap(self) -> tuple[list[int], list[int]] | None:
        bare = self.encode("a", add_special_tokens=False)
        wrapped = self.encode("a", add_special_tokens=True)
        for start in range(len(wrapped) - len(bare) + 1):
            if wrapped[start : start + len(bare)] == bare:
                return wrapped[:start], wrapped[start + len(bare) :]
        return None

    def _cuts_exact_after_added_tokens(self) -> bool:
        """Whether a cut after ``<added token>\n`` is exact. The text between added
        tokens is pre-tokenized piece by piece, and ByteLevel's ``add_prefix_space``
        adds a space to each piece: whole, ``"\ncd"`` after the token reads ``" \ncd"``;
        cut, the head's last piece reads ``" \n"``, which a merge may make one token."""
        for token in self._fast.get_added_tokens_decoder().values():
            if not token.content or token.content[-1].isspace():
                continue  # no cut point right after it
            text = f"ab{token.content}\ncd"
            head = self.encode(text[:-2], add_special_tokens=False)
            tail = self.encode_from(text, len(text) - 2)
            if tail is None or head + tail != self.encode(text, add_special_tokens=False):
                return False
        return True

    def _before_lstrip_token(self, text: str) -> Callable[[int], bool]:
        tokens = self._lstrip_tokens
        return lambda cut: any(text.startswith(token, cut) for token in tokens)

    def _renderer(self, *, use_tools: bool) -> Renderer:
        if not self._renderers:
            raise ChatTemplateError(f"tokenizer {self.name!r} has no chat template")
        if use_tools and "tool_use" in self._renderers:
            return self._renderers["tool_use"]
        return self._renderers.get("default") or next(iter(self._renderers.values()))

    def _token_id(self, token: str | None) -> int | None:
        return None if token is None else self._fast.token_to_id(token)


def _last_newline_cut(text: str, end: int, unsafe: Callable[[int], bool] | None) -> int:
    """What ``last_match(_CUT_RE, text, end, unsafe)`` returns when the cut is after one
    of the last few newlines before ``end``, found with ``str.rfind`` (``str.isspace``
    and the regex's ``\\s`` agree on every character); 0 when it is not."""
    newline = text.rfind("\n", 0, end - 1) if end > 1 else -1  # a cut after it is < end
    for _ in range(_NEWLINES_TRIED):
        if newline < 1:
            return 0
        cut = newline + 1
        between_non_spaces = not (text[newline - 1].isspace() or text[cut].isspace())
        if between_non_spaces and (unsafe is None or not unsafe(cut)):
            return cut
        newline = text.rfind("\n", 0, newline)
    return 0


def _byte_lengths(fast: FastTokenizer) -> list[int] | None:
    """The UTF-8 length of every token id, for a byte-level vocabulary (whose token
    strings spell one byte per character); ``None`` for any other."""
    spec = json.loads(fast.to_str())
    if not any(p.get("type") == "ByteLevel" for p in _components(spec)):
        return None
    vocab = fast.get_vocab(with_added_tokens=False)
    if not set("".join(vocab)) <= set(pre_tokenizers.ByteLevel.alphabet()):
        return None
    added = fast.get_added_tokens_decoder()
    lengths = [-(10**9)] * (max([*vocab.values(), *added, 0]) + 1)
    for token, index in vocab.items():
        lengths[index] = len(token)
    for index, added_token in added.items():
        lengths[index] = len(added_token.content.encode("utf-8"))
    return lengths


def _segmentation_facts(fast: FastTokenizer) -> tuple[tuple[str, ...], bool]:
    """Added tokens that swallow the whitespace before them, and whether newline cuts
    are exact for this tokenizer's pipeline."""
    spec = json.loads(fast.to_str())
    pre = _component_types(spec.get("pre_tokenizer"), "pretokenizers")
    normalizers = _component_types(spec.get("normalizer"), "normalizers")
    added = fast.get_added_tokens_decoder().values()
    spanning = any(re.search(r"\n\S", token.content) for token in added)
    byte_level_regex = any(
        p.get("type") == "ByteLevel" and p.get("use_regex", True) for p in _components(spec)
    )
    segmentable = (
        bool(pre & _CUTTING_PRE_TOKENIZERS or byte_level_regex)
        and pre <= _LOCAL_PRE_TOKENIZERS
        and normalizers <= _LOCAL_NORMALIZERS
        and not spanning
        and _probes_cut_at_newlines(fast)
    )
    return tuple(t.content for t in added if t.lstrip), segmentable


def _probes_cut_at_newlines(fast: FastTokenizer) -> bool:
    """Checks on sample texts that the normalizer is local and the pre-tokenizer ends a
    pre-token at every cut point (a ``Split`` on spaces alone would not)."""
    pre, normalizer = fast.pre_tokenizer, fast.normalizer
    if pre is None:
        return False
    for text in _PROBES:
        for match in _CUT_RE.finditer(text):
            head, tail = text[: match.start()], text[match.start() :]
            if normalizer is not None:
                head, tail = normalizer.normalize_str(head), normalizer.normalize_str(tail)
            ends = {end for _, (_, end) in pre.pre_tokenize_str(head + tail)}
            if len(head) not in ends:
                return False
    return True


def _component_types(component: Any, nested: str) -> set[str]:
    if not isinstance(component, Mapping):
        return set()
    if component.get("type") == "Sequence":
        return {t for c in component.get(nested, []) for t in _component_types(c, nested)}
    return {str(component.get("type"))}


def _components(spec: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    pre = spec.get("pre_tokenizer")
    if not isinstance(pre, Mapping):
        return []
    return list(pre.get("pretokenizers", [])) if pre.get("type") == "Sequence" else [pre]


def _load_fast_tokenizer(path: Path) -> FastTokenizer:
    if not path.is_file():
        raise TokenizerError(f"{path} not found: a model tokenizer needs {TOKENIZER_FILE}")
    try:
        return FastTokenizer.from_file(str(path))
    except Exception as exc:  # tokenizers raises a bare Exception for bad files
        raise TokenizerError(f"{path} is not a valid tokenizer.json: {exc}") from exc


def _load_config(path: Path) -> dict[str, Any]:
    if not path.exists():
        return {}
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise TokenizerError(f"{path} is not valid JSON: {exc}") from exc
    if not isinstance(config, dict):
        raise TokenizerError(f"{path} must hold a JSON object")
    return config


def _special_tokens(config: Mapping[str, Any]) -> dict[str, str]:
    tokens: dict[str, str] = {}
    for name in _SPECIAL_NAMES:
        value = config.get(name)
        if isinstance(value, Mapping):
            value = value.get("content")
        if value is not None and not isinstance(value, str):
            raise TokenizerError(f"{CONFIG_FILE}: {name} must be a string or have 'content'")
        if value is not None:
            tokens[name] = value
    return tokens


def _templates(config: Mapping[str, Any], template_file: Path) -> list[tuple[str, str]]:
    source = config.get("chat_template")
    if source is None and template_file.is_file():
        source = template_file.read_text(encoding="utf-8")
    if source is None:
        return []
    if isinstance(source, str):
        return [("default", source)]
    if isinstance(source, list) and all(_is_named_template(t) for t in source):
        return [(t["name"], t["template"]) for t in source]
    raise TokenizerError(f"{CONFIG_FILE}: chat_template must be a string or named templates")


def _is_named_template(entry: Any) -> bool:
    return (
        isinstance(entry, Mapping)
        and isinstance(entry.get("name"), str)
        and isinstance(entry.get("template"), str)
    )
