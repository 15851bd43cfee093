"""Re-tokenize only what is new: a cache of recent prompts' tokens, keyed by prefix.

Tokenizing a long prompt is the most expensive step on the proxy's hot path, and most
prompts repeat a recent one's beginning (the system prompt, the conversation so far,
the same RAG documents). The cache cuts every prompt at the tokenizer's *safe cut
points* (see :class:`SegmentableTokenizer`), at least ``min_gap`` characters apart, and
remembers a chained hash of the text up to each cut. A new prompt takes the tokens of
its longest remembered prefix ending at a cut and tokenizes only the rest; since
tokenization is local at cut points, the result equals tokenizing the whole prompt.

A tokenizer that cannot be cut (not a :class:`SegmentableTokenizer`, or an HF
tokenizer whose pipeline is not known to cut at newlines) is simply called whole.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from itertools import pairwise

import xxhash

from kvcore.tokenize.base import SegmentableTokenizer, Tokenizer

_hash = xxhash.xxh3_64_intdigest


@dataclass(slots=True)
class _Prompt:
    text: str
    tokens: list[int]
    cuts: list[int]
    prefix_hashes: list[int]
    cut_token_counts: list[int]


@dataclass(slots=True)
class CacheStats:
    """What the cache saved: prompts served from a remembered prefix and their tokens."""

    lookups: int = 0
    hits: int = 0
    reused_tokens: int = 0
    encoded_tokens: int = 0


@dataclass(slots=True, frozen=True)
class _Match:
    cuts_reused: int = 0
    prompt: _Prompt | None = None

    @property
    def token_count(self) -> int:
        return self.prompt.cut_token_counts[self.cuts_reused - 1] if self.prompt else 0


class PrefixTokenCache:
    """Token-for-token the same as ``tokenizer.encode``, faster on repeated prefixes.

    ``max_prompts`` bounds memory: each remembered prompt keeps its text and a list of
    its tokens (prompts that share a prefix share its integer objects, so a remembered
    8,192-token prompt costs about 100 KB, less when it extends another). Not
    thread-safe: use one per thread or event loop.
    """

    def __init__(self, tokenizer: Tokenizer, *, max_prompts: int = 128, min_gap: int = 512):
        if max_prompts < 1 or min_gap < 1:
            raise ValueError("max_prompts and min_gap must be >= 1")
        self.tokenizer = tokenizer
        self.max_prompts = max_prompts
        self.min_gap = min_gap
        self.stats = CacheStats()
        self._segmentable = tokenizer if isinstance(tokenizer, SegmentableTokenizer) else None
        self._wrap = self._segmentable.special_wrap() if self._segmentable else None
        self._prompts: OrderedDict[int, _Prompt] = OrderedDict()
        self._by_prefix: dict[int, tuple[_Prompt, int]] = {}

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """The token ids ``tokenizer.encode(text, add_special_tokens=...)`` returns."""
        tokens = None
        if self._segmentable is not None and (self._wrap or not add_special_tokens):
            tokens = self._encode_bare(self._segmentable, text)
        if tokens is None:
            return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)
        if add_special_tokens and self._wrap is not None:
            before, after = self._wrap
            return [*before, *tokens, *after]
        return tokens

    def __len__(self) -> int:
        return len(self._prompts)

    def _encode_bare(self, tokenizer: SegmentableTokenizer, text: str) -> list[int] | None:
        cuts = tokenizer.cut_points(text, self.min_gap)
        hashes = _prefix_hashes(text, cuts)
        match = self._longest_remembered(text, cuts, hashes)
        bounds = [0, *cuts, len(text)][match.cuts_reused :]
        segments = [text[a:b] for a, b in pairwise(bounds)]
        encoded = tokenizer.encode_segments(segments, at_start=match.prompt is None)
        if encoded is None:
            return None
        reused = match.token_count
        tokens = match.prompt.tokens[:reused] if match.prompt else []
        counts = match.prompt.cut_token_counts[: match.cuts_reused] if match.prompt else []
        for segment_tokens in encoded:
            tokens.extend(segment_tokens)
            counts.append(len(tokens))
        self._count(match, reused, len(tokens))
        self._record(_Prompt(text, tokens, cuts, hashes, counts[: len(cuts)]))
        return tokens[:]

    def _count(self, match: _Match, reused: int, total: int) -> None:
        self.stats.lookups += 1
        self.stats.hits += match.prompt is not None
        self.stats.reused_tokens += reused
        self.stats.encoded_tokens += total - reused

    def _longest_remembered(self, text: str, cuts: list[int], hashes: list[int]) -> _Match:
        for index in range(len(cuts) - 1, -1, -1):
            found = self._by_prefix.get(hashes[index])
            if found is None:
                continue
            prompt, at = found
            if prompt.cuts[at] == cuts[index] and text.startswith(prompt.text[: cuts[index]]):
                return _Match(at + 1, prompt)
        return _Match()

    def _record(self, prompt: _Prompt) -> None:
        for index, prefix_hash in enumerate(prompt.prefix_hashes):
            self._by_prefix[prefix_hash] = (prompt, index)
        self._prompts[id(prompt)] = prompt
        while len(self._prompts) > self.max_prompts:
            self._forget(self._prompts.popitem(last=False)[1])

    def _forget(self, prompt: _Prompt) -> None:
        for prefix_hash in prompt.prefix_hashes:
            owner = self._by_prefix.get(prefix_hash)
            if owner is not None and owner[0] is prompt:
                del self._by_prefix[prefix_hash]


def _prefix_hashes(text: str, cuts: list[int]) -> list[int]:
    """Chained hashes of ``text[:cut]`` for every cut (ASCII text is encoded once)."""
    hashes, seed, start = [], 0, 0
    if text.isascii():
        data = memoryview(text.encode("ascii"))
        for cut in cuts:
            seed = _hash(data[start:cut], seed)
            hashes.append(seed)
            start = cut
        return hashes
    for cut in cuts:
        seed = _hash(text[start:cut].encode("utf-8", "surrogatepass"), seed)
        hashes.append(seed)
        start = cut
    return hashes
