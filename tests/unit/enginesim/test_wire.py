"""Event payloads decode strictly with structs written from the reference tables, and
re-encode to the very same bytes (what vLLM's and SGLang's own structs would send)."""

from __future__ import annotations

import msgspec
import pytest

from enginesim.hashing import prompt_digests
from enginesim.kv_manager import AllCleared, BlockEvicted, BlocksStored
from enginesim.wire import EVENT_FORMATS, make_format
from tests.unit.enginesim.wire_structs import decode_batch

TOKENS = list(range(48))


def sample_events(fmt_name: str, salt: str | None = None):
    fmt = make_format(fmt_name, 16)  # type: ignore[arg-type]
    digests = prompt_digests(fmt.hasher, TOKENS, 16, salt)
    events = [
        BlocksStored(tuple(digests[:2]), None, tuple(TOKENS[:32]), salt),
        BlocksStored((digests[2],), digests[1], tuple(TOKENS[32:]), None),
        BlockEvicted(digests[2]),
        BlockEvicted(digests[1]),
        AllCleared(),
    ]
    return fmt, digests, events


@pytest.mark.parametrize("name", EVENT_FORMATS)
def test_batches_decode_strictly_and_round_trip_byte_exact(name: str) -> None:
    fmt, _, events = sample_events(name, salt="tenant-a")
    payload = fmt.encode_batch(1.5, events)
    batch = decode_batch(name, payload)
    assert batch.ts == 1.5
    assert msgspec.msgpack.encode(batch) == payload


def test_vllm_map_format_fields() -> None:
    fmt, digests, events = sample_events("vllm", salt="tenant-a")
    raw = msgspec.msgpack.decode(fmt.encode_batch(2.0, events))
    assert raw[0] == 2.0 and raw[2] == 0
    first, second, removed, _, cleared = raw[1]
    assert first == {
        "type": "BlockStored",
        "block_hashes": [int.from_bytes(d[-8:], "big") for d in digests[:2]],
        "parent_block_hash": None,
        "token_ids": TOKENS[:32],
        "block_size": 16,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
        "extra_keys": [["tenant-a"], None],
        "group_idx": 0,
        "kv_cache_spec_kind": "full_attention",
    }
    assert "extra_keys" not in second
    assert second["parent_block_hash"] == first["block_hashes"][1]
    assert removed == {
        "type": "BlockRemoved",
        "block_hashes": [second["block_hashes"][0]],
        "medium": "GPU",
        "group_idx": 0,
    }
    assert cleared == {"type": "AllBlocksCleared"}


def test_vllm_023_events_are_fixed_length_arrays() -> None:
    fmt, _, events = sample_events("vllm-0.23", salt="s")
    raw = msgspec.msgpack.decode(fmt.encode_batch(1.0, events))
    lengths = [(e[0], len(e)) for e in raw[1]]
    assert lengths == [
        ("BlockStored", 12),
        ("BlockStored", 12),
        ("BlockRemoved", 4),
        ("BlockRemoved", 4),
        ("AllBlocksCleared", 1),
    ]
    assert raw[1][0][8] == [["s"], None]


def test_sglang_format_signed_ids_salt_and_coalesced_removals() -> None:
    fmt, digests, events = sample_events("sglang", salt="tenant-a")
    raw = msgspec.msgpack.decode(fmt.encode_batch(1.0, events))
    stored, _, removed, cleared = raw[1]
    assert stored["block_hashes"][0] == int.from_bytes(digests[0][:8], "big", signed=True)
    assert stored["cache_salt"] == "tenant-a"
    assert removed["block_hashes"] == [
        int.from_bytes(d[:8], "big", signed=True) for d in (digests[2], digests[1])
    ]
    assert cleared == {"type": "AllBlocksCleared"}


def test_hashes_at_or_above_2_63_are_uint64_on_the_wire() -> None:
    fmt = make_format("vllm", 16)
    digest = b"\x00" * 24 + b"\xff" * 8
    payload = fmt.encode_batch(0.0, [BlockEvicted(digest)])
    assert b"\xcf" + b"\xff" * 8 in payload
    assert decode_batch("vllm", payload).events[0].block_hashes == [2**64 - 1]
