"""SGLang KV events (0.4.8 to 0.5.23) decoded into :mod:`kvcore.engine_events`.

Batch: ``[ts, events, attn_dp_rank]``, a positional array in every release (a map is
accepted too). Events are positional arrays with the tag first up to 0.5.19, and maps with
the tag under ``"type"`` from 0.5.20 on (``omit_defaults``: missing keys are ``None``).

``BlockStored``::

    pos  field               type                    since
    1    block_hashes        list[int]  (signed)     0.4.8
    2    parent_block_hash   int | None              0.4.8
    3    token_ids           list[int]               0.4.8
    4    block_size          int (page size, 1 by default; last page may be shorter)
    5    lora_id             int | None (always None in 0.5.23)
    6    medium              str | None              0.5.10
    7    metadata            {"cache_salt": str}     0.5.19 (BlockStoredWithMetadata)
    -    cache_salt, session_id                      map era, 0.5.20
    -    lora_name                                   map era, 0.5.22

LoRA: ``lora_name``, else ``lora_id`` as ``"lora-<id>"`` (older releases).

0.4.8-0.5.5 (``BlockStored`` without ``medium``: 5 fields after the tag) hash each page
as ``hash(tuple(page_tokens))``, not chained to its parent: with page size 1 a repeated
token repeats a hash, so a page cannot be placed in its prompt and a child would chain
from the wrong parent. Those stores are refused (rejected as ``unchained_page_hashes``;
the pipeline logs why once and the announce carries it): nothing is keyed, nothing wrong.

``BlockRemoved``: 1 ``block_hashes``, 2 ``medium`` (0.5.10). ``AllBlocksCleared``: none.

SGLang coalesces consecutive pages of one radix chain into one event, so with the
default page size of 1 every token is a block; the key mapper groups them into router
blocks. A store's token count may end in a partial page. The namespace is the
``cache_salt`` (map field, or ``metadata.cache_salt`` in 0.5.19) of a run that starts at
the root; a chained run inherits its parent's.
"""

from __future__ import annotations

from kvcore.engine_events import BlockStored
from sidecar.adapters import fields as f
from sidecar.errors import FrameError

ARRAY_LAYOUTS: dict[str, tuple[str, ...]] = {
    "BlockStored": (
        "block_hashes",
        "parent_block_hash",
        "token_ids",
        "block_size",
        "lora_id",
        "medium",
        "metadata",
    ),
    "BlockRemoved": ("block_hashes", "medium"),
    "AllBlocksCleared": (),
}


def salt_of(fields: f.Fields) -> str:
    salt = fields.get("cache_salt")
    metadata = fields.get("metadata")
    if salt is None and isinstance(metadata, dict):
        salt = metadata.get("cache_salt")
    return f.text(salt, "cache_salt")


UNCHAINED_HASHES = "unchained_page_hashes"
UNCHAINED_MESSAGE = (
    "SGLang 0.4.8-0.5.5 hashes each page without its parent (a 6-field BlockStored): "
    "a repeated token repeats a hash, so a page cannot be placed in its prompt and no "
    "key can be published safely. This sidecar keys nothing from it; upgrade SGLang to "
    "0.5.10 or later (chained page hashes)."
)


def parse_stored(fields: f.Fields) -> BlockStored:
    if "type" not in fields and "medium" not in fields:  # an array of tag + 5 fields
        raise FrameError(UNCHAINED_HASHES, UNCHAINED_MESSAGE)
    lora = f.lora_name(fields)
    rooted = fields.get("parent_block_hash") is None
    namespace = salt_of(fields) if rooted else ""
    return f.stored_event(fields, namespace=namespace, lora_name=lora, partial=True)


PARSERS: dict[str, f.EventParser] = {
    "BlockStored": parse_stored,
    "BlockStoredWithMetadata": parse_stored,
    "BlockRemoved": f.removed_event,
    "AllBlocksCleared": f.cleared_event,
}


ADAPTER = f.TableAdapter("sglang", "attn_dp_rank", ARRAY_LAYOUTS, PARSERS)
