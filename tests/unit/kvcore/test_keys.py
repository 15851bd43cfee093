"""Router block keys: pinned by golden vectors, because they are a wire contract."""

from __future__ import annotations

import struct
from array import array

import pytest
import xxhash
from hypothesis import given
from hypothesis import strategies as st

from kvcore.keys import block_keys, chain_keys, root_key

MODEL = "meta-llama/Llama-3.1-8B-Instruct"

# Changing any of these is a wire break between sidecars and proxies of different versions.
GOLDEN_ROOT = 3411446579913463928
GOLDEN_KEYS_0_31 = [11354613909913864982, 15169821613408959894]


def test_root_key_golden_vector() -> None:
    assert root_key(model=MODEL) == GOLDEN_ROOT


def test_block_keys_golden_vector() -> None:
    assert block_keys(list(range(32)), model=MODEL) == GOLDEN_KEYS_0_31


def test_keys_are_the_documented_xxh3_chain() -> None:
    tokens = list(range(100, 148))
    root = xxhash.xxh3_64_intdigest(f"kvroute-v1\0{MODEL}\0lora-x\0tenant".encode(), seed=0)
    expected, key = [], root
    for i in range(0, 48, 16):
        key = xxhash.xxh3_64_intdigest(struct.pack("<16I", *tokens[i : i + 16]), seed=key)
        expected.append(key)
    assert block_keys(tokens, model=MODEL, lora_name="lora-x", namespace="tenant") == expected


@given(tokens=st.lists(st.integers(0, 2**32 - 1), max_size=80), size=st.integers(1, 20))
def test_uint32_arrays_key_like_lists(tokens: list[int], size: int) -> None:
    """The proxy keys ``array('I')`` token buffers (read without a copy): same keys."""
    assert chain_keys(GOLDEN_ROOT, array("I", tokens), size) == chain_keys(
        GOLDEN_ROOT, tokens, size
    )
    assert block_keys(array("I", range(32)), model=MODEL) == GOLDEN_KEYS_0_31


def test_partial_trailing_block_has_no_key() -> None:
    assert block_keys(list(range(15)), model=MODEL) == []
    assert block_keys(list(range(47)), model=MODEL) == block_keys(list(range(32)), model=MODEL)


def test_tenants_models_and_adapters_never_share_keys() -> None:
    tokens = list(range(64))
    variants = [
        block_keys(tokens, model=MODEL),
        block_keys(tokens, model=MODEL, namespace="tenant-a"),
        block_keys(tokens, model=MODEL, namespace="tenant-b"),
        block_keys(tokens, model=MODEL, lora_name="sql-adapter"),
        block_keys(tokens, model="other-model"),
    ]
    flat = [k for keys in variants for k in keys]
    assert len(set(flat)) == len(flat)


def test_root_fields_are_separated_not_concatenated() -> None:
    assert root_key(model="ab", lora_name="c") != root_key(model="a", lora_name="bc")


@given(st.lists(st.integers(0, 2**32 - 1), max_size=200), st.integers(1, 64))
def test_a_prompt_chains_from_its_prefix(tokens: list[int], block_size: int) -> None:
    keys = block_keys(tokens, model=MODEL, block_size=block_size)
    assert len(keys) == len(tokens) // block_size
    assert all(0 <= k < 2**64 for k in keys)
    cut = len(keys) // 2
    tail = chain_keys(keys[cut - 1] if cut else root_key(model=MODEL), tokens[cut * block_size :],
                      block_size)  # fmt: skip
    assert keys[cut:] == tail


@pytest.mark.parametrize("bad", [[-1], [2**32]])
def test_token_ids_outside_uint32_are_refused(bad: list[int]) -> None:
    with pytest.raises(ValueError, match="token ids"):
        block_keys(bad * 16, model=MODEL)


def test_block_size_must_be_positive() -> None:
    with pytest.raises(ValueError, match="block_size"):
        block_keys([1] * 16, model=MODEL, block_size=0)
