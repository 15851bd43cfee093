"""Length- and type-guarded field readers shared by the engine adapters.

Both engine families encode a batch as ``[ts, events, rank]`` (tolerantly also a map) and
each event either as a positional array with its tag first or as a map with a ``"type"``
key. The readers here turn either layout into a name -> value map and check every value
before it reaches :mod:`kvcore.engine_events`; a value no engine produces raises
:class:`~sidecar.errors.FrameError` with a short reason that becomes a metric label.
"""

from __future__ import annotations

from array import array
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec

from kvcore.engine_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EngineEvent,
    EngineEventBatch,
    InvalidEngineValue,
    normalize_hash,
    normalize_medium,
)
from sidecar.errors import FrameError

Fields = Mapping[str, Any]
EventParser = Callable[[Fields], EngineEvent]

MAX_BLOCK_SIZE = 1 << 16
_INT_ONLY = {int}
_decoder = msgspec.msgpack.Decoder()


class IgnoredEvent(Exception):
    """An event of a type the router does not use; skipped without counting it as bad."""


def decode_msgpack(payload: bytes) -> Any:
    try:
        return _decoder.decode(payload)
    except (msgspec.DecodeError, ValueError, RecursionError) as exc:
        raise FrameError("malformed_msgpack", str(exc)) from None


def batch_parts(raw: Any, rank_field: str) -> tuple[float, list[Any], int | None]:
    """``(ts, events, rank)`` of a batch encoded as ``[ts, events, rank?]`` or as a map."""
    if isinstance(raw, list):
        if not 2 <= len(raw) <= 8:
            raise FrameError("bad_batch_shape", f"batch array of length {len(raw)}")
        ts, events, rank = raw[0], raw[1], raw[2] if len(raw) > 2 else None
    elif isinstance(raw, dict):
        ts, events = raw.get("ts"), raw.get("events")
        rank = raw.get(rank_field, raw.get("data_parallel_rank"))
    else:
        raise FrameError("bad_batch_shape", f"batch is a {type(raw).__name__}")
    if isinstance(ts, bool) or not isinstance(ts, int | float):
        raise FrameError("bad_batch_shape", "ts is not a number")
    if not isinstance(events, list):
        raise FrameError("bad_batch_shape", "events is not an array")
    if rank is not None and (isinstance(rank, bool) or not isinstance(rank, int)):
        rank = None
    return float(ts), events, rank


def event_fields(raw: Any, layouts: Mapping[str, Sequence[str]]) -> tuple[str, Fields]:
    """The tag and the named fields of one event, from its array or map encoding.

    ``layouts`` names the positional fields after the tag, per tag; an array longer than
    its layout has trailing fields this sidecar does not know, which are ignored.
    """
    if isinstance(raw, dict):
        tag = raw.get("type")
        fields: Fields = raw
    elif isinstance(raw, list) and raw:
        tag = raw[0]
        names = layouts.get(tag) if isinstance(tag, str) else None
        fields = dict(zip(names or (), raw[1:], strict=False))
    else:
        raise FrameError("bad_event_shape", f"event is a {type(raw).__name__}")
    if not isinstance(tag, str):
        raise FrameError("bad_event_shape", "event tag is not a string")
    return tag, fields


def require(fields: Fields, name: str) -> Any:
    if name not in fields:
        raise FrameError("missing_field", name)
    return fields[name]


def hashes(value: Any) -> tuple[int, ...]:
    if not isinstance(value, list):
        raise FrameError("bad_hash", "block_hashes is not an array")
    if set(map(type, value)) == _INT_ONLY:  # fast path: unsigned 64-bit ints (vLLM)
        try:
            array("Q", value)
            return tuple(value)
        except OverflowError:
            pass  # negative (signed int64): normalised below
    try:
        return tuple(normalize_hash(h) for h in value)
    except InvalidEngineValue as exc:
        raise FrameError("bad_hash", str(exc)) from None


def optional_hash(value: Any) -> int | None:
    if value is None:
        return None
    try:
        return normalize_hash(value)
    except InvalidEngineValue as exc:
        raise FrameError("bad_hash", str(exc)) from None


def token_ids(value: Any) -> tuple[int, ...]:
    if not isinstance(value, list):
        raise FrameError("bad_tokens", "token_ids is not an array")
    try:
        array("I", value)  # every id an int in [0, 2**32)
    except (TypeError, OverflowError):
        raise FrameError("bad_tokens", "token ids must be integers in [0, 2**32)") from None
    return tuple(value)


def small_int(value: Any, name: str, *, default: int, low: int = 0, high: int = 1 << 31) -> int:
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise FrameError("bad_field", f"{name}={value!r}")
    return value


def text(value: Any, name: str) -> str:
    if value is None:
        return ""
    if not isinstance(value, str):
        raise FrameError("bad_field", f"{name} is not a string")
    return value


def lora_name(fields: Fields) -> str:
    """The adapter's name, else ``"lora-<id>"`` for releases that publish only an id."""
    name = text(fields.get("lora_name"), "lora_name")
    if name:
        return name
    lora_id = fields.get("lora_id")
    if lora_id is None:
        return ""
    return f"lora-{small_int(lora_id, 'lora_id', default=0, high=(1 << 63) - 1)}"


def medium(value: Any) -> str:
    try:
        return normalize_medium(value)
    except InvalidEngineValue as exc:
        raise FrameError("bad_field", str(exc)) from None


def check_token_count(stored: BlockStored, *, allow_partial_last: bool) -> BlockStored:
    """Refuse a store whose tokens cannot be cut into its blocks."""
    n, size, count = len(stored.block_hashes), stored.block_size, len(stored.token_ids)
    exact = count == n * size
    partial = allow_partial_last and n > 0 and (n - 1) * size < count < n * size
    if not (exact or partial):
        raise FrameError("token_count_mismatch", f"{count} tokens for {n} blocks of {size}")
    return stored


def stored_event(
    fields: Fields,
    *,
    namespace: str,
    lora_name: str,
    partial: bool,
    opaque_from: int | None = None,
) -> BlockStored:
    """A :class:`BlockStored` from the fields both engine families share."""
    event = BlockStored(
        block_hashes=hashes(require(fields, "block_hashes")),
        parent_hash=optional_hash(fields.get("parent_block_hash")),
        token_ids=token_ids(require(fields, "token_ids")),
        block_size=small_int(
            require(fields, "block_size"), "block_size", default=0, low=1, high=MAX_BLOCK_SIZE
        ),
        medium=medium(fields.get("medium")),
        group=small_int(fields.get("group_idx"), "group_idx", default=0),
        lora_name=lora_name,
        namespace=namespace,
        opaque_from=opaque_from,
    )
    return check_token_count(event, allow_partial_last=partial)


def removed_event(fields: Fields) -> BlockRemoved:
    return BlockRemoved(
        block_hashes=hashes(require(fields, "block_hashes")),
        medium=medium(fields.get("medium")),
        group=small_int(fields.get("group_idx"), "group_idx", default=0),
    )


def cleared_event(fields: Fields) -> AllBlocksCleared:
    return AllBlocksCleared()


def decode_batch(
    payload: bytes,
    *,
    rank_field: str,
    layouts: Mapping[str, Sequence[str]],
    parsers: Mapping[str, EventParser],
) -> EngineEventBatch:
    """Decode one engine batch; a bad event is skipped and its reason recorded."""
    ts, raw_events, rank = batch_parts(decode_msgpack(payload), rank_field)
    events: list[EngineEvent] = []
    rejected: list[str] = []
    removals_lost = False
    for raw in raw_events:
        tag: str | None = None
        try:
            tag, fields = event_fields(raw, layouts)
            parser = parsers.get(tag)
            if parser is None:
                raise IgnoredEvent(tag)
            events.append(parser(fields))
        except FrameError as exc:
            rejected.append(exc.reason)
            removals_lost = removals_lost or tag in (None, "BlockRemoved")
        except IgnoredEvent:
            rejected.append("unknown_event_type")
    return EngineEventBatch(
        ts=ts,
        events=tuple(events),
        dp_rank=rank,
        rejected=tuple(rejected),
        removals_lost=removals_lost,
    )


@dataclass(frozen=True, slots=True)
class TableAdapter:
    """An engine family's decoder: its batch rank field, array layouts and event parsers."""

    engine_kind: str
    rank_field: str
    layouts: Mapping[str, Sequence[str]]
    parsers: Mapping[str, EventParser]

    def decode(self, payload: bytes) -> EngineEventBatch:
        """Decode one payload (frame 2 of a ZMQ message)."""
        return decode_batch(
            payload, rank_field=self.rank_field, layouts=self.layouts, parsers=self.parsers
        )
