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
``extra_keys[0]``: a ``["cache_salt", salt]`` pair (tagged, 0.33) or else the one bare
string that is not the LoRA name (0.21-0.29). A chained run inherits its parent's.

Multimodal: router keys are computed from token ids alone, so they cannot tell two
images apart behind equal placeholder tokens. A block whose extra keys hold anything but
the LoRA name and the salt (an image identifier: a bare string up to 0.18, an
``(identifier, offset)`` pair since 0.21; a prompt-embedding digest) is *opaque*: it and
every block chained after it are not keyed (``BlockStored.opaque_from``). In 0.15-0.18
(an array without ``group_idx``) a bare string in the first block may be the salt or an
image, so such a run is not keyed at all.
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


def _is_salt_pair(item: Any) -> bool:
    return isinstance(item, list) and len(item) == 2 and item[0] == "cache_salt"


def _salt_of_first(first: Any, lora_name: str, bare_is_ambiguous: bool) -> str | None:
    """The salt in the first block's extra keys (``""`` if none), or ``None`` when they
    hold anything else or cannot be read unambiguously."""
    items = [first] if isinstance(first, str) else first
    if not isinstance(items, list):
        return None
    salts: list[str] = []
    for item in items:
        if item == lora_name and lora_name:
            continue
        if _is_salt_pair(item) and isinstance(item[1], str):
            salts.append(item[1])
        elif isinstance(item, str) and not bare_is_ambiguous:
            salts.append(item)
        else:  # an image (bare before 0.21, a pair since), prompt embeddings, unknown
            return None
    if len(salts) > 1:
        return None
    return salts[0] if salts else ""


def _plain(extra: Any, lora_name: str) -> bool:
    """A later block's extra keys name nothing but the LoRA adapter."""
    if extra is None:
        return True
    items = [extra] if isinstance(extra, str) else extra
    return isinstance(items, list) and all(item == lora_name and lora_name for item in items)


def extra_key_facts(
    extra_keys: Any, lora_name: str, *, rooted: bool, bare_is_ambiguous: bool
) -> tuple[str, int | None]:
    """``(namespace, opaque_from)`` of a store from its per-block extra keys.

    A block's engine hash covers its extra keys: the LoRA name, the cache salt (first
    block of a prompt only), and multimodal identifiers or prompt-embedding digests.
    Router keys see token ids only, so a block whose hash depends on anything but the
    LoRA and the salt -- and every block after it -- is opaque (not keyed). In vLLM
    0.15-0.18 an image identifier is a bare string like the salt (``bare_is_ambiguous``),
    so a bare string in the first block could be either: that run is not keyed at all.
    """
    if extra_keys is None:
        return "", None
    if not isinstance(extra_keys, list):
        return "", 0
    namespace = ""
    for index, extra in enumerate(extra_keys):
        if index == 0 and rooted and extra is not None:
            salt = _salt_of_first(extra, lora_name, bare_is_ambiguous)
            if salt is None:
                return "", 0
            namespace = salt
        elif not _plain(extra, lora_name):
            return "", index
    return namespace, None


def parse_stored(fields: f.Fields) -> BlockStored:
    lora = f.lora_name(fields)
    rooted = fields.get("parent_block_hash") is None
    # an array without group_idx is vLLM 0.15-0.18, where images are bare strings too
    bare_is_ambiguous = "type" not in fields and "group_idx" not in fields
    namespace, opaque_from = extra_key_facts(
        fields.get("extra_keys"), lora, rooted=rooted, bare_is_ambiguous=bare_is_ambiguous
    )
    return f.stored_event(
        fields, namespace=namespace, lora_name=lora, partial=False, opaque_from=opaque_from
    )


PARSERS: dict[str, f.EventParser] = {
    "BlockStored": parse_stored,
    "BlockRemoved": f.removed_event,
    "AllBlocksCleared": f.cleared_event,
}


ADAPTER = f.TableAdapter("vllm", "data_parallel_rank", ARRAY_LAYOUTS, PARSERS)
