"""msgspec structs written from the reference tables (kv-events.md §1.5 and §3), as vLLM
and SGLang declare them, used to decode the simulator's bytes strictly.

``forbid_unknown_fields`` is stricter than the engines: a field the simulator adds that
the engine would not send fails the decode.
"""

from __future__ import annotations

from typing import Any

import msgspec

# -- vLLM >= 0.24 (0.33 field set): inner events are maps tagged under "type" ----------


class VllmEvent(msgspec.Struct, tag=True, omit_defaults=True, forbid_unknown_fields=True):
    pass


class BlockStored(VllmEvent):
    block_hashes: list[int | bytes]
    parent_block_hash: int | bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None
    lookahead_token_ids: list[list[int]] | None = None


class BlockRemoved(VllmEvent):
    block_hashes: list[int | bytes]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(VllmEvent):
    pass


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
    data_parallel_rank: int | None = None


# -- vLLM 0.23: every event a positional array, tag first -----------------------------


class Vllm023Event(msgspec.Struct, array_like=True, tag=True, omit_defaults=True):
    pass


class BlockStored023(Vllm023Event, tag="BlockStored"):
    block_hashes: list[int | bytes]
    parent_block_hash: int | bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class BlockRemoved023(Vllm023Event, tag="BlockRemoved"):
    block_hashes: list[int | bytes]
    medium: str | None
    group_idx: int | None = None


class AllBlocksCleared023(Vllm023Event, tag="AllBlocksCleared"):
    pass


class KVEventBatch023(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[BlockStored023 | BlockRemoved023 | AllBlocksCleared023]
    data_parallel_rank: int | None = None


# -- SGLang 0.5.23: maps tagged under "type", signed int64 hashes ----------------------


class SglangEvent(msgspec.Struct, tag=True, omit_defaults=True, forbid_unknown_fields=True):
    pass


class SgBlockStored(SglangEvent, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None = None
    cache_salt: str | None = None
    session_id: str | None = None
    lora_name: str | None = None


class SgBlockRemoved(SglangEvent, tag="BlockRemoved"):
    block_hashes: list[int]
    medium: str | None = None


class SgAllBlocksCleared(SglangEvent, tag="AllBlocksCleared"):
    pass


class SgKVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[SgBlockStored | SgBlockRemoved | SgAllBlocksCleared]
    attn_dp_rank: int | None = None


BATCH_TYPES: dict[str, type[msgspec.Struct]] = {
    "vllm": KVEventBatch,
    "vllm-0.23": KVEventBatch023,
    "sglang": SgKVEventBatch,
}


def decode_batch(fmt: str, payload: bytes) -> Any:
    """Strictly decode ``payload`` with the structs of format ``fmt``."""
    return msgspec.msgpack.decode(payload, type=BATCH_TYPES[fmt], strict=True)


def replay_state(fmt: str, payloads: list[bytes]) -> set[int]:
    """The set of cached block ids that a subscriber of these batches would hold."""
    held: set[int] = set()
    for payload in payloads:
        for event in decode_batch(fmt, payload).events:
            name = type(event).__name__
            if name.startswith(("BlockStored", "SgBlockStored")):
                held.update(event.block_hashes)
            elif name.startswith(("BlockRemoved", "SgBlockRemoved")):
                held.difference_update(event.block_hashes)
            else:
                held.clear()
    return held
