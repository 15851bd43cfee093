"""Block keys of recent prompts, so a prompt that extends one hashes only its new blocks.

Turning 8,192 token ids into 512 router block keys costs about as much as the rest of a
routing decision; most prompts repeat a recent one's beginning (the system prompt, the
conversation so far). :class:`PromptKeyCache` remembers the tokens and keys of recent
prompts, grouped by their first key (which already stands for model, adapter, tenant
and the first block), finds the candidate sharing the most leading blocks by comparing
token lists block-aligned in C (a candidate whose block at the best length so far differs
cannot do better and is skipped after one block's comparison), and chains new keys only
from there. The keys are
exactly ``kvcore.keys.chain_keys(root, tokens, block_size)``. Not thread-safe: one per
thread.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Sequence

from kvcore.keys import chain_keys

_CANDIDATES = 4  # recent prompts kept per first key
_STRIDE_BLOCKS = 64  # blocks compared at once before narrowing to one block


class PromptKeyCache:
    """``keys(tokens, root=, block_size=)`` with the keys of remembered prefixes reused."""

    def __init__(self, max_groups: int = 256) -> None:
        self.max_groups = max_groups
        self.reused_blocks = 0
        self._groups: OrderedDict[tuple[int, int], deque[tuple[Sequence[int], list[int]]]] = (
            OrderedDict()
        )

    def keys(self, tokens: Sequence[int], *, root: int, block_size: int) -> list[int]:
        """Router block keys of ``tokens`` chained from ``root``."""
        blocks = len(tokens) // block_size
        if blocks == 0:
            return []
        first = chain_keys(root, tokens[:block_size], block_size)[0]
        group = self._group((first, block_size))
        shared, source = 1, [first]
        for old_tokens, old_keys in group:
            limit = min(blocks, len(old_keys))
            if limit <= shared or not _same_block(tokens, old_tokens, block_size, shared):
                continue  # it cannot share more blocks than the best so far
            common = _common_blocks(tokens, old_tokens, block_size, limit)
            if common > shared:
                shared, source = common, old_keys
        self.reused_blocks += shared
        keys = source[:shared]
        keys += chain_keys(keys[-1], tokens[shared * block_size :], block_size)
        group.appendleft((tokens, keys))
        return keys

    def _group(self, at: tuple[int, int]) -> deque[tuple[Sequence[int], list[int]]]:
        group = self._groups.get(at)
        if group is None:
            group = self._groups[at] = deque(maxlen=_CANDIDATES)
            while len(self._groups) > self.max_groups:
                self._groups.popitem(last=False)
        else:
            self._groups.move_to_end(at)
        return group


def _same_block(a: Sequence[int], b: Sequence[int], block_size: int, index: int) -> bool:
    start = index * block_size
    return a[start : start + block_size] == b[start : start + block_size]


def _common_blocks(a: Sequence[int], b: Sequence[int], block_size: int, limit: int) -> int:
    """How many leading whole blocks ``a`` and ``b`` share, at most ``limit``."""
    done = 0
    stride = _STRIDE_BLOCKS
    while stride:
        while done + stride <= limit:
            start, end = done * block_size, (done + stride) * block_size
            if a[start:end] != b[start:end]:
                break
            done += stride
        stride //= 8 if stride > 1 else 2
    return done
