"""kvcore engine events rendered in every engine wire format this sidecar reads.

The inverse of the adapters, for the test suite and the benchmarks, which must produce
byte-exact engine frames without running vLLM or SGLang. Each format is named after the
first engine release that used its layout (``vllm-0.23``, ``sglang-0.5.19``, ...); the
layouts are the adapters' field tables. A field an older layout cannot carry (a cache
salt before vLLM 0.18, a LoRA name before 0.14) raises ``ValueError`` rather than being
dropped silently.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import msgspec

from kvcore.engine_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EngineEvent,
)

HashStyle = Literal["uint", "int64", "bytes"]


@dataclass(frozen=True, slots=True)
class WireFormat:
    name: str
    engine: Literal["vllm", "sglang"]
    stored_len: int  # array length counting the tag; 0 = map-encoded events
    removed_len: int
    batch_len: int  # 2 or 3
    salt: Literal["none", "bare", "tagged", "metadata", "field"]
    lora: Literal["id", "name"]
    hash_style: HashStyle = "uint"


FORMATS: dict[str, WireFormat] = {
    fmt.name: fmt
    for fmt in (
        WireFormat("vllm-0.9.0", "vllm", 6, 2, 2, "none", "id", "int64"),
        WireFormat("vllm-0.10.2", "vllm", 7, 3, 3, "none", "id"),
        WireFormat("vllm-0.14", "vllm", 8, 3, 3, "none", "name"),
        WireFormat("vllm-0.18", "vllm", 9, 3, 3, "bare", "name"),
        WireFormat("vllm-0.21", "vllm", 10, 4, 3, "bare", "name"),
        WireFormat("vllm-0.23", "vllm", 12, 4, 3, "bare", "name"),
        WireFormat("vllm-0.29", "vllm", 0, 0, 3, "bare", "name"),
        WireFormat("vllm-0.33", "vllm", 0, 0, 3, "tagged", "name"),
        WireFormat("vllm-0.33-bytes", "vllm", 0, 0, 3, "tagged", "name", "bytes"),
        WireFormat("sglang-0.5.5", "sglang", 6, 2, 3, "none", "id", "int64"),
        WireFormat("sglang-0.5.10", "sglang", 7, 3, 3, "none", "id", "int64"),
        WireFormat("sglang-0.5.19", "sglang", 8, 3, 3, "metadata", "id", "int64"),
        WireFormat("sglang-0.5.23", "sglang", 0, 0, 3, "field", "name", "int64"),
    )
}


def render_hash(value: int, style: HashStyle) -> int | bytes:
    if style == "int64":
        return value - (1 << 64) if value >= 1 << 63 else value
    if style == "bytes":
        return bytes(24) + value.to_bytes(8, "big")
    return value


def _lora_fields(event: BlockStored, fmt: WireFormat) -> tuple[int | None, str | None]:
    if not event.lora_name:
        return None, None
    if fmt.lora == "name":
        return None, event.lora_name
    if event.lora_name.startswith("lora-") and event.lora_name[5:].isdigit():
        return int(event.lora_name[5:]), None
    raise ValueError(f"{fmt.name} carries only a LoRA id, not the name {event.lora_name!r}")


def _extra_keys(event: BlockStored, fmt: WireFormat) -> list[Any] | None:
    if not event.namespace or fmt.salt not in ("bare", "tagged"):
        return None
    salt: Any = event.namespace if fmt.salt == "bare" else ["cache_salt", event.namespace]
    first = [event.lora_name, salt] if event.lora_name else [salt]
    return [first] + [None] * (len(event.block_hashes) - 1)


def _stored_fields(event: BlockStored, fmt: WireFormat) -> dict[str, Any]:
    if event.namespace and (fmt.salt == "none" or event.parent_hash is not None):
        raise ValueError(f"{fmt.name} cannot carry a cache salt here")
    lora_id, lora_name = _lora_fields(event, fmt)
    fields: dict[str, Any] = {
        "block_hashes": [render_hash(h, fmt.hash_style) for h in event.block_hashes],
        "parent_block_hash": None
        if event.parent_hash is None
        else render_hash(event.parent_hash, fmt.hash_style),
        "token_ids": list(event.token_ids),
        "block_size": event.block_size,
        "lora_id": lora_id,
        "medium": event.medium,
    }
    if fmt.engine == "vllm":
        fields |= {"lora_name": lora_name, "extra_keys": _extra_keys(event, fmt)}
        fields |= {"group_idx": event.group, "kv_cache_spec_kind": "full_attention"}
        fields["kv_cache_spec_sliding_window"] = None
    elif fmt.salt == "metadata":
        fields["metadata"] = {"cache_salt": event.namespace} if event.namespace else None
    else:
        fields |= {"cache_salt": event.namespace or None, "lora_name": lora_name}
    return fields


def _removed_fields(event: BlockRemoved, fmt: WireFormat) -> dict[str, Any]:
    return {
        "block_hashes": [render_hash(h, fmt.hash_style) for h in event.block_hashes],
        "medium": event.medium,
        "group_idx": event.group,
    }


def _as_array(tag: str, fields: dict[str, Any], length: int, fmt: WireFormat) -> list[Any]:
    values = [tag, *fields.values()][:length]
    if tag == "BlockStored" and fmt.salt == "metadata" and fields.get("metadata") is None:
        values = values[:7]  # SGLang 0.5.19 adds metadata only to salted stores
    return values


def _as_map(tag: str, fields: dict[str, Any]) -> dict[str, Any]:
    return {"type": tag} | {k: v for k, v in fields.items() if v is not None or k in _REQUIRED}


_REQUIRED = ("parent_block_hash", "lora_id", "medium", "lora_name")


def render_event(event: EngineEvent, fmt: WireFormat) -> Any:
    if isinstance(event, AllBlocksCleared):
        return {"type": "AllBlocksCleared"} if fmt.stored_len == 0 else ["AllBlocksCleared"]
    if isinstance(event, BlockStored):
        tag, fields, length = "BlockStored", _stored_fields(event, fmt), fmt.stored_len
    else:
        tag, fields, length = "BlockRemoved", _removed_fields(event, fmt), fmt.removed_len
    return _as_map(tag, fields) if length == 0 else _as_array(tag, fields, length, fmt)


def encode_batch(
    events: Sequence[EngineEvent], fmt: WireFormat | str, *, ts: float = 1.5, rank: int = 0
) -> bytes:
    """One engine batch payload (ZMQ frame 2) in format ``fmt``."""
    wire = FORMATS[fmt] if isinstance(fmt, str) else fmt
    rendered = [render_event(event, wire) for event in events]
    batch: list[Any] = [ts, rendered, rank][: wire.batch_len]
    return msgspec.msgpack.encode(batch)
