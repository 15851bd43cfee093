"""Test doubles for the sidecar's two neighbours: an engine's prefix cache and a consumer.

- :class:`FakeCache` behaves like an engine's prefix cache: prompts are cut into engine
  blocks hashed by chain (so shared prefixes share blocks), storing emits the
  ``BlockStored`` events an engine would, eviction removes leaves first and emits
  ``BlockRemoved``. :meth:`FakeCache.router_keys` computes, independently of the sidecar,
  which router keys the cached blocks amount to.
- :class:`ResidencyMirror` applies ``KvEventBatch`` messages the way the control plane
  does (epochs, contiguous seq, snapshots), so a test can compare what was published with
  what the engine holds.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import xxhash

from kvcore.engine_events import AllBlocksCleared, BlockRemoved, BlockStored
from kvcore.keys import block_keys
from kvcore.pb import events_pb2

MEDIUM_NAMES = {events_pb2.MEDIUM_GPU: "GPU", events_pb2.MEDIUM_CPU: "CPU"}


@dataclass
class _Block:
    parent: int | None
    tokens: tuple[int, ...]
    namespace: str


@dataclass
class FakeCache:
    block_size: int
    model: str = "m"
    blocks: dict[int, _Block] = field(default_factory=dict)

    def _hash(self, parent: int | None, tokens: tuple[int, ...], namespace: str) -> int:
        data = repr((parent, tokens, namespace)).encode()
        return xxhash.xxh3_64_intdigest(data)

    def store(self, tokens: list[int], namespace: str = "") -> list[BlockStored]:
        """Cache a prompt's full blocks; the events for the blocks that were new."""
        size, parent = self.block_size, None
        new: list[tuple[int, tuple[int, ...]]] = []
        run_parent: int | None = None
        for start in range(0, len(tokens) - size + 1, size):
            chunk = tuple(tokens[start : start + size])
            h = self._hash(parent, chunk, namespace)
            if h not in self.blocks:
                if not new:
                    run_parent = parent
                self.blocks[h] = _Block(parent, chunk, namespace)
                new.append((h, chunk))
            parent = h
        if not new:
            return []
        flat = tuple(t for _, chunk in new for t in chunk)
        ns = namespace if run_parent is None else ""
        return [BlockStored(tuple(h for h, _ in new), run_parent, flat, size, namespace=ns)]

    def evict(self, count: int) -> list[BlockRemoved]:
        """Evict up to ``count`` leaf blocks, oldest first, one event per block (vLLM)."""
        events = []
        for _ in range(count):
            parents = {b.parent for b in self.blocks.values()}
            leaf = next((h for h in self.blocks if h not in parents), None)
            if leaf is None:
                break
            del self.blocks[leaf]
            events.append(BlockRemoved((leaf,)))
        return events

    def clear(self) -> AllBlocksCleared:
        self.blocks.clear()
        return AllBlocksCleared()

    def _tokens_to(self, h: int) -> tuple[tuple[int, ...], str]:
        chain: list[tuple[int, ...]] = []
        block: _Block | None = self.blocks[h]
        namespace = ""
        while block is not None:
            chain.append(block.tokens)
            namespace = block.namespace
            block = self.blocks.get(block.parent) if block.parent is not None else None
        return tuple(t for chunk in reversed(chain) for t in chunk), namespace

    def router_keys(self, router_block_size: int) -> set[int]:
        """Router keys completed inside some cached engine block."""
        keys: set[int] = set()
        for h in self.blocks:
            tokens, namespace = self._tokens_to(h)
            all_keys = block_keys(
                list(tokens), model=self.model, namespace=namespace, block_size=router_block_size
            )
            start = len(tokens) - self.block_size
            keys |= {k for i, k in enumerate(all_keys) if (i + 1) * router_block_size > start}
        return keys


@dataclass
class ResidencyMirror:
    """What a control plane knows about one replica, from its published batches."""

    epoch: int = -1
    next_seq: int = 0
    keys: set[tuple[str, int]] = field(default_factory=set)
    gaps: int = 0
    batches: int = 0
    snapshots_done: int = 0
    _snapshot: set[tuple[str, int]] | None = None

    def apply(self, data: bytes) -> None:
        batch = events_pb2.KvEventBatch.FromString(data)
        if batch.epoch < self.epoch:
            return
        if batch.epoch > self.epoch:
            self.epoch, self.next_seq = batch.epoch, 0
            self.keys.clear()
        if batch.seq != self.next_seq:
            self.gaps += 1
        self.next_seq = batch.seq + 1
        self.batches += 1
        if batch.snapshot:
            self._apply_snapshot(batch)
            return
        for event in batch.events:
            self._apply_event(event, self.keys)

    def _apply_snapshot(self, batch: events_pb2.KvEventBatch) -> None:
        if self._snapshot is None:
            self._snapshot = set()
        for event in batch.events:
            self._apply_event(event, self._snapshot)
        if batch.snapshot_done:
            self.keys, self._snapshot = self._snapshot, None
            self.snapshots_done += 1

    @staticmethod
    def _apply_event(event: events_pb2.KvEvent, keys: set[tuple[str, int]]) -> None:
        kind = event.WhichOneof("kind")
        if kind == "stored":
            medium = MEDIUM_NAMES.get(event.stored.medium, "OTHER")
            keys.update((medium, k) for k in event.stored.keys)
        elif kind == "removed":
            medium = MEDIUM_NAMES.get(event.removed.medium, "OTHER")
            keys.difference_update((medium, k) for k in event.removed.keys)
        elif kind == "cleared":
            keys.clear()

    def gpu_keys(self) -> set[int]:
        return {k for m, k in self.keys if m == "GPU"}
