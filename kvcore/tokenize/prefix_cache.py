"""Tokenize and key only what is new: recent prompts' tokens and block keys, by prefix.

Tokenizing a long prompt and hashing its blocks are most of a routing decision, and
most prompts repeat a recent one's beginning (the system prompt, the conversation so
far, the same documents). The cache remembers recent prompts: their UTF-8 text, their
tokens (and, once a later prompt needs it, where each starts in the text), and the
router block keys computed from them. For a
new prompt it finds the remembered one sharing the longest beginning (by chained hashes
of fixed 1 KiB chunks, then byte comparison to the exact first difference), steps back
to the tokenizer's last *safe cut point* before that difference (see
:class:`SegmentableTokenizer`), takes the remembered tokens before it and tokenizes only
the rest; and it takes the remembered keys of every block whose tokens did not change
and chains only the new ones. Since tokenization is local at cut points and a key
depends only on the tokens up to its block, both equal what the whole prompt gives.

A tokenizer that cannot be cut (not a :class:`SegmentableTokenizer`, or an HF tokenizer
whose pipeline is not known to cut at newlines) is called whole; its keys are still
reused as far as its tokens equal a remembered prompt's.
"""

from __future__ import annotations

from array import array
from bisect import bisect_left
from collections import OrderedDict
from dataclasses import dataclass, field

import xxhash

from kvcore.keys import chain_keys
from kvcore.tokenize.base import SegmentableTokenizer, Tokenizer

_hash = xxhash.xxh3_64_intdigest
CHUNK = 1024  # bytes per chained hash: remembered beginnings are found at this step
_FIRST_STRIDE = 16  # tokens compared first when finding the first different one


@dataclass(slots=True)
class CacheStats:
    """What the cache saved: prompts served from a remembered prefix, tokens and keys."""

    lookups: int = 0
    hits: int = 0
    reused_tokens: int = 0
    encoded_tokens: int = 0
    reused_keys: int = 0
    hashed_keys: int = 0


@dataclass(slots=True)
class Encoded:
    """A prompt's token ids (special tokens included) and, when asked, its block keys.
    Both may be the cache's own: read them, never modify them.

    ``count`` is how many tokens there are. A prompt served from the cache holds them as
    the remembered prompt does, a shared beginning and its own rest, and ``tokens``
    joins the two only when read (the proxy reads only the count and the keys)."""

    held: array[int] | _Prompt  # the tokens, or the remembered prompt holding them
    keys: list[int] = field(default_factory=list)
    count: int = field(init=False)

    def __init__(self, held: array[int] | _Prompt, keys: list[int] | None = None) -> None:
        self.held = held  # written out: one per request (see dataplane/native.py)
        self.keys = [] if keys is None else keys
        self.count = held.size() if isinstance(held, _Prompt) else len(held)

    @property
    def tokens(self) -> array[int]:
        held = self.held
        if isinstance(held, _Prompt):
            held = self.held = held.span(0, self.count)
        return held

    def token_list(self) -> list[int]:
        return self.tokens.tolist()


@dataclass(slots=True)
class _Prompt:
    data: bytes  # the text as UTF-8
    # its tokens (without special tokens): the first ``cut`` of ``head`` (an array
    # shared with the prompts it was derived from and derived into: never modified),
    # then ``tail``, its own
    head: array[int]
    cut: int
    tail: array[int]
    starts: array[int]  # the byte offset in data where each of the first tokens starts
    known: int  # how many of starts are this prompt's (a derived prompt shares its
    # source's array, which may hold more: copied before this prompt extends it)
    resume: int  # the byte offset where the token after those starts (the rest: found
    # when a later prompt needs them)
    chunks: list[int]  # chained hashes of each whole chunk of data
    basis: tuple[int, int, bool] | None = None  # (root, block_size, specials) of keys
    keys: list[int] = field(default_factory=list)

    def __init__(  # written out: one per long prompt (see dataplane/native.py)
        self,
        data: bytes,
        head: array[int],
        cut: int,
        tail: array[int],
        starts: array[int],
        known: int,
        resume: int,
        chunks: list[int],
        basis: tuple[int, int, bool] | None = None,
        keys: list[int] | None = None,
    ) -> None:
        self.data = data
        self.head = head
        self.cut = cut
        self.tail = tail
        self.starts = starts
        self.known = known
        self.resume = resume
        self.chunks = chunks
        self.basis = basis
        self.keys = [] if keys is None else keys

    def size(self) -> int:
        return self.cut + len(self.tail)

    def span(self, start: int, end: int) -> array[int]:
        """A copy of its tokens ``start`` to ``end``."""
        cut = self.cut
        if end <= cut:
            return self.head[start:end]
        if start >= cut:
            return self.tail[start - cut : end - cut]
        part = self.head[start:cut]
        part.extend(self.tail[: end - cut])
        return part


@dataclass(slots=True)
class _Reuse:  # not frozen: a frozen dataclass's __init__ costs a setattr call per field
    prompt: _Prompt | None = None
    cut: int = 0  # characters of the new text whose tokens are the prompt's
    tokens: int = 0  # how many tokens that is
    at: int = 0  # the cut as a byte offset

    def __init__(
        self, prompt: _Prompt | None = None, cut: int = 0, tokens: int = 0, at: int = 0
    ) -> None:
        self.prompt = prompt  # written out: one per long prompt (see dataplane/native.py)
        self.cut = cut
        self.tokens = tokens
        self.at = at


class PrefixTokenCache:
    """Token-for-token the same as ``tokenizer.encode``, and key-for-key the same as
    ``chain_keys``, faster on repeated prefixes.

    ``max_prompts`` bounds memory: each remembered prompt keeps its UTF-8 text, its
    tokens and their offsets (4 bytes each) and its keys, about 150 KB for an
    8,192-token prompt, less where prompts share a beginning (the tokens before a cut
    and the offsets are shared). Not thread-safe: use one per thread or event loop.
    """

    def __init__(self, tokenizer: Tokenizer, *, max_prompts: int = 128, chunk: int = CHUNK):
        if max_prompts < 1 or chunk < 1:
            raise ValueError("max_prompts and chunk must be >= 1")
        self.tokenizer = tokenizer
        self.max_prompts = max_prompts
        self.chunk = chunk
        self.stats = CacheStats()
        self._segmentable = tokenizer if isinstance(tokenizer, SegmentableTokenizer) else None
        self._wrap = self._segmentable.special_wrap() if self._segmentable else None
        self._prompts: OrderedDict[int, _Prompt] = OrderedDict()
        self._by_chunk: dict[int, _Prompt] = {}

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """The token ids ``tokenizer.encode(text, add_special_tokens=...)`` returns."""
        return self.encode_keyed(text, add_special_tokens=add_special_tokens).token_list()

    def encode_keyed(
        self,
        text: str,
        *,
        add_special_tokens: bool = True,
        root: int | None = None,
        block_size: int = 16,
    ) -> Encoded:
        """The tokens of ``text`` and, when ``root`` is given, the router block keys
        ``chain_keys(root, tokens, block_size)``."""
        if len(text) < self.chunk or (add_special_tokens and self._wrap is None):
            # too short to be found again, or cannot be cut
            tokens = array("I", self.tokenizer.encode(text, add_special_tokens=add_special_tokens))
            if root is None or len(tokens) < block_size:  # not one whole block: no keys
                return Encoded(tokens)
            return Encoded(tokens, chain_keys(root, tokens, block_size))
        before, after = self._wrap if add_special_tokens and self._wrap else ([], [])
        data = text.encode("utf-8", "surrogatepass")
        source, shared, chunks = self._longest(data)
        reuse = self._reuse(text, data, source, shared)
        prompt = self._tokens(text, data, chunks, reuse)
        size = prompt.size()
        wrapped = None
        if before or after:
            wrapped = array("I", before) + prompt.span(0, size) + array("I", after)
        if root is not None:
            prompt.basis = (root, block_size, add_special_tokens)
            prompt.keys = self._keys(prompt, reuse.prompt, wrapped, len(before), reuse.tokens)
        self._count(reuse, size)
        self._record(prompt, reuse.prompt)
        return Encoded(prompt if wrapped is None else wrapped, prompt.keys)

    def __len__(self) -> int:
        return len(self._prompts)

    def _reuse(self, text: str, data: bytes, prompt: _Prompt | None, shared: int) -> _Reuse:
        """The cut before the first difference from ``prompt`` (``shared`` bytes in)
        where the new text's tokens take over."""
        if prompt is None or self._segmentable is None:
            return _Reuse(prompt)
        shared = shared if text.isascii() else _characters(data, shared)
        cut = self._segmentable.last_cut(text, shared)
        if cut == 0:
            return _Reuse(prompt)
        at = cut if text.isascii() else len(text[:cut].encode("utf-8", "surrogatepass"))
        if at == prompt.resume and prompt.known < prompt.size():
            return _Reuse(prompt, cut, prompt.known, at)  # where its own tail started
        if at > prompt.resume:
            self._find_starts(self._segmentable, prompt)
        index = bisect_left(prompt.starts, at, 0, prompt.known)
        if index == prompt.known or prompt.starts[index] != at:
            return _Reuse(prompt)
        return _Reuse(prompt, cut, index, at)

    def _find_starts(
        self, tokenizer: SegmentableTokenizer, prompt: _Prompt, text: str | None = None
    ) -> None:
        """Where each of ``prompt``'s tokens after ``resume`` starts: found with the
        prompt when it was new, else only when a later prompt needs them (most prompts'
        own new tails, such as one question among many, are never reused)."""
        known, size = prompt.known, prompt.size()
        if known == size:
            return
        text = prompt.data.decode("utf-8", "surrogatepass") if text is None else text
        resume = prompt.resume if text.isascii() else _characters(prompt.data, prompt.resume)
        starts = tokenizer.token_starts(text, resume, prompt.span(known, size).tolist())
        if starts is not None:
            if len(prompt.starts) != known:  # shared, and holding another prompt's
                prompt.starts = prompt.starts[:known]
            prompt.starts.extend(starts)
            prompt.known = len(prompt.starts)
            prompt.resume = len(prompt.data)

    def _longest(self, data: bytes) -> tuple[_Prompt | None, int, list[int]]:
        """The remembered prompt sharing the longest beginning with ``data``, how many
        bytes they share, and ``data``'s chunk hashes.

        The last prompt is compared first: the chunks it shares have its hashes, so only
        the rest are hashed, and only those are looked up for a prompt sharing more.
        """
        best = next(reversed(self._prompts.values()), None)
        shared = _common_bytes(data, best.data, 0) if best is not None else 0
        count = min(shared // self.chunk, len(best.chunks)) if best is not None else 0
        chunks = best.chunks[:count] if best is not None and count else []
        chunks += _chunk_hashes(data, self.chunk, count, chunks[-1] if chunks else 0)
        for more in range(len(chunks), count, -1):
            prompt = self._by_chunk.get(chunks[more - 1])
            end = more * self.chunk
            if prompt is not None and prompt.data.startswith(memoryview(data)[:end]):
                return prompt, _common_bytes(data, prompt.data, end), chunks
        return (best, shared, chunks) if count else (None, 0, chunks)

    def _tokens(self, text: str, data: bytes, chunks: list[int], reuse: _Reuse) -> _Prompt:
        """``text`` as a prompt to remember: the reused tokens, then the rest encoded."""
        ids = None
        if self._segmentable is not None:
            ids = self._segmentable.encode_from(text, reuse.cut)
        if ids is None:
            ids = self.tokenizer.encode(text, add_special_tokens=False)
            return _Prompt(data, array("I", ids), len(ids), array("I"), array("I"), 0, 0, chunks)
        if reuse.prompt is None or not reuse.tokens:
            tokens = array("I", ids)
            prompt = _Prompt(data, tokens, len(tokens), array("I"), array("I"), 0, 0, chunks)
            if self._segmentable is not None and text.isascii():  # cheap: find them now,
                self._find_starts(self._segmentable, prompt, text)  # as it may be reused
            return prompt
        count, source = reuse.tokens, reuse.prompt
        # the source's tokens before the cut: its head shared where they are all in it
        # (a new question after the same system prompt), else copied
        head = source.head if count <= source.cut else source.span(0, count)
        tail = array("I", ids)
        return _Prompt(data, head, count, tail, source.starts, count, reuse.at, chunks)

    def _keys(
        self,
        prompt: _Prompt,
        source: _Prompt | None,
        wrapped: array[int] | None,
        lead: int,
        known: int,
    ) -> list[int]:
        """Block keys of the prompt's tokens (``wrapped`` in its special tokens, whose
        first ``lead`` come before them): ``source``'s for the blocks whose tokens are
        its (same root, block size and special tokens), chained from there for the rest."""
        assert prompt.basis is not None
        root, block_size, _ = prompt.basis
        reused = 0
        if source is not None and source.basis == prompt.basis:
            same = _common_tokens(prompt, source, known)
            reused = min((lead + same) // block_size, len(source.keys))
        keys = source.keys[:reused] if source is not None and reused else []
        parent = keys[-1] if keys else root
        start = reused * block_size
        rest = wrapped[start:] if wrapped is not None else prompt.span(start, prompt.size())
        keys += chain_keys(parent, rest, block_size)
        self.stats.reused_keys += reused
        self.stats.hashed_keys += len(keys) - reused
        return keys

    def _count(self, reuse: _Reuse, total: int) -> None:
        self.stats.lookups += 1
        self.stats.hits += reuse.tokens > 0
        self.stats.reused_tokens += reuse.tokens
        self.stats.encoded_tokens += total - reuse.tokens

    def _record(self, prompt: _Prompt, source: _Prompt | None) -> None:
        if not prompt.chunks:
            return  # shorter than a chunk: it could never be found
        if source is not None and source.data == prompt.data:
            self._forget(self._prompts.pop(id(source)))  # the same text: keep the newest
        for chunk in prompt.chunks:
            self._by_chunk[chunk] = prompt
        self._prompts[id(prompt)] = prompt
        while len(self._prompts) > self.max_prompts:
            self._forget(self._prompts.popitem(last=False)[1])

    def _forget(self, prompt: _Prompt) -> None:
        for chunk in prompt.chunks:
            if self._by_chunk.get(chunk) is prompt:
                del self._by_chunk[chunk]


def _chunk_hashes(data: bytes, chunk: int, skip: int, seed: int) -> list[int]:
    """Chained hashes of ``data[:chunk]``, ``data[:2 * chunk]``... (whole chunks only),
    from the ``skip + 1``-th on, chained from ``seed`` (the ``skip``-th one's hash)."""
    view, hashes = memoryview(data), []
    for start in range(skip * chunk, len(data) - chunk + 1, chunk):
        seed = _hash(view[start : start + chunk], seed)
        hashes.append(seed)
    return hashes


def _common_bytes(a: bytes, b: bytes, start: int) -> int:
    """The length of the longest common prefix of ``a`` and ``b``, known to be at least
    ``start``: halving the unknown span, each half compared by one ``memcmp``."""
    low, high = start, min(len(a), len(b)) + 1  # a[:low] == b[:low]; a[:high] differs
    view = memoryview(b)
    while high - low > 1:
        middle = (low + high) // 2
        if a.startswith(view[low:middle], low):
            low = middle
        else:
            high = middle
    return low


def _common_tokens(a: _Prompt, b: _Prompt, start: int) -> int:
    """How many leading tokens ``a`` and ``b`` share, known to be at least ``start``:
    growing strides compared in C (the first difference is usually near ``start``),
    then halving within the first unequal one."""
    limit, stride = min(a.size(), b.size()), _FIRST_STRIDE
    while start < limit:
        end = min(start + stride, limit)
        if a.span(start, end) != b.span(start, end):
            break
        start, stride = end, stride * 2
    else:
        return limit
    while stride > 1:
        stride //= 2
        end = min(start + stride, limit)
        if a.span(start, end) == b.span(start, end):
            start = end
    return start


def _characters(data: bytes, size: int) -> int:
    """How many whole characters the first ``size`` bytes of UTF-8 ``data`` hold."""
    while 0 < size < len(data) and data[size] & 0xC0 == 0x80:
        size -= 1  # a continuation byte: the character started before
    return len(data[:size].decode("utf-8", "surrogatepass"))
