"""Engine KV-cache events, engine-neutral: what every engine adapter decodes into.

vLLM and SGLang publish the same three facts in a dozen wire layouts (see the sidecar's
adapters for the field tables). An adapter turns one raw batch into these plain values,
so that the key mapper, the tests and the benchmarks never see an engine format:

- :class:`BlockStored` -- full (or, for SGLang, possibly partial) blocks entered the cache,
  chained after ``parent_hash`` (``None``: the run starts at the prompt's first token);
- :class:`BlockRemoved` -- blocks left the cache;
- :class:`AllBlocksCleared` -- the engine dropped its whole cache.

Engine hashes are normalised to unsigned 64-bit integers (:func:`normalize_hash`); media
to one of :data:`MEDIA`. Nothing here does I/O.
"""

from __future__ import annotations

from dataclasses import dataclass, field

U64_MASK = (1 << 64) - 1

MEDIUM_GPU = "GPU"
MEDIUM_CPU = "CPU"
MEDIUM_DISK = "DISK"
MEDIUM_OTHER = "OTHER"
MEDIA = (MEDIUM_GPU, MEDIUM_CPU, MEDIUM_DISK, MEDIUM_OTHER)

# What engines call their tiers (vLLM 0.10.2-0.33, SGLang StorageMedium), by tier.
_MEDIUM_ALIASES = {
    "GPU": MEDIUM_GPU,
    "CPU": MEDIUM_CPU,
    "CPU_PINNED": MEDIUM_CPU,
    "DISK": MEDIUM_DISK,
    "FS": MEDIUM_DISK,
    "STORAGE": MEDIUM_DISK,
}


class InvalidEngineValue(ValueError):
    """A field of an engine event has a value no engine version produces."""


def normalize_hash(value: object) -> int:
    """An engine block hash as an unsigned 64-bit integer.

    Accepts what engines publish: unsigned 64-bit ints (possibly >= 2**63), signed int64
    (SGLang, vLLM <= 0.10.1 builtin hash) kept as their 64-bit pattern, and raw digest
    bytes (vLLM with ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0``) reduced to their last 8
    bytes read big-endian, as vLLM's own int conversion does.
    """
    if isinstance(value, bool):
        raise InvalidEngineValue("a block hash cannot be a boolean")
    if isinstance(value, int):
        if not -(1 << 63) <= value <= U64_MASK:
            raise InvalidEngineValue(f"block hash {value} does not fit in 64 bits")
        return value & U64_MASK
    if isinstance(value, bytes | bytearray | memoryview):
        raw = bytes(value)
        if not raw:
            raise InvalidEngineValue("a block hash cannot be empty bytes")
        return int.from_bytes(raw[-8:], "big")
    raise InvalidEngineValue(f"a block hash must be an int or bytes, not {type(value).__name__}")


def normalize_medium(value: object) -> str:
    """An engine's storage tier name as one of :data:`MEDIA`; ``None`` means the GPU."""
    if value is None:
        return MEDIUM_GPU
    if not isinstance(value, str):
        raise InvalidEngineValue(f"medium must be a string, not {type(value).__name__}")
    return _MEDIUM_ALIASES.get(value.upper(), MEDIUM_OTHER)


@dataclass(frozen=True, slots=True)
class BlockStored:
    """Blocks that entered the cache, in chain order.

    ``token_ids`` holds the tokens of all ``block_hashes`` (``block_size`` each; for
    SGLang the last block may be shorter). ``namespace`` and ``lora_name`` only matter
    when ``parent_hash`` is ``None``: a chained run inherits them from its parent.
    ``opaque_from`` is the index of the first block whose engine hash depends on more
    than its tokens, LoRA and salt (a multimodal input, prompt embeddings, or extra keys
    that cannot be told apart from a salt): router keys are computed from token ids
    alone, so that block and every block chained after it cannot be keyed.
    """

    block_hashes: tuple[int, ...]
    parent_hash: int | None
    token_ids: tuple[int, ...]
    block_size: int
    medium: str = MEDIUM_GPU
    group: int = 0
    lora_name: str = ""
    namespace: str = ""
    opaque_from: int | None = None


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    """Blocks that left the cache."""

    block_hashes: tuple[int, ...]
    medium: str = MEDIUM_GPU
    group: int = 0


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    """The engine dropped every cached block."""


EngineEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(frozen=True, slots=True)
class EngineEventBatch:
    """One engine batch: its decodable events in order, and why the others were skipped.

    ``removals_lost`` is set when a skipped event may have been a removal (a
    ``BlockRemoved`` that could not be read, or an event whose type could not be read):
    the blocks it named may still look cached to whoever applies this batch."""

    ts: float
    events: tuple[EngineEvent, ...]
    dp_rank: int | None = None
    rejected: tuple[str, ...] = field(default_factory=tuple)
    removals_lost: bool = False
