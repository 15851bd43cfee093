"""Engine block hashes against the reference test vectors (kv-events.md §1.7 and §3)."""

from __future__ import annotations

import cbor2
import pytest
from hypothesis import given
from hypothesis import strategies as st

from enginesim.hashing import (
    SglangSha256Hasher,
    VllmSha256CborHasher,
    cbor_encode,
    prompt_digests,
)

BLOCK0, BLOCK1 = list(range(16)), list(range(16, 32))


def ids(hasher: VllmSha256CborHasher | SglangSha256Hasher, tokens: list[int], salt=None):
    return [hasher.event_id(d) for d in prompt_digests(hasher, tokens, 16, salt)]


def test_vllm_sha256_cbor_default_seed_vectors() -> None:
    assert ids(VllmSha256CborHasher(), BLOCK0 + BLOCK1) == [
        2233398808101521225,
        17911472383915781900,
    ]


def test_vllm_sha256_cbor_seed_zero_vectors() -> None:
    assert ids(VllmSha256CborHasher(seed="0"), BLOCK0 + BLOCK1) == [
        12687895063098490012,
        1814341696565857452,
    ]


@pytest.mark.parametrize(
    ("tagged", "expected"), [(False, 10721593076989655162), (True, 1072837495201822809)]
)
def test_cache_salt_enters_the_first_block(tagged: bool, expected: int) -> None:
    hasher = VllmSha256CborHasher(tagged_salt=tagged)
    salted = ids(hasher, BLOCK0 + BLOCK1, "tenant-a")
    assert salted[0] == expected
    # the salt is only in block 0's extra keys, yet every later block differs by chaining
    assert salted[1] != ids(hasher, BLOCK0 + BLOCK1)[1]


def test_sglang_chained_sha256_vectors() -> None:
    assert ids(SglangSha256Hasher(), BLOCK0 + BLOCK1) == [
        6738917275443968386,
        5080553031686747138,
    ]


def test_sglang_salt_seeds_the_chain() -> None:
    hasher = SglangSha256Hasher()
    assert ids(hasher, BLOCK0, "a") != ids(hasher, BLOCK0, "b") != ids(hasher, BLOCK0)


def test_partial_trailing_block_has_no_digest() -> None:
    assert len(prompt_digests(VllmSha256CborHasher(), list(range(47)), 16, None)) == 2


cbor_values = st.recursive(
    st.none() | st.integers(0, 2**64 - 1) | st.binary(max_size=40) | st.text(max_size=30),
    lambda inner: st.lists(inner, max_size=5).map(tuple),
    max_leaves=20,
)


@given(cbor_values)
def test_hand_encoded_cbor_is_canonical_cbor2(value: object) -> None:
    assert cbor_encode(value) == cbor2.dumps(value, canonical=True)
