"""Reusing a remembered prompt's block keys gives exactly the keys of the whole prompt."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from dataplane.prompt_keys import PromptKeyCache
from kvcore.keys import chain_keys, root_key

ROOT = root_key(model="m")


@settings(max_examples=80)
@given(
    base=st.lists(st.integers(0, 50), min_size=0, max_size=300),
    tails=st.lists(st.lists(st.integers(0, 50), max_size=200), min_size=1, max_size=4),
    cut=st.integers(0, 300),
    block_size=st.sampled_from([1, 4, 16]),
)
def test_keys_equal_chaining_the_whole_prompt(
    base: list[int], tails: list[list[int]], cut: int, block_size: int
) -> None:
    cache = PromptKeyCache(max_groups=2)
    for tail in tails:
        tokens = base[:cut] + tail
        assert cache.keys(tokens, root=ROOT, block_size=block_size) == chain_keys(
            ROOT, tokens, block_size
        )


def test_a_prompt_extending_a_remembered_one_hashes_only_its_new_blocks() -> None:
    cache = PromptKeyCache()
    prefix = list(range(8192))
    cache.keys(prefix, root=ROOT, block_size=16)
    before = cache.reused_blocks
    cache.keys([*prefix, *range(5, 900)], root=ROOT, block_size=16)
    assert cache.reused_blocks - before == 512
