"""Engine adapters: every wire layout of vLLM and SGLang decodes into the same events."""

from __future__ import annotations

import dataclasses

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcore.engine_events import (
    MEDIUM_CPU,
    MEDIUM_DISK,
    MEDIUM_GPU,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EngineEventBatch,
)
from sidecar.adapters import adapter_for
from sidecar.adapters.encoders import FORMATS, encode_batch
from sidecar.adapters.sglang import UNCHAINED_HASHES
from sidecar.errors import ConfigError, FrameError

BIG = (1 << 64) - 5  # a uint64 hash >= 2**63


def decode(engine: str, payload: object) -> EngineEventBatch:
    return adapter_for(engine).decode(msgspec.msgpack.encode(payload))


def sample_events(salted: bool, lora: str) -> list[BlockStored | BlockRemoved | AllBlocksCleared]:
    return [
        BlockStored(
            (11, BIG),
            None,
            tuple(range(32)),
            16,
            lora_name=lora,
            namespace="tenant-a" if salted else "",
        ),
        BlockStored((13,), BIG, tuple(range(32, 48)), 16, lora_name=lora),
        BlockRemoved((13,)),
        AllBlocksCleared(),
    ]


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_every_wire_format_decodes_to_the_events_it_encodes(name: str) -> None:
    fmt = FORMATS[name]
    salted = fmt.salt != "none"
    lora = "lora-7" if fmt.lora == "id" else "sql-adapter"
    events = sample_events(salted, lora)
    batch = adapter_for(fmt.engine).decode(encode_batch(events, fmt, ts=2.5, rank=0))
    expected = list(events)
    first = events[0]
    if name == "vllm-0.18" and salted and isinstance(first, BlockStored):
        # a bare salt there may as well be an image: the run is not keyed
        expected[0] = dataclasses.replace(first, namespace="", opaque_from=0)
    if name == "sglang-0.5.5":  # unchained page hashes: stores refused
        expected = [e for e in events if not isinstance(e, BlockStored)]
        assert batch.rejected == (UNCHAINED_HASHES, UNCHAINED_HASHES)
        assert batch.events == tuple(expected)
        return
    assert batch.events == tuple(expected)
    assert batch.rejected == ()
    assert batch.ts == 2.5


def test_vllm_0_23_array_example_from_the_reference() -> None:
    stored = ["BlockStored", [1, 2], None, list(range(32)), 16, None, "GPU"] + [None] * 5
    batch = decode("vllm", [1.5, [stored, ["BlockRemoved", [1, 2], "GPU", 0]], 0])
    assert batch.events == (
        BlockStored((1, 2), None, tuple(range(32)), 16),
        BlockRemoved((1, 2)),
    )
    assert batch.dp_rank == 0


def test_vllm_0_33_map_event_ignores_unknown_fields_and_reads_group() -> None:
    stored = {
        "type": "BlockStored",
        "block_hashes": [1, 2],
        "parent_block_hash": None,
        "token_ids": [0, 1, 2, 3],
        "block_size": 2,
        "lora_id": None,
        "medium": "CPU",
        "lora_name": None,
        "extra_keys": [["tenant-a"], None],
        "group_idx": 3,
        "kv_cache_spec_kind": "full_attention",
        "locality": "LOCAL",
        "ownership": "x",
        "session_id": "s",
        "lookahead_token_ids": [[1]],
        "future_field": {"a": 1},
    }
    (event,) = decode("vllm", [1.5, [stored], None]).events
    assert event == BlockStored((1, 2), None, (0, 1, 2, 3), 2, MEDIUM_CPU, 3, "", "tenant-a")


def test_outer_map_batch_is_tolerated() -> None:
    batch = decode("vllm", {"ts": 3.0, "events": [{"type": "AllBlocksCleared"}]})
    assert batch.events == (AllBlocksCleared(),)


def test_sglang_0_5_19_metadata_salt_example_from_the_reference() -> None:
    stored = ["BlockStored", [123], None, [1, 2], 2, None, "GPU", {"cache_salt": "tenant-a"}]
    (event,) = decode("sglang", [1.0, [stored], None]).events
    assert event == BlockStored((123,), None, (1, 2), 2, namespace="tenant-a")


def test_sglang_partial_last_page_is_accepted_but_not_by_vllm() -> None:
    stored = ["BlockStored", [1, 2], None, [5, 6, 7], 2, None, "GPU"]
    assert decode("sglang", [1.0, [stored], 0]).events[0].token_ids == (5, 6, 7)  # type: ignore[union-attr]
    assert decode("vllm", [1.0, [stored], 0]).rejected == ("token_count_mismatch",)


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        (BIG, BIG),
        (-1, (1 << 64) - 1),
        (-(1 << 63), 1 << 63),
        (b"\x00" * 24 + (0xDEADBEEF).to_bytes(8, "big"), 0xDEADBEEF),
        (b"\x01\x02", 0x0102),
    ],
)
def test_hashes_normalise_to_unsigned_64_bit(raw: object, expected: int) -> None:
    (event,) = decode("vllm", [1.0, [["BlockRemoved", [raw], "GPU"]], 0]).events
    assert event == BlockRemoved((expected,))


@pytest.mark.parametrize(
    ("event", "reason"),
    [
        (["BlockStored", [1], None, list(range(16))], "missing_field"),
        (["BlockStored", [1], None, list(range(16)), 0, None], "bad_field"),
        (["BlockStored", [1.5], None, list(range(16)), 16, None], "bad_hash"),
        (["BlockStored", [True], None, list(range(16)), 16, None], "bad_hash"),
        (["BlockStored", [1], None, [-1] * 16, 16, None], "bad_tokens"),
        (["BlockStored", [1], None, ["a"] * 16, 16, None], "bad_tokens"),
        (["BlockStored", [1], None, list(range(15)), 16, None], "token_count_mismatch"),
        (["BlockRemoved", "not-a-list"], "bad_hash"),
        (["BlockRemoved", [1], 42], "bad_field"),
        ({"type": "BlockRemoved"}, "missing_field"),
        ([], "bad_event_shape"),
        (7, "bad_event_shape"),
        ([17, [1]], "bad_event_shape"),
        (["Telemetry", 1, 2], "unknown_event_type"),
    ],
)
def test_a_bad_event_is_skipped_with_its_reason_and_the_good_ones_kept(
    event: object, reason: str
) -> None:
    good = ["BlockRemoved", [9], "GPU"]
    batch = decode("vllm", [1.0, [good, event, good], 0])
    assert batch.events == (BlockRemoved((9,)), BlockRemoved((9,)))
    assert batch.rejected == (reason,)


@pytest.mark.parametrize(
    "payload",
    [
        b"\xc1",
        b"",
        msgspec.msgpack.encode("text"),
        msgspec.msgpack.encode([1.0]),
        msgspec.msgpack.encode(["ts", []]),
        msgspec.msgpack.encode([1.0, {"a": 1}]),
    ],
)
def test_an_undecodable_batch_raises_frame_error(payload: bytes) -> None:
    with pytest.raises(FrameError):
        adapter_for("vllm").decode(payload)


def test_media_are_normalised_to_tiers() -> None:
    events = [["BlockRemoved", [1], m] for m in ("GPU", "cpu_pinned", "STORAGE", "OBJ", None)]
    batch = decode("sglang", [1.0, events, 0])
    assert [e.medium for e in batch.events] == [  # type: ignore[union-attr]
        MEDIUM_GPU,
        MEDIUM_CPU,
        MEDIUM_DISK,
        "OTHER",
        MEDIUM_GPU,
    ]


def test_unknown_engine_kind_is_a_config_error() -> None:
    with pytest.raises(ConfigError):
        adapter_for("tgi")


leaf = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(1 << 63), (1 << 64) - 1),
    st.floats(),
    st.text(max_size=12),
    st.binary(max_size=40),
    st.sampled_from(["BlockStored", "BlockRemoved", "AllBlocksCleared", "type", "GPU"]),
)
values = st.recursive(
    leaf,
    lambda inner: (
        st.lists(inner, max_size=8)
        | st.dictionaries(
            st.sampled_from(
                [
                    "type",
                    "block_hashes",
                    "parent_block_hash",
                    "token_ids",
                    "block_size",
                    "medium",
                    "extra_keys",
                    "cache_salt",
                    "metadata",
                    "lora_name",
                    "lora_id",
                    "group_idx",
                    "ts",
                    "events",
                ]
            )
            | st.text(max_size=5),
            inner,
            max_size=8,
        )
    ),
    max_leaves=20,
)
batches = st.tuples(st.floats(allow_nan=False), st.lists(values, max_size=6), values).map(list)


@settings(max_examples=150, deadline=None)
@given(raw=st.one_of(batches, values), engine=st.sampled_from(["vllm", "sglang"]))
def test_any_msgpack_value_decodes_or_raises_frame_error(raw: object, engine: str) -> None:
    """Whatever an engine (or the network) sends, the adapter answers with events, skips
    or a FrameError: never another exception, which would stop the sidecar."""
    try:
        batch = adapter_for(engine).decode(msgspec.msgpack.encode(raw))
    except FrameError:
        return
    for event in batch.events:
        if isinstance(event, BlockStored):
            assert all(0 <= h < 1 << 64 for h in event.block_hashes)
            assert event.block_size >= 1


def vllm_0_18_stored(
    extra_keys: object, parent: int | None = None, blocks: int = 2
) -> list[object]:
    """A vLLM 0.15-0.18 ``BlockStored`` (9 fields: extra keys, no group index)."""
    hashes = list(range(1, blocks + 1))
    return [
        "BlockStored",
        hashes,
        parent,
        list(range(16 * blocks)),
        16,
        None,
        "GPU",
        None,
        extra_keys,
    ]


def test_vllm_0_18_image_identifier_is_not_taken_for_a_cache_salt() -> None:
    """Before 0.21 an image identifier is a bare string, like the salt: ``[["img-hash"],
    None]`` is a salt or an image, so the run is not keyed under either reading."""
    (event,) = decode("vllm", [1.0, [vllm_0_18_stored([["img-hash-abc"], None])], 0]).events
    assert isinstance(event, BlockStored)
    assert event.namespace == "" and event.opaque_from == 0


def test_vllm_0_18_image_in_a_later_block_makes_it_and_the_rest_opaque() -> None:
    stored = vllm_0_18_stored([None, ["img-hash-abc"], None], blocks=3)
    (event,) = decode("vllm", [1.0, [stored], 0]).events
    assert isinstance(event, BlockStored) and event.opaque_from == 1


def test_vllm_0_18_lora_name_alone_in_extra_keys_is_keyed() -> None:
    stored = vllm_0_18_stored([["sql"], ["sql"]])
    stored[7] = "sql"
    (event,) = decode("vllm", [1.0, [stored], 0]).events
    assert isinstance(event, BlockStored)
    assert (event.lora_name, event.namespace, event.opaque_from) == ("sql", "", None)


@pytest.mark.parametrize(
    ("extra_keys", "namespace", "opaque_from"),
    [
        ([["tenant-a"], None], "tenant-a", None),  # 0.21-0.29: a bare string is the salt
        ([[["cache_salt", "tenant-a"]], None], "tenant-a", None),  # tagged (0.33)
        ([[["img-1", 0]], [["img-1", 16]]], "", 0),  # (identifier, offset): an image
        ([None, [["img-1", 3]]], "", 1),
        ([["tenant-a", ["img-1", 0]], None], "", 0),
        ([["a", "b"], None], "", 0),  # two bare strings: which is the salt?
        ([None, ["stray"]], "", 1),  # a salt only ever sits in the first block
        ([None, [b"\x01" * 32]], "", 1),  # prompt embeddings digest
        ("garbage", "", 0),
    ],
)
def test_vllm_extra_keys_other_than_lora_and_salt_make_blocks_opaque(
    extra_keys: object, namespace: str, opaque_from: int | None
) -> None:
    stored = {
        "type": "BlockStored",
        "block_hashes": [1, 2],
        "parent_block_hash": None,
        "token_ids": list(range(32)),
        "block_size": 16,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
        "extra_keys": extra_keys,
        "group_idx": 0,
    }
    (event,) = decode("vllm", [1.0, [stored], 0]).events
    assert isinstance(event, BlockStored)
    assert (event.namespace, event.opaque_from) == (namespace, opaque_from)


def test_sglang_unchained_page_hashes_are_refused() -> None:
    """SGLang 0.4.8-0.5.5 (a 6-field ``BlockStored``) hashes each page without its parent:
    a repeated token gives a repeated hash, so its stores cannot be keyed safely."""
    stored = ["BlockStored", [5, 6], None, [1, 2], 1, None]
    batch = decode("sglang", [1.0, [stored, ["BlockRemoved", [5]]], 0])
    assert batch.events == (BlockRemoved((5,)),)
    assert batch.rejected == (UNCHAINED_HASHES,)
    chained = ["BlockStored", [5, 6], None, [1, 2], 1, None, "GPU"]  # 0.5.10 on
    assert decode("sglang", [1.0, [chained], 0]).rejected == ()
