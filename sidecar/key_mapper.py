"""Engine block hashes -> router block keys: the sidecar's domain core (no I/O).

The proxy cannot reproduce an engine's hashes, so the sidecar re-keys every block in
router space (``kvcore.keys``): a ``BlockStored`` chains router keys from its parent's
position with ``chain_keys``, cutting the tokens at the *router* block size, which need
not be the engine's (SGLang's page size is 1). Each engine block therefore maps to a
:class:`ChainPoint`: the router key of the last complete router block up to and including
it (``anchor``), the tokens after that boundary (``tail``, shorter than a router block)
and the router keys this block completed (``owned``). A child continues from its parent's
point, so partial remainders carry across events and across engine blocks.

A router key is held while at least one engine block owns it (per medium): two engine
blocks can complete the same router key (hybrid-model groups, multimodal prompts whose
engine hashes differ but whose tokens do not), and it leaves only with the last of them.
Removed engine blocks leave the map, so memory follows what the engine holds.

Never mis-keyed: a store whose parent is unknown cannot be keyed, so it is counted and
skipped (:attr:`MapperStats.unknown_parents`); the service then tries to repair the state
from the engine's replay buffer.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

from kvcore.engine_events import (
    MEDIUM_GPU,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EngineEvent,
)
from kvcore.keys import chain_keys, root_key

ChainId = tuple[int, str, int]  # (group, medium, engine hash)
HeldKey = tuple[str, int]  # (medium, router key)


@dataclass(frozen=True, slots=True)
class RouterStored:
    keys: tuple[int, ...]
    parent_key: int | None
    medium: str = MEDIUM_GPU


@dataclass(frozen=True, slots=True)
class RouterRemoved:
    keys: tuple[int, ...]
    medium: str = MEDIUM_GPU


@dataclass(frozen=True, slots=True)
class RouterCleared:
    pass


RouterEvent = RouterStored | RouterRemoved | RouterCleared


@dataclass(frozen=True, slots=True)
class ChainPoint:
    anchor: int
    tail: tuple[int, ...]
    owned: tuple[int, ...]
    rooted_at_root: bool  # anchor is a root key (no router block completed yet)


@dataclass(slots=True)
class MapperStats:
    stored_blocks: int = 0
    removed_blocks: int = 0
    unknown_parents: int = 0
    unknown_removals: int = 0
    clears: int = 0


@dataclass(slots=True)
class _Held:
    owners: int
    parent: int | None


@dataclass(slots=True)
class KeyMapper:
    """Translates engine events into router events and remembers what is held."""

    model: str
    block_size: int
    stats: MapperStats = field(default_factory=MapperStats)
    _chains: dict[ChainId, ChainPoint] = field(default_factory=dict)
    _held: dict[HeldKey, _Held] = field(default_factory=dict)

    def apply(self, event: EngineEvent) -> list[RouterEvent]:
        if isinstance(event, BlockStored):
            return self._stored(event)
        if isinstance(event, BlockRemoved):
            return self._removed(event)
        return self._cleared(event)

    # -- BlockStored -----------------------------------------------------------------
    def _start(self, event: BlockStored) -> ChainPoint | None:
        if event.parent_hash is None:
            root = root_key(model=self.model, lora_name=event.lora_name, namespace=event.namespace)
            return ChainPoint(root, (), (), True)
        return self._chains.get((event.group, event.medium, event.parent_hash))

    def _stored(self, event: BlockStored) -> list[RouterEvent]:
        start = self._start(event)
        if start is None:
            self.stats.unknown_parents += 1
            return []
        parent_key = None if start.rooted_at_root else start.anchor
        new_keys: list[int] = []
        if not start.tail and event.block_size == self.block_size:
            self._store_aligned(event, start, new_keys)
        else:
            point = start
            for engine_hash, tokens in zip(event.block_hashes, _blocks(event), strict=True):
                point = self._store_block(event, engine_hash, point, tokens, new_keys)
        self.stats.stored_blocks += len(event.block_hashes)
        if not new_keys:
            return []
        return [RouterStored(tuple(new_keys), parent_key, event.medium)]

    def _store_aligned(self, event: BlockStored, start: ChainPoint, new_keys: list[int]) -> None:
        """Fast path: engine blocks are router blocks and the run starts on a boundary.

        One ``chain_keys`` call keys the whole run; a block already known (re-reported)
        has the same key, since the same hash means the same parent and tokens.
        """
        keys = chain_keys(start.anchor, event.token_ids, self.block_size)
        if len(keys) != len(event.block_hashes):  # a short last block: the general path
            point = start
            for engine_hash, tokens in zip(event.block_hashes, _blocks(event), strict=True):
                point = self._store_block(event, engine_hash, point, tokens, new_keys)
            return
        chains, held, medium, group = self._chains, self._held, event.medium, event.group
        parent = None if start.rooted_at_root else start.anchor
        for engine_hash, key in zip(event.block_hashes, keys, strict=True):
            chain_id = (group, medium, engine_hash)
            if chain_id not in chains:
                chains[chain_id] = ChainPoint(key, (), (key,), False)
                entry = held.get((medium, key))
                if entry is None:
                    held[(medium, key)] = _Held(1, parent)
                    new_keys.append(key)
                else:
                    entry.owners += 1
            parent = key

    def _store_block(
        self,
        event: BlockStored,
        engine_hash: int,
        start: ChainPoint,
        tokens: tuple[int, ...],
        new_keys: list[int],
    ) -> ChainPoint:
        chain_id = (event.group, event.medium, engine_hash)
        known = self._chains.get(chain_id)
        if known is not None:  # stored again (a re-report): already held, just continue
            return known
        pending = start.tail + tokens if start.tail else tokens
        keys = chain_keys(start.anchor, pending, self.block_size)
        done = len(keys) * self.block_size
        parent = None if start.rooted_at_root else start.anchor
        for key in keys:
            self._hold(event.medium, key, parent, new_keys)
            parent = key
        point = ChainPoint(
            keys[-1] if keys else start.anchor,
            pending[done:],
            tuple(keys),
            start.rooted_at_root and not keys,
        )
        self._chains[chain_id] = point
        return point

    def _hold(self, medium: str, key: int, parent: int | None, new_keys: list[int]) -> None:
        held = self._held.get((medium, key))
        if held is None:
            self._held[(medium, key)] = _Held(1, parent)
            new_keys.append(key)
        else:
            held.owners += 1

    # -- BlockRemoved / AllBlocksCleared ---------------------------------------------
    def _removed(self, event: BlockRemoved) -> list[RouterEvent]:
        gone: list[int] = []
        for engine_hash in event.block_hashes:
            point = self._chains.pop((event.group, event.medium, engine_hash), None)
            if point is None:
                self.stats.unknown_removals += 1
                continue
            self.stats.removed_blocks += 1
            for key in point.owned:
                self._release(event.medium, key, gone)
        return [RouterRemoved(tuple(gone), event.medium)] if gone else []

    def _release(self, medium: str, key: int, gone: list[int]) -> None:
        held = self._held.get((medium, key))
        if held is None:  # pragma: no cover - owned keys are always held
            return
        held.owners -= 1
        if held.owners == 0:
            del self._held[(medium, key)]
            gone.append(key)

    def _cleared(self, event: AllBlocksCleared) -> list[RouterEvent]:
        self.clear()
        self.stats.clears += 1
        return [RouterCleared()]

    # -- state -----------------------------------------------------------------------
    def clear(self) -> None:
        self._chains.clear()
        self._held.clear()

    @property
    def engine_blocks(self) -> int:
        return len(self._chains)

    @property
    def router_keys(self) -> int:
        return len(self._held)

    def held(self) -> Iterator[tuple[str, int, int | None]]:
        """Every held router key as ``(medium, key, parent key)``, parents first."""
        for (medium, key), held in self._held.items():
            yield medium, key, held.parent


def _blocks(event: BlockStored) -> Iterator[tuple[int, ...]]:
    """The tokens of each engine block of a store; the last may be short (SGLang)."""
    size, tokens = event.block_size, event.token_ids
    for i in range(len(event.block_hashes)):
        yield tokens[i * size : (i + 1) * size]
