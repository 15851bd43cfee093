"""Hot prefixes: the prompt beginnings many distinct requests of one workload share.

A proxy sees every prompt's block keys. Key ``k_d`` (the key of block ``d``) names the
whole prefix of ``d`` blocks, so counting keys counts prefixes. :class:`HotPrefixes`
counts, per workload, how many *distinct* requests (distinct prompts: a resent prompt
counts once) began with each prefix, at a few depths per prompt (every block up to 8,
then four per doubling: 8, 10, 12, 14, 16, 20, ...). Once a depth is hot, the blocks up
to the next counted depth are compared with those of the request that made it hot (a
binary search: keys are chained), so the prefix is reported to the block where fewer
than ``min_requests`` requests still agree, its true end. It grows lazily, like a trie
filled on demand: a prompt that shares nothing seen before adds one depth, its first,
so a private prompt costs one entry; a prompt that begins as an earlier, different
prompt did adds every deeper depth it has, so a shared prefix is counted whole from its
second request on.

A prefix becomes *hot* once ``min_requests`` distinct requests began with it; only then
are its token ids copied (from the request that made it hot), so one user's private
prompt is never kept. Memory is bounded: at most ``max_candidates`` counted prefixes
(past that, the less requested half is forgotten) and ``max_prefixes`` hot ones (past
that, the least requested goes). Nothing here logs: token ids are clients' prompts.

Counts decay with a half-life, so :meth:`HotPrefixes.hot` reports each prefix's recent
requests per second; it reports only the deepest hot prefixes (a shorter hot one is a
prefix of a reported one, so warming the longer warms it too: when a longer one becomes
hot, the shorter one it extends gives up its place).
"""

from __future__ import annotations

import math
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import lru_cache

from kvcore.workload.warmup import WarmupSettings

DEFAULT_HALF_LIFE_S = 60.0
DEFAULT_MAX_CANDIDATES = 4096
_LN2 = math.log(2.0)


@dataclass(frozen=True, slots=True)
class HotPrefix:
    """A prefix at least ``min_requests`` distinct requests began with."""

    model: str
    key: int  # the router key of its last block
    tokens: array[int]  # whole router blocks
    block_size: int
    requests_per_s: float

    @property
    def blocks(self) -> int:
        return len(self.tokens) // self.block_size


@lru_cache(maxsize=1024)
def depths(blocks: int) -> tuple[int, ...]:
    """The depths (in blocks) a prompt of ``blocks`` whole blocks is counted at."""
    found, depth = [], 1
    while depth <= blocks:
        found.append(depth)
        depth += max(1, (1 << (depth.bit_length() - 1)) >> 2)
    return tuple(found)


class _Counted:
    """One counted prefix: decayed requests, the distinct prompts seen until hot."""

    __slots__ = ("agree", "ahead", "at", "count", "hot", "parent", "prompts")

    def __init__(self, parent: int | None, now: float) -> None:
        self.parent = parent  # the key of the counted depth before (None: the first)
        self.count = 0.0
        self.at = now
        self.prompts: set[int] | None = set()  # distinct prompts' last keys; None once hot
        self.hot: HotPrefix | None = None  # with the tokens up to the next counted depth
        # once hot: the keys of the blocks after it up to the next counted depth (the
        # request's that made it hot), and how many later requests agreed with how many
        # of them (agree[m]: requests whose next m blocks were these)
        self.ahead: Sequence[int] = ()
        self.agree: list[int] = []

    def extension(self, needed: int) -> int:
        """Blocks past this prefix that at least ``needed`` later requests shared."""
        total = 0
        for m in range(len(self.agree) - 1, 0, -1):
            total += self.agree[m]
            if total >= needed:
                return m
        return 0

    def decayed(self, now: float, half_life_s: float) -> float:
        return self.count * float(0.5 ** (max(0.0, now - self.at) / half_life_s))


Tokens = Callable[[], Sequence[int]]  # the prompt's token ids, read only when needed


class HotPrefixes:
    """One workload's prefix counts (see the module docstring)."""

    def __init__(
        self,
        settings: WarmupSettings,
        *,
        half_life_s: float = DEFAULT_HALF_LIFE_S,
        max_candidates: int = DEFAULT_MAX_CANDIDATES,
    ) -> None:
        self.settings = settings
        self.half_life_s = half_life_s
        self.max_candidates = max(16, max_candidates)
        self._counted: dict[int, _Counted] = {}
        self._hot: dict[int, _Counted] = {}

    def __len__(self) -> int:
        return len(self._counted)

    def observe(
        self,
        model: str,
        keys: Sequence[int],
        tokens: Tokens,
        block_size: int,
        now: float,
        prompt: int | None = None,
    ) -> None:
        """Count one request whose prompt has block ``keys`` (``tokens``: its token ids,
        read only when a prefix becomes hot; ``prompt``: a number naming the whole prompt,
        its partial last block included, so that prompts differing only there count as
        distinct; default: its last block's key)."""
        if len(keys) < 2:  # a prompt of one block shares nothing worth warming
            return
        deepest = min(len(keys), self.settings.max_prefix_tokens // block_size)
        prompt = keys[-1] if prompt is None else prompt
        parent: int | None = None
        shared = False  # the prompt began with a prefix another prompt began with
        counted_at = depths(deepest)
        # from the deepest depth counted already: the shallower ones a shared prefix
        # passed are not counted again (its deepest is what is reported)
        for depth in counted_at[max(self._deepest_seen(keys, counted_at), 0) :]:
            key = keys[depth - 1]
            counted = self._counted.get(key)
            if counted is None:  # a depth not seen: count it; go on only past a shared one
                self._add(key, parent, now, prompt)
                if not shared:
                    return
                parent = key
                continue
            self._count(counted, now)
            if counted.ahead:
                counted.agree[_agreement(keys, depth, counted.ahead)] += 1
            prompts = counted.prompts
            if prompts is None or (prompts and prompt not in prompts):
                shared = True
            if prompts is not None and prompt not in prompts:
                prompts.add(prompt)
                if len(prompts) >= self.settings.min_requests:
                    self._promote(key, counted, model, keys, depth, tokens, block_size)
            parent = key

    def _deepest_seen(self, keys: Sequence[int], counted_at: Sequence[int]) -> int:
        """The index in ``counted_at`` of the deepest depth of ``keys`` counted already
        (-1: none): a binary search, since a depth is counted only after the one before."""
        low, high, found = 0, len(counted_at) - 1, -1
        counted = self._counted
        while low <= high:
            middle = (low + high) // 2
            if keys[counted_at[middle] - 1] in counted:
                found, low = middle, middle + 1
            else:
                high = middle - 1
        return found

    def hot(self, now: float) -> list[HotPrefix]:
        """The deepest hot prefixes, most requested first, with their recent rates."""
        rate = _LN2 / self.half_life_s
        needed = self.settings.min_requests - 1  # with the request that made it hot
        found = [
            _reported(counted, counted.decayed(now, self.half_life_s) * rate, needed)
            for counted in self._hot.values()
            if counted.hot is not None
        ]
        found.sort(key=lambda p: p.requests_per_s, reverse=True)
        return found

    # -- bookkeeping ------------------------------------------------------------------

    def _count(self, counted: _Counted, now: float) -> None:
        counted.count = counted.decayed(now, self.half_life_s) + 1.0
        counted.at = now

    def _add(self, key: int, parent: int | None, now: float, prompt: int) -> None:
        if len(self._counted) >= self.max_candidates:
            self._forget_half(now)
        counted = self._counted[key] = _Counted(parent, now)
        self._count(counted, now)
        assert counted.prompts is not None
        counted.prompts.add(prompt)

    def _promote(
        self,
        key: int,
        counted: _Counted,
        model: str,
        keys: Sequence[int],
        depth: int,
        tokens: Tokens,
        block_size: int,
    ) -> None:
        counted.prompts = None
        parent = self._hot.pop(counted.parent, None) if counted.parent is not None else None
        if parent is not None:  # warming the longer prefix warms it: one place, not two
            parent.hot = None
        elif len(self._hot) >= self.settings.max_prefixes:
            coldest = min(self._hot, key=lambda k: self._hot[k].count)
            if self._hot[coldest].count > counted.count:
                counted.prompts = set()  # not kept: counts again from scratch
                return
            self._hot.pop(coldest).hot = None
        limit = min(len(keys), self.settings.max_prefix_tokens // block_size)
        stop = next((d for d in depths(limit) if d > depth), limit)
        counted.ahead = list(keys[depth:stop])
        counted.agree = [0] * (len(counted.ahead) + 1)
        held = array("I", tokens()[: stop * block_size])
        counted.hot = HotPrefix(model, key, held, block_size, 0.0)
        self._hot[key] = counted

    def _forget_half(self, now: float) -> None:
        """Forget the less requested half of the counted prefixes that are not hot."""
        cold = [
            (c.decayed(now, self.half_life_s), k) for k, c in self._counted.items() if not c.hot
        ]
        cold.sort()
        for _, key in cold[: max(1, len(self._counted) // 2)]:
            del self._counted[key]


def _reported(counted: _Counted, requests_per_s: float, needed: int) -> HotPrefix:
    """The hot prefix as far as enough requests agreed past its counted depth."""
    prefix = counted.hot
    assert prefix is not None
    blocks = len(prefix.tokens) // prefix.block_size - len(counted.ahead)
    extra = counted.extension(needed)
    key = counted.ahead[extra - 1] if extra else prefix.key
    tokens = prefix.tokens[: (blocks + extra) * prefix.block_size]
    return HotPrefix(prefix.model, key, tokens, prefix.block_size, requests_per_s)


def _agreement(keys: Sequence[int], depth: int, ahead: Sequence[int]) -> int:
    """How many of ``ahead`` the keys after ``depth`` blocks repeat (keys are chained, so
    agreeing on block i means agreeing on every block before it: a binary search)."""
    low, high = 0, min(len(ahead), len(keys) - depth)
    while low < high:
        mid = (low + high + 1) // 2
        if keys[depth + mid - 1] == ahead[mid - 1]:
            low = mid
        else:
            high = mid - 1
    return max(low, 0)
