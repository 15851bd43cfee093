"""LoRA adapters, served as vLLM 0.33 and SGLang 0.5.23 serve them.

An engine started with ``--enable-lora`` answers to its adapters' names as model names
and keys an adapter's KV blocks under the adapter (``hashing.py``, ``wire.py``), so a
prefix cached for one adapter is never a hit for another or for the base model. No
weights are read: an adapter is a name, an id and a path, and loading one costs
``--lora-load-ms`` of modelled time. What each engine does, as read from its source:

- at start: vLLM's ``--lora-modules``, ``name=path`` or JSON ``{"name", "path",
  "base_model_name"}``; SGLang's ``--lora-paths``, ``name=path``, ``path`` or JSON
  ``{"lora_name", "lora_path", "pinned"}``;
- load and unload: vLLM's ``POST /v1/load_lora_adapter`` ``{"lora_name", "lora_path",
  "load_inplace"}`` and ``/v1/unload_lora_adapter`` ``{"lora_name"}``, which exist only
  with ``VLLM_ALLOW_RUNTIME_LORA_UPDATING`` set (else 404); SGLang's
  ``/load_lora_adapter`` ``{"lora_name", "lora_path", "pinned"}`` and
  ``/unload_lora_adapter`` (``lora_api.py`` has the answers' shapes);
- requests: vLLM's ``model`` is the adapter's name; SGLang's ``model`` is
  ``base:adapter``, or ``/generate`` names it in ``lora_path``;
- ``/v1/models``: a card per adapter, ``root`` its path, ``parent`` its base model;
- bounds: vLLM's ``--max-loras`` adapters among running requests (SGLang's
  ``--max-loras-per-batch``, ``--max-loras`` here) and ``--max-cpu-loras`` adapters'
  weights kept in memory (a cold one is loaded before its prefill); SGLang's
  ``--max-loaded-loras`` adapters registered, loading one more unloads the least
  recently used unpinned one.

Several spaces separate the start-up list's items (one flag value holds them all).
"""

from __future__ import annotations

import itertools
import json
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from enginesim.request import LoraTag

VLLM_ENV_GATE = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"


@dataclass(frozen=True, slots=True)
class LoraModule:
    """One adapter of the start-up list."""

    name: str
    path: str
    base_model_name: str | None = None
    pinned: bool = False


def parse_modules(text: str, *, sglang: bool) -> list[LoraModule]:
    """The start-up list, in vLLM's forms (``sglang`` false) or SGLang's; raises
    ``ValueError`` naming the item it cannot read."""
    return [_module(item, sglang) for item in _items(text)]


def _items(text: str) -> Iterator[str | dict[str, Any]]:
    """Whitespace-separated items; a JSON object may contain spaces."""
    decoder = json.JSONDecoder()
    pos = 0
    while pos < len(text):
        if text[pos].isspace():
            pos += 1
            continue
        if text[pos] == "{":
            try:
                value, pos = decoder.raw_decode(text, pos)
            except json.JSONDecodeError as exc:
                raise ValueError(f"invalid JSON adapter at {pos}: {exc.msg}") from None
            yield value
            continue
        end = pos
        while end < len(text) and not text[end].isspace():
            end += 1
        yield text[pos:end]
        pos = end


def _module(item: str | dict[str, Any], sglang: bool) -> LoraModule:
    if isinstance(item, str):
        name, sep, path = item.partition("=")
        if not sep:
            if not sglang:  # vLLM reads any other item as JSON
                raise ValueError(f"invalid adapter {item!r}: expected name=path or JSON")
            name = path = item  # SGLang: a bare path is its own name
        if not name or not path:
            raise ValueError(f"invalid adapter {item!r}: empty name or path")
        return LoraModule(name, path)
    keys = ("lora_name", "lora_path") if sglang else ("name", "path")
    given_name, given_path = item.get(keys[0]), item.get(keys[1])
    if not (isinstance(given_name, str) and given_name):
        raise ValueError(f"invalid adapter {item!r}: '{keys[0]}' is required")
    if not (isinstance(given_path, str) and given_path):
        raise ValueError(f"invalid adapter {item!r}: '{keys[1]}' is required")
    base = item.get("base_model_name")
    pinned = bool(item.get("pinned", False))
    return LoraModule(given_name, given_path, base if isinstance(base, str) else None, pinned)


@dataclass(slots=True)
class _Entry:
    tag: LoraTag
    base_model_name: str | None
    pinned: bool


class AdapterRegistry:
    """The adapters an engine answers to, least recently used first (a request's use,
    SGLang's ``LoRARegistry.acquire``, moves one to the end)."""

    def __init__(self, base_model: str) -> None:
        self.base_model = base_model
        self._entries: OrderedDict[str, _Entry] = OrderedDict()
        self._ids = itertools.count(1)

    def __contains__(self, name: str) -> bool:
        return name in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def use(self, name: str) -> LoraTag | None:
        """The adapter named ``name``, marked used; None when not loaded."""
        entry = self._entries.get(name)
        if entry is None:
            return None
        self._entries.move_to_end(name)
        return entry.tag

    def add(self, module: LoraModule) -> LoraTag:
        """Register ``module`` (replacing one of its name, whose id it keeps, as vLLM's
        ``load_inplace``)."""
        old = self._entries.get(module.name)
        int_id = old.tag.int_id if old is not None else next(self._ids)
        tag = LoraTag(module.name, int_id, module.path)
        self._entries[module.name] = _Entry(tag, module.base_model_name, module.pinned)
        self._entries.move_to_end(module.name)
        return tag

    def remove(self, name: str) -> bool:
        return self._entries.pop(name, None) is not None

    def least_recently_used(self) -> str | None:
        """The unpinned adapter used longest ago (SGLang's ``lru_lora_name``)."""
        return next((n for n, e in self._entries.items() if not e.pinned), None)

    def paths(self) -> dict[str, str]:
        return {name: entry.tag.path for name, entry in self._entries.items()}

    def cards(self, now: int, *, owned_by: str) -> list[dict[str, Any]]:
        """A ``ModelCard`` per adapter: its path as ``root``, its base as ``parent``
        (the engine's own ``max_model_len`` and permissions are the caller's to add)."""
        return [
            {
                "id": name,
                "object": "model",
                "created": now,
                "owned_by": owned_by,
                "root": entry.tag.path,
                "parent": entry.base_model_name or self.base_model,
                "max_model_len": None,
            }
            for name, entry in self._entries.items()
        ]


class WarmAdapters:
    """vLLM's CPU cache of adapters' weights (``--max-cpu-loras``, least recently used
    out): a request whose adapter is not in it pays the load before its prefill."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._ids: OrderedDict[int, None] = OrderedDict()

    def touch(self, int_id: int) -> bool:
        """Mark ``int_id`` used; whether it had to be loaded."""
        if int_id in self._ids:
            self._ids.move_to_end(int_id)
            return False
        self._ids[int_id] = None
        while len(self._ids) > self.capacity:
            self._ids.popitem(last=False)
        return True

    def drop(self, int_id: int) -> None:
        self._ids.pop(int_id, None)
