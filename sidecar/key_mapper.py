"""Engine block hashes -> router block keys: the sidecar's domain core (no I/O).

The proxy cannot reproduce an engine's hashes, so the sidecar re-keys every block in
router space (``kvcore.keys``): a ``BlockStored`` chains router keys from its parent's
position with ``chain_keys``, cutting the tokens at the *router* block size, which need
not be the engine's (SGLang's page size is 1). Each engine block therefore maps to a
:class:`_Block`: the router key of the last complete router block up to and including it
(``anchor``), the tokens after that boundary (``tail``, shorter than a router block) and
the router keys this block completes (``keys``). A child continues from its parent's
position, so partial remainders carry across events and across engine blocks.

The guarantee is **keys may be missing, never wrong**: a router key is held only while
every engine block that contributed tokens to it is cached. With engine blocks smaller
than router blocks, several engine blocks make up one router block (its *window*); the
block that completes it holds the key, and each block of the window links to the one
before (``window_parent``). Evicting any block of a window releases the key, in whatever
order the engine evicts (CPU tiers, sliding windows and hybrid models evict out of
order); an evicted block that later windows still lean on stays as a non-resident
*ghost*, so that storing it again brings their keys back.

A router key is held while at least one engine block holds it (per medium): two engine
blocks can complete the same router key (hybrid-model groups, data-parallel ranks), and
it leaves only with the last of them. Data-parallel engines publish one stream per rank,
each with its own cache: blocks are kept per rank.

Never mis-keyed:

- a store whose parent is unknown cannot be keyed, so it is counted and skipped
  (:attr:`MapperStats.unknown_parents`); the service then tries to repair the state from
  the engine's replay buffer;
- blocks whose engine hash depends on more than their tokens (``opaque_from``: images,
  prompt embeddings, unreadable extra keys) and everything chained after them hold no key;
- when events were lost, :meth:`KeyMapper.withdraw_rank` releases every key of the rank
  and keeps its blocks only as positions to chain later stores from: a key is held again
  only once every block it needs has been stored again.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from kvcore.engine_events import MEDIUM_GPU, BlockRemoved, BlockStored, EngineEvent
from kvcore.keys import chain_keys, root_key

ChainId = tuple[int, int, str, int]  # (DP rank, group, medium, engine hash)
HeldKey = tuple[str, int]  # (medium, router key)
HeldEntry = tuple[str, int, int | None]  # (medium, router key, parent key)


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


@dataclass(slots=True)
class MapperStats:
    stored_blocks: int = 0
    removed_blocks: int = 0
    unknown_parents: int = 0
    unknown_removals: int = 0
    clears: int = 0
    withdrawals: int = 0
    opaque_blocks: int = 0


@dataclass(eq=False, slots=True)
class _Block:
    """One engine block: its position in router space and what it holds."""

    chain_id: ChainId
    anchor: int
    tail: tuple[int, ...]
    rooted_at_root: bool  # anchor is a root key (no router block completed yet)
    keys: tuple[int, ...]  # router keys completed in this block, in order
    first_parent: int | None  # the router key before keys[0]
    window_parent: _Block | None  # the block before, when both hold tokens of one key
    opaque: bool = False
    resident: bool = True
    lost: bool = False  # a ghost kept after a loss, only as a position to chain from
    first_held: bool = False  # keys[0] counts as held (its whole window is resident)
    window_children: list[_Block] | None = None

    @property
    def medium(self) -> str:
        return self.chain_id[2]

    def adopt(self, child: _Block) -> None:
        if self.window_children is None:
            self.window_children = []
        self.window_children.append(child)


def _root_block(event: BlockStored, model: str) -> _Block:
    root = root_key(model=model, lora_name=event.lora_name, namespace=event.namespace)
    return _Block((0, 0, "", 0), root, (), True, (), None, None)


@dataclass(slots=True)
class KeyMapper:
    """Translates engine events into router events and remembers what is held."""

    model: str
    block_size: int
    stats: MapperStats = field(default_factory=MapperStats)
    _chains: dict[ChainId, _Block] = field(default_factory=dict)
    _held: dict[HeldKey, list[Any]] = field(default_factory=dict)  # [owners, parent key]
    _resident: int = 0

    def apply(self, event: EngineEvent, rank: int = 0) -> list[RouterEvent]:
        if isinstance(event, BlockStored):
            return self._stored(event, rank)
        if isinstance(event, BlockRemoved):
            return self._removed(event, rank)
        self.stats.clears += 1
        return self.clear_rank(rank)

    # -- BlockStored -----------------------------------------------------------------
    def _start(self, event: BlockStored, rank: int) -> _Block | None:
        if event.parent_hash is None:
            return _root_block(event, self.model)
        return self._chains.get((rank, event.group, event.medium, event.parent_hash))

    def _stored(self, event: BlockStored, rank: int) -> list[RouterEvent]:
        start = self._start(event, rank)
        if start is None:
            self.stats.unknown_parents += 1
            return []
        size = self.block_size
        pending = start.tail + event.token_ids if start.tail else event.token_ids
        keys = chain_keys(start.anchor, pending, size)  # the whole run at once
        opaque_from = 0 if start.opaque else event.opaque_from
        parent_key = None if start.rooted_at_root else start.anchor
        fresh: list[HeldEntry] = []
        previous, offset, done = start, len(start.tail), 0
        for index, (engine_hash, length) in enumerate(
            zip(event.block_hashes, _lengths(event), strict=True)
        ):
            offset += length
            completed = offset // size  # router blocks ending in this one or before
            chain_id = (rank, event.group, event.medium, engine_hash)
            block = self._chains.get(chain_id)
            if block is None:
                block = _Block(
                    chain_id,
                    keys[completed - 1] if completed else start.anchor,
                    pending[completed * size : offset],
                    start.rooted_at_root and not completed,
                    tuple(keys[done:completed]),
                    keys[done - 1] if done else parent_key,
                    previous if previous.tail else None,
                    opaque=opaque_from is not None and index >= opaque_from,
                )
                self._add(block, fresh)
            elif not block.resident:  # stored again: it and the windows leaning on it
                self._revive(block, fresh)
            previous, done = block, completed
        self.stats.stored_blocks += len(event.block_hashes)
        return list(chain_runs(fresh))

    def _add(self, block: _Block, fresh: list[HeldEntry]) -> None:
        self._chains[block.chain_id] = block
        self._resident += 1
        if block.window_parent is not None:
            block.window_parent.adopt(block)
        if block.opaque:
            self.stats.opaque_blocks += 1
        self._hold_block(block, fresh)

    def _hold_block(self, block: _Block, fresh: list[HeldEntry]) -> None:
        """Hold the keys ``block`` completes whose every contributor is resident."""
        keys = block.keys
        if not keys or block.opaque:
            return
        medium, hold = block.chain_id[2], self._hold
        if block.window_parent is None or _window_resident(block.window_parent):
            block.first_held = True
            hold(medium, keys[0], block.first_parent, fresh)
        for i in range(1, len(keys)):
            hold(medium, keys[i], keys[i - 1], fresh)

    def _revive(self, block: _Block, fresh: list[HeldEntry]) -> None:
        block.resident, block.lost = True, False
        self._resident += 1
        self._hold_block(block, fresh)
        for later in _window_descendants(block):
            if not later.first_held and later.resident and _first_key_backed(later):
                later.first_held = True
                self._hold(later.medium, later.keys[0], later.first_parent, fresh)

    def _hold(self, medium: str, key: int, parent: int | None, fresh: list[HeldEntry]) -> None:
        """Count one more owner of ``key``; listed in ``fresh`` if it was not held before."""
        held_key = (medium, key)
        held = self._held.get(held_key)
        if held is None:
            self._held[held_key] = [1, parent]
            fresh.append((medium, key, parent))
        else:
            held[0] += 1

    # -- BlockRemoved / AllBlocksCleared ---------------------------------------------
    def _removed(self, event: BlockRemoved, rank: int) -> list[RouterEvent]:
        gone: list[int] = []
        for engine_hash in event.block_hashes:
            block = self._chains.get((rank, event.group, event.medium, engine_hash))
            if block is None or (not block.resident and not block.lost):
                self.stats.unknown_removals += 1
                continue
            self.stats.removed_blocks += 1
            if block.resident:
                self._evict(block, gone)
            block.lost = False
            self._forget(block)
        return [RouterRemoved(tuple(gone), event.medium)] if gone else []

    def _evict(self, block: _Block, gone: list[int]) -> None:
        """``block`` left the cache: its keys go, and so do the keys of later blocks whose
        router block it contributed tokens to."""
        block.resident = False
        self._resident -= 1
        self._release_block(block, gone)
        for later in _window_descendants(block):
            if later.first_held:
                later.first_held = False
                self._release(later.medium, later.keys[0], gone)

    def _release_block(self, block: _Block, gone: list[int]) -> None:
        if block.opaque or not block.keys:
            return
        if block.first_held:
            block.first_held = False
            self._release(block.medium, block.keys[0], gone)
        for key in block.keys[1:]:
            self._release(block.medium, key, gone)

    def _forget(self, block: _Block | None) -> None:
        """Drop ghosts no window leans on any more, walking back along the window."""
        while block is not None and not (block.resident or block.lost or block.window_children):
            if self._chains.get(block.chain_id) is block:
                del self._chains[block.chain_id]
            parent = block.window_parent
            if parent is not None and parent.window_children:
                parent.window_children.remove(block)
            block = parent

    def _release(self, medium: str, key: int, gone: list[int]) -> None:
        held = self._held.get((medium, key))
        if held is None:  # pragma: no cover - a block's held keys are always in the map
            return
        held[0] -= 1
        if held[0] == 0:
            del self._held[(medium, key)]
            gone.append(key)

    def _rank_blocks(self, rank: int) -> list[_Block]:
        return [block for chain_id, block in self._chains.items() if chain_id[0] == rank]

    def _released(self, gone: dict[str, list[int]]) -> list[RouterEvent]:
        if not self._held:  # nothing left anywhere: one clear says it all
            return [RouterCleared()]
        return [RouterRemoved(tuple(keys), medium) for medium, keys in gone.items() if keys]

    def clear_rank(self, rank: int) -> list[RouterEvent]:
        """Forget one rank's blocks: a clear if no other rank holds any key, else removals."""
        gone: dict[str, list[int]] = {}
        for block in self._rank_blocks(rank):
            if block.resident:
                self._resident -= 1
                self._release_block(block, gone.setdefault(block.medium, []))
            del self._chains[block.chain_id]
        return self._released(gone)

    def withdraw_rank(self, rank: int) -> list[RouterEvent]:
        """Events of one rank were lost: release every key it holds. Its blocks stay as
        positions (ghosts) that later stores can chain from; a block's keys are held again
        only when it is stored again and so is the rest of their window."""
        self.stats.withdrawals += 1
        gone: dict[str, list[int]] = {}
        for block in self._rank_blocks(rank):
            if not block.resident:  # a ghost from before: not worth keeping
                del self._chains[block.chain_id]
                continue
            self._resident -= 1
            self._release_block(block, gone.setdefault(block.medium, []))
            block.resident, block.lost = False, True
        return self._released(gone)

    # -- state -----------------------------------------------------------------------
    def clear(self) -> None:
        self._chains.clear()
        self._held.clear()
        self._resident = 0

    @property
    def engine_blocks(self) -> int:
        """Engine blocks believed cached (ghosts not counted)."""
        return self._resident

    @property
    def router_keys(self) -> int:
        return len(self._held)

    def held(self) -> Iterator[HeldEntry]:
        """Every held router key as ``(medium, key, parent key)``, each chain in order:
        a key whose parent is held comes after its parent."""
        children: dict[HeldKey, list[int]] = {}
        roots: list[HeldKey] = []
        for (medium, key), (_, parent) in self._held.items():
            if parent is not None and (medium, parent) in self._held:
                children.setdefault((medium, parent), []).append(key)
            else:
                roots.append((medium, key))
        for medium, root in roots:
            stack = [root]
            while stack:
                key = stack.pop()
                yield medium, key, self._held[(medium, key)][1]
                stack.extend(reversed(children.get((medium, key), ())))


def _window_resident(block: _Block | None) -> bool:
    """``True`` if ``block`` and the blocks before it in its window are all cached. The
    window begins in the last block that completed a router block (its tail)."""
    while block is not None:
        if not block.resident:
            return False
        if block.keys:
            return True
        block = block.window_parent
    return True


def _first_key_backed(block: _Block) -> bool:
    """The first key ``block`` completes has every contributor before it resident."""
    return bool(block.keys) and not block.opaque and _window_resident(block.window_parent)


def _window_descendants(block: _Block) -> Iterator[_Block]:
    """Later blocks whose first key's window includes ``block``."""
    stack = list(block.window_children or ())
    while stack:
        later = stack.pop()
        yield later
        if not later.keys and later.window_children:  # its window goes on past it
            stack.extend(later.window_children)


def _lengths(event: BlockStored) -> list[int]:
    """Token count of each engine block of a store; the last may be short (SGLang)."""
    n, size = len(event.block_hashes), event.block_size
    if n == 0:
        return []
    return [size] * (n - 1) + [len(event.token_ids) - (n - 1) * size]


def chain_runs(held: Iterable[HeldEntry]) -> Iterator[RouterStored]:
    """Keys as stores: consecutive keys that chain form one store with its parent."""
    medium, keys, parent = "", list[int](), None
    for key_medium, key, key_parent in held:
        if keys and key_medium == medium and key_parent == keys[-1]:
            keys.append(key)
            continue
        if keys:
            yield RouterStored(tuple(keys), parent, medium)
        medium, keys, parent = key_medium, [key], key_parent
    if keys:
        yield RouterStored(tuple(keys), parent, medium)
