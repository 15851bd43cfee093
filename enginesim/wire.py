"""KV event payloads, byte for byte as vLLM and SGLang encode them.

Every format is msgpack (msgspec); the outer batch is always a positional array
``[ts, events, rank]``. Only the events differ:

``vllm`` (vLLM ≥0.24, modelled on 0.33): each event a map tagged under ``"type"``,
fields in declaration order, fields equal to their ``None`` default omitted; fields
without a default (``parent_block_hash``, ``lora_id``, ``medium``, ``lora_name``) always
present::

    {"type": "BlockStored", "block_hashes": [u64...], "parent_block_hash": u64|nil,
     "token_ids": [...], "block_size": 16, "lora_id": nil, "medium": "GPU",
     "lora_name": nil, ["extra_keys": [[lora_name?, salt?] | nil, ...],] "group_idx": 0,
     "kv_cache_spec_kind": "full_attention"}
    {"type": "BlockRemoved", "block_hashes": [u64], "medium": "GPU", "group_idx": 0}
    {"type": "AllBlocksCleared"}

``vllm-0.23`` (vLLM 0.23.0): every event a positional array, tag first, every field
always present (``array_like`` ignores ``omit_defaults``)::

    ["BlockStored", hashes, parent, token_ids, block_size, lora_id, medium, lora_name,
     extra_keys, group_idx, kv_cache_spec_kind, kv_cache_spec_sliding_window]   # 12
    ["BlockRemoved", hashes, medium, group_idx]                                 # 4
    ["AllBlocksCleared"]

``sglang`` (SGLang 0.5.23): maps tagged under ``"type"``, ``omit_defaults``; hashes are
signed int64; ``block_size`` is the page size; the salt travels as ``cache_salt``;
consecutive removals are coalesced into one event, as SGLang's recorder does::

    {"type": "BlockStored", "block_hashes": [i64...], "parent_block_hash": i64|nil,
     "token_ids": [...], "block_size": P, "lora_id": nil, "medium": "GPU",
     ["cache_salt": salt,] ["lora_name": name]}
    {"type": "BlockRemoved", "block_hashes": [i64...], "medium": "GPU"}
    {"type": "AllBlocksCleared"}

A LoRA request's blocks carry its adapter: vLLM's ``lora_id`` (the adapter's int id) and
``lora_name``, and the name first in each block's ``extra_keys``; SGLang's ``lora_name``
(its ``lora_id`` stays nil, as SGLang's recorder leaves it).

vLLM publishes one removal per evicted block; the batch's rank is 0 (one engine core).

The payloads are encoded from msgspec structs declared like the engines' own (same
field order, defaults and options), so the bytes are the engines' bytes down to
msgspec's map-header width: vLLM 0.33's ``BlockStored`` has 16 possible keys, so its map
always carries a map16 header even when defaults are omitted.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol

import msgspec

from enginesim.hashing import BlockHasher, SglangSha256Hasher, VllmSha256CborHasher
from enginesim.kv_manager import BlockEvicted, BlocksStored, PoolEvent

EventFormatName = Literal["vllm", "vllm-0.23", "sglang"]
EVENT_FORMATS: tuple[EventFormatName, ...] = ("vllm", "vllm-0.23", "sglang")
MEDIUM = "GPU"
SPEC_KIND = "full_attention"

_encoder = msgspec.msgpack.Encoder()


class EventFormat(Protocol):
    name: EventFormatName
    hasher: BlockHasher

    def encode_batch(self, ts: float, events: Sequence[PoolEvent]) -> bytes: ...


# -- vLLM >= 0.24, as declared in 0.33 --------------------------------------------------


class _VllmEvent(msgspec.Struct, tag=True, omit_defaults=True, gc=False):
    pass


class _VllmBlockStored(_VllmEvent, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[list[str] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None
    lookahead_token_ids: list[list[int]] | None = None


class _VllmBlockRemoved(_VllmEvent, tag="BlockRemoved"):
    block_hashes: list[int]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class _VllmAllBlocksCleared(_VllmEvent, tag="AllBlocksCleared"):
    pass


# -- vLLM 0.23 ------------------------------------------------------------------------


class _V023Event(msgspec.Struct, array_like=True, tag=True, omit_defaults=True, gc=False):
    pass


class _V023BlockStored(_V023Event, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[list[str] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class _V023BlockRemoved(_V023Event, tag="BlockRemoved"):
    block_hashes: list[int]
    medium: str | None
    group_idx: int | None = None


class _V023AllBlocksCleared(_V023Event, tag="AllBlocksCleared"):
    pass


# -- SGLang 0.5.23 --------------------------------------------------------------------


class _SgEvent(msgspec.Struct, tag=True, omit_defaults=True, gc=False):
    pass


class _SgBlockStored(_SgEvent, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None = None
    cache_salt: str | None = None
    session_id: str | None = None
    lora_name: str | None = None


class _SgBlockRemoved(_SgEvent, tag="BlockRemoved"):
    block_hashes: list[int]
    medium: str | None = None


class _SgAllBlocksCleared(_SgEvent, tag="AllBlocksCleared"):
    pass


class _Batch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    rank: int | None = None


def _extra_keys(event: BlocksStored) -> list[list[str] | None] | None:
    """Each block's extra keys as vLLM publishes them, untagged: the adapter's name on
    every block of a LoRA request, then the salt on a salted request's first block."""
    lora, salt = event.lora, event.salt
    if salt is None and lora is None:
        return None
    keys: list[list[str] | None] = [[lora.name] if lora else None for _ in event.digests]
    if salt is not None:
        keys[0] = [*(keys[0] or []), salt]
    return keys


class _Base:
    name: EventFormatName

    def __init__(self, hasher: BlockHasher, block_size: int) -> None:
        self.hasher = hasher
        self.block_size = block_size

    def _ids(self, digests: Sequence[bytes]) -> list[int]:
        return [self.hasher.event_id(d) for d in digests]

    def _parent(self, event: BlocksStored) -> int | None:
        return None if event.parent is None else self.hasher.event_id(event.parent)

    def encode_batch(self, ts: float, events: Sequence[PoolEvent]) -> bytes:
        return _encoder.encode(_Batch(ts, self.encode_events(events), 0))

    def encode_events(self, events: Sequence[PoolEvent]) -> list[Any]:
        out: list[Any] = []
        for event in events:
            if isinstance(event, BlocksStored):
                out.append(self.stored(event))
            elif isinstance(event, BlockEvicted):
                out.append(self.removed([event.digest]))
            else:
                out.append(self.cleared())
        return out

    def stored(self, event: BlocksStored) -> Any:
        raise NotImplementedError

    def removed(self, digests: Sequence[bytes]) -> Any:
        raise NotImplementedError

    def cleared(self) -> Any:
        raise NotImplementedError


@dataclass(frozen=True, slots=True)
class _VllmStructs:
    """One vLLM era's event structs: the fields are the same, the layout is not."""

    stored: Callable[..., Any]
    removed: Callable[..., Any]
    cleared: Callable[[], Any]


_VLLM_MAPS = _VllmStructs(_VllmBlockStored, _VllmBlockRemoved, _VllmAllBlocksCleared)
_VLLM_0_23_ARRAYS = _VllmStructs(_V023BlockStored, _V023BlockRemoved, _V023AllBlocksCleared)


class VllmFormat(_Base):
    """vLLM: maps (>= 0.24) or positional arrays (0.23), as its structs say (see the
    module docstring)."""

    def __init__(
        self, name: EventFormatName, structs: _VllmStructs, hasher: BlockHasher, block_size: int
    ) -> None:
        super().__init__(hasher, block_size)
        self.name = name
        self._structs = structs

    def stored(self, event: BlocksStored) -> Any:
        return self._structs.stored(
            block_hashes=self._ids(event.digests),
            parent_block_hash=self._parent(event),
            token_ids=list(event.token_ids),
            block_size=self.block_size,
            lora_id=event.lora.int_id if event.lora else None,
            medium=MEDIUM,
            lora_name=event.lora.name if event.lora else None,
            extra_keys=_extra_keys(event),
            group_idx=0,
            kv_cache_spec_kind=SPEC_KIND,
        )

    def removed(self, digests: Sequence[bytes]) -> Any:
        return self._structs.removed(block_hashes=self._ids(digests), medium=MEDIUM, group_idx=0)

    def cleared(self) -> Any:
        return self._structs.cleared()


class SglangFormat(_Base):
    """SGLang 0.5.23: maps, signed hashes, coalesced removals (see the module docstring)."""

    name: EventFormatName = "sglang"

    def encode_events(self, events: Sequence[PoolEvent]) -> list[Any]:
        out: list[Any] = []
        pending: list[bytes] = []
        for event in events:
            if isinstance(event, BlockEvicted):
                pending.append(event.digest)
                continue
            if pending:
                out.append(self.removed(pending))
                pending = []
            out.append(self.stored(event) if isinstance(event, BlocksStored) else self.cleared())
        if pending:
            out.append(self.removed(pending))
        return out

    def stored(self, event: BlocksStored) -> _SgBlockStored:
        return _SgBlockStored(
            block_hashes=self._ids(event.digests),
            parent_block_hash=self._parent(event),
            token_ids=list(event.token_ids),
            block_size=self.block_size,
            lora_id=None,
            medium=MEDIUM,
            cache_salt=event.salt,
            lora_name=event.lora.name if event.lora else None,
        )

    def removed(self, digests: Sequence[bytes]) -> _SgBlockRemoved:
        return _SgBlockRemoved(block_hashes=self._ids(digests), medium=MEDIUM)

    def cleared(self) -> _SgAllBlocksCleared:
        return _SgAllBlocksCleared()


def make_format(name: EventFormatName, block_size: int) -> EventFormat:
    """The event format ``name`` with the hash chain that engine uses."""
    if name == "vllm":
        return VllmFormat(name, _VLLM_MAPS, VllmSha256CborHasher(tagged_salt=True), block_size)
    if name == "vllm-0.23":
        hasher = VllmSha256CborHasher(tagged_salt=False)
        return VllmFormat(name, _VLLM_0_23_ARRAYS, hasher, block_size)
    if name == "sglang":
        return SglangFormat(SglangSha256Hasher(), block_size)
    raise ValueError(f"unknown event format {name!r}; choose from {EVENT_FORMATS}")
