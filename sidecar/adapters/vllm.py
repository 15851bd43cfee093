"""vLLM KV events (0.9 to 0.33) decoded into :mod:`kvcore.engine_events`.

Batch: ``[ts, events]`` (0.9.0) or ``[ts, events, data_parallel_rank]`` (0.9.2+), always a
positional array; a map with the same names is accepted too (an unreleased ``main`` had
one). Events are positional arrays with the tag first up to 0.23, and maps with the tag
under ``"type"`` from 0.24 on (``None``-valued optional keys omitted). Either way the
fields are read by name after the table below, every length guarded: an array shorter
than its version's layout simply lacks the later fields, a longer one has trailing
fields this sidecar does not know, which are ignored.

``BlockStored`` (array length counting the tag: 6 in 0.9-0.10.1, 7 in 0.10.2-0.11,
8 in 0.14, 9 in 0.18, 10 in 0.21, 12 in 0.23)::

    pos  field                          type                      since
    1    block_hashes                   list[int | bytes]         0.9
    2    parent_block_hash              int | bytes | None        0.9
    3    token_ids                      list[int]                 0.9
    4    block_size                     int                       0.9
    5    lora_id                        int | None                0.9 (deprecated)
    6    medium                         str | None                0.10.2
    7    lora_name                      str | None                0.14
    8    extra_keys                     list[list | None] | None  0.18
    9    group_idx                      int | None                0.21
    10   kv_cache_spec_kind             str | None                0.23  (ignored)
    11   kv_cache_spec_sliding_window   int | None                0.23  (ignored)
    -    locality, ownership, session_id, lookahead_token_ids     map era only (ignored)

``BlockRemoved``: 1 ``block_hashes``, 2 ``medium`` (0.10.2), 3 ``group_idx`` (0.21).
``AllBlocksCleared``: no fields.

Namespace: a request's ``cache_salt`` is only visible in the first block's extra keys,
so a run that starts at the root (``parent_block_hash`` null) takes its namespace from
``extra_keys[0]``: a ``["cache_salt", salt]`` pair (tagged, 0.33) or else the last bare
string that is not the LoRA name (0.18-0.29). A chained run inherits its parent's.
LoRA: ``lora_name``; before 0.14 only ``lora_id`` exists, which becomes ``"lora-<id>"``.
"""

from __future__ import annotations

from typing import Any

from kvcore.engine_events import BlockStored
from sidecar.adapters import fields as f

ARRAY_LAYOUTS: dict[str, tuple[str, ...]] = {
    "BlockStored": (
        "block_hashes",
        "parent_block_hash",
        "token_ids",
        "block_size",
        "lora_id",
        "medium",
        "lora_name",
        "extra_keys",
        "group_idx",
        "kv_cache_spec_kind",
        "kv_cache_spec_sliding_window",
    ),
    "BlockRemoved": ("block_hashes", "medium", "group_idx"),
    "AllBlocksCleared": (),
}


def cache_salt(extra_keys: Any, lora_name: str) -> str:
    """The cache salt carried in the first block's extra keys, or ``""``."""
    if not isinstance(extra_keys, list) or not extra_keys:
        return ""
    first = extra_keys[0]
    if isinstance(first, str):
        first = [first]
    if not isinstance(first, list):
        return ""
    for item in first:
        if isinstance(item, list) and len(item) == 2 and item[0] == "cache_salt":
            return item[1] if isinstance(item[1], str) else ""
    bare = [item for item in first if isinstance(item, str) and item != lora_name]
    return bare[-1] if bare else ""


def parse_stored(fields: f.Fields) -> BlockStored:
    lora = f.lora_name(fields)
    rooted = fields.get("parent_block_hash") is None
    namespace = cache_salt(fields.get("extra_keys"), lora) if rooted else ""
    return f.stored_event(fields, namespace=namespace, lora_name=lora, partial=False)


PARSERS: dict[str, f.EventParser] = {
    "BlockStored": parse_stored,
    "BlockRemoved": f.removed_event,
    "AllBlocksCleared": f.cleared_event,
}


ADAPTER = f.TableAdapter("vllm", "data_parallel_rank", ARRAY_LAYOUTS, PARSERS)
