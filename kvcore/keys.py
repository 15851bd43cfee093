"""Router block keys: the one key space the whole router shares.

Engines publish block hashes that depend on the engine, its version, its hash algorithm
and a seed, which a proxy cannot reproduce. kvroute therefore keys blocks its own way,
identically in the sidecar (from the token ids an engine's ``BlockStored`` carries) and
in the proxy (from the tokenized prompt):

- the prompt's token ids are cut into blocks of ``block_size`` tokens; a partial
  trailing block has no key;
- ``key_i = xxh3_64(block_i as little-endian uint32 bytes, seed=key_{i-1})``, so the
  parent is the seed and no bytes are concatenated;
- ``key_{-1} = root = xxh3_64(UTF-8 "kvroute-v1\\0" + model + "\\0" + lora_name + "\\0"
  + namespace, seed=0)``: tenants (namespaces), models and LoRA adapters never share keys.

Keys are unsigned 64-bit integers (protobuf ``fixed64``). Golden vectors in
``tests/unit/kvcore/test_keys.py`` pin the function: changing it is a wire break.
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Sequence

import xxhash

DEFAULT_BLOCK_SIZE = 16
_ROOT_TAG = "kvroute-v1\0"
_hash = xxhash.xxh3_64_intdigest
_NATIVE_UINT32 = array("I").itemsize == 4 and sys.byteorder == "little"


def root_key(*, model: str, lora_name: str = "", namespace: str = "") -> int:
    """The key every prompt's first block chains from."""
    text = f"{_ROOT_TAG}{model}\0{lora_name}\0{namespace}"
    return _hash(text.encode("utf-8"), seed=0)


def token_bytes(token_ids: Sequence[int]) -> bytes:
    """``token_ids`` as little-endian uint32; raises ``ValueError`` for ids out of range."""
    if _NATIVE_UINT32 and type(token_ids) is array and token_ids.typecode == "I":
        return token_ids.tobytes()  # already uint32 in memory: one copy, not two
    try:
        packed = array("I", token_ids)
    except OverflowError as exc:
        raise ValueError("token ids must be integers in [0, 2**32)") from exc
    if packed.itemsize != 4:  # pragma: no cover - no mainstream platform has this
        packed = array("L", token_ids)
    if sys.byteorder != "little":  # pragma: no cover
        packed.byteswap()
    return packed.tobytes()


def chain_keys(
    parent: int, token_ids: Sequence[int], block_size: int = DEFAULT_BLOCK_SIZE
) -> list[int]:
    """Keys of the full blocks of ``token_ids``, chained from the key ``parent``."""
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    data = token_bytes(token_ids)  # sliced as bytes: cheaper than a memoryview per block
    stride = 4 * block_size
    keys: list[int] = []
    key = parent
    for start in range(0, len(data) - stride + 1, stride):
        key = _hash(data[start : start + stride], key)
        keys.append(key)
    return keys


def block_keys(
    token_ids: Sequence[int],
    *,
    model: str,
    lora_name: str = "",
    namespace: str = "",
    block_size: int = DEFAULT_BLOCK_SIZE,
) -> list[int]:
    """Router block keys of a prompt: one per full block, in prompt order."""
    root = root_key(model=model, lora_name=lora_name, namespace=namespace)
    return chain_keys(root, token_ids, block_size)
