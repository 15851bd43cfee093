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

Data-parallel engines publish one stream per rank, each with its own cache: chains are
kept per rank, while a router key stays held as long as any rank holds it.

Never mis-keyed: a store whose parent is unknown cannot be keyed, so it is counted and
skipped (:attr:`MapperStats.unknown_parents`); the service then tries to repair the state
from the engine's replay buffer.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

from kvcore.engine_events import MEDIUM_GPU, BlockRemoved, BlockStored, EngineEvent
from kvcore.keys import chain_keys, root_key

ChainId = tuple[int, int, str, int]  # (DP rank, group, medium, engine hash)
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

    def apply(self, event: EngineEvent, rank: int = 0) -> list[RouterEvent]:
        if isinstance(event, BlockStored):
            return self._stored(event, rank)
        if isinstance(event, BlockRemoved):
            return self._removed(event, rank)
        self.stats.clears += 1
        return self.clear_rank(rank)

    # -- BlockStored -----------------------------------------------------------------
    def _start(self, event: BlockStored, rank: int) -> ChainPoint | None:
        if event.parent_hash is None:
            root = root_key(model=self.model, lora_name=event.lora_name, namespace=event.namespace)
            return ChainPoint(root, (), (), True)
        return self._chains.get((rank, event.group, event.medium, event.parent_hash))

    def _stored(self, event: BlockStored, rank: int) -> list[RouterEvent]:
        start = self._start(event, rank)
        if start is None:
            self.stats.unknown_parents += 1
            return []
        pending = start.tail + event.token_ids if start.tail else event.token_ids
        keys = chain_keys(start.anchor, pending, self.block_size)  # the whole run at once
        parent_key = None if start.rooted_at_root else start.anchor
        fresh: list[int] = []  # indexes into keys of the router keys that became held
        offset, done = len(start.tail), 0
        for engine_hash, length in zip(event.block_hashes, _lengths(event), strict=True):
            offset += length
            completed = offset // self.block_size  # router blocks ending in this one or before
            chain_id = (rank, event.group, event.medium, engine_hash)
            if chain_id not in self._chains:  # a re-reported block is already held
                self._chains[chain_id] = ChainPoint(
                    keys[completed - 1] if completed else start.anchor,
                    pending[completed * self.block_size : offset],
                    tuple(keys[done:completed]),
                    start.rooted_at_root and not completed,
                )
                for index in range(done, completed):
                    parent = keys[index - 1] if index else parent_key
                    if self._hold(event.medium, keys[index], parent):
                        fresh.append(index)
            done = completed
        self.stats.stored_blocks += len(event.block_hashes)
        return _runs(keys, fresh, parent_key, event.medium)

    def _hold(self, medium: str, key: int, parent: int | None) -> bool:
        """Count one more owner of ``key``; ``True`` if it was not held before."""
        held = self._held.get((medium, key))
        if held is None:
            self._held[(medium, key)] = _Held(1, parent)
            return True
        held.owners += 1
        return False

    # -- BlockRemoved / AllBlocksCleared ---------------------------------------------
    def _removed(self, event: BlockRemoved, rank: int) -> list[RouterEvent]:
        gone: list[int] = []
        for engine_hash in event.block_hashes:
            point = self._chains.pop((rank, event.group, event.medium, engine_hash), None)
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

    def clear_rank(self, rank: int) -> list[RouterEvent]:
        """Forget one rank's blocks: a clear if no other rank holds any, else removals."""
        mine = [chain_id for chain_id in self._chains if chain_id[0] == rank]
        if len(mine) == len(self._chains):
            self.clear()
            return [RouterCleared()]
        gone: dict[str, list[int]] = {}
        for chain_id in mine:
            medium = chain_id[2]
            for key in self._chains.pop(chain_id).owned:
                self._release(medium, key, gone.setdefault(medium, []))
        return [RouterRemoved(tuple(keys), medium) for medium, keys in gone.items() if keys]

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


def _lengths(event: BlockStored) -> list[int]:
    """Token count of each engine block of a store; the last may be short (SGLang)."""
    n, size = len(event.block_hashes), event.block_size
    if n == 0:
        return []
    return [size] * (n - 1) + [len(event.token_ids) - (n - 1) * size]


def _runs(
    keys: list[int], fresh: list[int], root_parent: int | None, medium: str
) -> list[RouterEvent]:
    """The newly held keys as stores, one per unbroken run, each with its parent key."""
    runs: list[RouterEvent] = []
    start = 0
    for i in range(1, len(fresh) + 1):
        if i == len(fresh) or fresh[i] != fresh[i - 1] + 1:
            first = fresh[start]
            parent = keys[first - 1] if first else root_parent
            runs.append(RouterStored(tuple(keys[first : fresh[i - 1] + 1]), parent, medium))
            start = i
    return runs
