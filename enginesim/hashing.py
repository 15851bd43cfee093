"""Engine block hashes, computed exactly as vLLM and SGLang compute them.

The simulator's prefix cache is keyed by the engine's own block hash chain, so the hashes
it publishes differ from kvroute's router keys exactly as a real engine's do, and a
sidecar that recomputes engine hashes (it should not) breaks here as it would in
production. Two chains, selected by the event format:

- **vLLM** (``sha256_cbor``, seed ``"vllm-none-hash"``, the ≥0.29 default without
  ``PYTHONHASHSEED``): ``NONE_HASH = SHA256(CBOR("vllm-none-hash"))``;
  ``h_i = SHA256(CBOR_canonical([h_{i-1}, [tokens], extra_keys_i]))`` with
  ``h_{-1} = NONE_HASH``; ``extra_keys_i`` is ``None`` except for a salted request's
  first block, where it is ``("cache_salt", salt)`` tagged (0.33) or the bare salt
  (≤0.29, used for the ``vllm-0.23`` format); a LoRA request's every block adds
  ``("lora", name, path)`` before the salt (0.33's ``_gen_lora_extra_hash_keys``; the
  bare name for ``vllm-0.23``). Published id: the digest's last 8 bytes,
  big-endian, unsigned.
- **SGLang** (≥0.5.10): ``h_i = SHA256(h_{i-1} ‖ tokens as uint32 little-endian)``,
  the first page with no prior digest, or ``SHA256("sglang-cache-salt-v1\\0" + salt)``
  for a salted request. Published id: the digest's first 8 bytes as a signed int64.
  A LoRA request's chain starts from ``SHA256("sglang-lora\\0" + lora_id)`` (salted:
  of the salt's seed too), the simulator's stand-in for SGLang's ``extra_key``
  namespace, so an adapter's pages never share a hash with the base model's.

CBOR is hand-encoded: the values are only unsigned ints, byte and text strings, arrays
and null, and canonical CBOR for those is just shortest-form lengths.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from typing import Protocol

from enginesim.request import LoraTag

VLLM_SEED = "vllm-none-hash"
_SGLANG_SALT_TAG = b"sglang-cache-salt-v1\0"
_SGLANG_LORA_TAG = b"sglang-lora\0"
_U64 = (1 << 64) - 1


class BlockHasher(Protocol):
    """One engine's block hash chain."""

    def block_digest(
        self,
        parent: bytes | None,
        tokens: Sequence[int],
        salt: str | None,
        lora: LoraTag | None = None,
    ) -> bytes:
        """Digest of one full block; ``parent`` is None for a prompt's first block,
        ``salt`` is given only for the first block of a salted request, ``lora`` for
        every block of a LoRA request."""
        ...

    def event_id(self, digest: bytes) -> int:
        """The integer the engine publishes for ``digest`` in its KV events."""
        ...


def _head(major: int, n: int) -> bytes:
    if n < 24:
        return bytes((major << 5 | n,))
    if n < 0x100:
        return bytes((major << 5 | 24, n))
    if n < 0x10000:
        return bytes((major << 5 | 25,)) + n.to_bytes(2, "big")
    if n < 0x100000000:
        return bytes((major << 5 | 26,)) + n.to_bytes(4, "big")
    return bytes((major << 5 | 27,)) + n.to_bytes(8, "big")


_SMALL_UINTS = [_head(0, n) for n in range(0x10000)]


def cbor_encode(value: object) -> bytes:
    """Canonical CBOR of None, unsigned ints, bytes, str and tuples/lists of those."""
    if value is None:
        return b"\xf6"
    if isinstance(value, bool):
        return b"\xf5" if value else b"\xf4"
    if isinstance(value, int):
        if value < 0:
            return _head(1, -1 - value)
        return _SMALL_UINTS[value] if value < 0x10000 else _head(0, value)
    if isinstance(value, bytes):
        return _head(2, len(value)) + value
    if isinstance(value, str):
        raw = value.encode("utf-8")
        return _head(3, len(raw)) + raw
    if isinstance(value, list | tuple):
        return _head(4, len(value)) + b"".join(cbor_encode(item) for item in value)
    raise TypeError(f"cannot CBOR-encode {type(value).__name__}")


def _cbor_tokens(tokens: Sequence[int]) -> bytes:
    small = _SMALL_UINTS
    parts = [small[t] if 0 <= t < 0x10000 else cbor_encode(t) for t in tokens]
    return _head(4, len(tokens)) + b"".join(parts)


class VllmSha256CborHasher:
    """vLLM's ``sha256_cbor`` chain; ``tagged_salt`` selects 0.33's ``("cache_salt", s)``."""

    def __init__(self, *, seed: str = VLLM_SEED, tagged_salt: bool = True) -> None:
        self.none_hash = hashlib.sha256(cbor_encode(seed)).digest()
        self.tagged_salt = tagged_salt

    def extra_keys(
        self, salt: str | None, lora: LoraTag | None = None
    ) -> tuple[object, ...] | None:
        """A block's extra keys as they enter the hash: the adapter's, then the salt's."""
        keys: list[object] = []
        if lora is not None:
            keys.append(("lora", lora.name, lora.path) if self.tagged_salt else lora.name)
        if salt is not None:
            keys.append(("cache_salt", salt) if self.tagged_salt else salt)
        return tuple(keys) or None

    def block_digest(
        self,
        parent: bytes | None,
        tokens: Sequence[int],
        salt: str | None,
        lora: LoraTag | None = None,
    ) -> bytes:
        prior = self.none_hash if parent is None else parent
        payload = b"\x83" + cbor_encode(prior) + _cbor_tokens(tokens)
        payload += cbor_encode(self.extra_keys(salt, lora))
        return hashlib.sha256(payload).digest()

    def event_id(self, digest: bytes) -> int:
        return int.from_bytes(digest, "big") & _U64


class SglangSha256Hasher:
    """SGLang's chained SHA-256 over little-endian uint32 tokens (≥0.5.10)."""

    def block_digest(
        self,
        parent: bytes | None,
        tokens: Sequence[int],
        salt: str | None,
        lora: LoraTag | None = None,
    ) -> bytes:
        h = hashlib.sha256()
        if parent is not None:
            h.update(parent)
        else:
            if lora is not None:
                h.update(hashlib.sha256(_SGLANG_LORA_TAG + str(lora.int_id).encode()).digest())
            if salt is not None:
                h.update(hashlib.sha256(_SGLANG_SALT_TAG + salt.encode("utf-8")).digest())
        h.update(_sglang_token_bytes(tokens))
        return h.digest()

    def event_id(self, digest: bytes) -> int:
        return int.from_bytes(digest[:8], "big", signed=True)


def _sglang_token_bytes(tokens: Sequence[int]) -> bytes:
    if all(0 <= t < 1 << 32 for t in tokens):
        return struct.pack(f"<{len(tokens)}I", *tokens)
    return b"".join(
        struct.pack("<I", t) if 0 <= t < 1 << 32 else b"\xff" + struct.pack("<Q", t & _U64)
        for t in tokens
    )


def prompt_digests(
    hasher: BlockHasher,
    tokens: Sequence[int],
    block_size: int,
    salt: str | None,
    lora: LoraTag | None = None,
) -> list[bytes]:
    """Digests of every full block of ``tokens``, chained from the root."""
    digests: list[bytes] = []
    parent: bytes | None = None
    for start in range(0, len(tokens) - block_size + 1, block_size):
        parent = hasher.block_digest(parent, tokens[start : start + block_size], salt, lora)
        digests.append(parent)
        salt = None
    return digests
