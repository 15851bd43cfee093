"""The KV block pool: a prefix cache with vLLM's block semantics.

A pool of ``num_blocks`` blocks of ``block_size`` tokens. What a router can observe
follows vLLM's ``BlockPool`` (``vllm/v1/core/block_pool.py``):

- only **full** blocks are cached, identified by the engine's hash chain
  (``hashing.py``); a request's leading run of cached blocks is a cache hit;
- a block referenced by a running request is never evicted;
- freed blocks join the tail of an LRU free queue, a request's blocks in reverse order so
  that the tail of a sequence is evicted before its head; allocation takes the queue's
  head and, if that block was cached, evicts it (``BlockRemoved``);
- caching a run of blocks records one ``BlockStored`` whose ``parent`` is the digest of
  the block before the run (``None`` when the run starts at block 0).

One deliberate difference: when a block whose digest is already cached is computed again
(two requests with the same new prefix admitted together), vLLM caches both copies and
publishes the hash twice; the pool keeps the first copy only, so that the events always
describe the set of cached digests exactly. The run is split around the duplicate.

Events are domain objects here; ``wire.py`` turns them into an engine's bytes.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

from enginesim.errors import PoolExhausted


@dataclass(frozen=True, slots=True)
class BlocksStored:
    digests: tuple[bytes, ...]
    parent: bytes | None
    token_ids: tuple[int, ...]
    salt: str | None  # set when the run starts at a salted request's first block


@dataclass(frozen=True, slots=True)
class BlockEvicted:
    digest: bytes


@dataclass(frozen=True, slots=True)
class AllCleared:
    pass


PoolEvent = BlocksStored | BlockEvicted | AllCleared


@dataclass(slots=True)
class KVBlock:
    block_id: int
    ref_cnt: int = 0
    digest: bytes | None = None


@dataclass(slots=True)
class BlockPool:
    num_blocks: int
    block_size: int
    blocks: list[KVBlock] = field(init=False)
    _free: OrderedDict[int, KVBlock] = field(init=False)
    _cached: dict[bytes, KVBlock] = field(init=False)
    _events: list[PoolEvent] = field(init=False)

    def __post_init__(self) -> None:
        if self.num_blocks < 1 or self.block_size < 1:
            raise ValueError("num_blocks and block_size must be >= 1")
        self.blocks = [KVBlock(i) for i in range(self.num_blocks)]
        self._free = OrderedDict((b.block_id, b) for b in self.blocks)
        self._cached = {}
        self._events = []

    # -- queries -----------------------------------------------------------------------

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        """Fraction of blocks referenced by requests (vLLM's ``kv_cache_usage_perc``)."""
        return 1.0 - len(self._free) / self.num_blocks

    def cached_digests(self) -> set[bytes]:
        return set(self._cached)

    def longest_cached_prefix(self, digests: Sequence[bytes]) -> list[KVBlock]:
        hits: list[KVBlock] = []
        for digest in digests:
            block = self._cached.get(digest)
            if block is None:
                break
            hits.append(block)
        return hits

    def can_allocate(self, hits: Sequence[KVBlock], n_new: int) -> bool:
        """Whether ``n_new`` blocks are free once the free ``hits`` are taken."""
        free_hits = sum(1 for b in hits if b.ref_cnt == 0)
        return len(self._free) - free_hits >= n_new

    # -- mutations ---------------------------------------------------------------------

    def touch(self, hits: Sequence[KVBlock]) -> None:
        for block in hits:
            if block.ref_cnt == 0:
                del self._free[block.block_id]
            block.ref_cnt += 1

    def allocate(self, n: int) -> list[KVBlock]:
        if n > len(self._free):
            raise PoolExhausted(f"{n} blocks asked for, {len(self._free)} free")
        taken: list[KVBlock] = []
        for _ in range(n):
            _, block = self._free.popitem(last=False)
            self._evict(block)
            block.ref_cnt = 1
            taken.append(block)
        return taken

    def free(self, blocks: Sequence[KVBlock]) -> None:
        """Release a request's blocks (given in sequence order)."""
        for block in reversed(blocks):
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._free[block.block_id] = block

    def cache_run(
        self,
        blocks: Sequence[KVBlock],
        digests: Sequence[bytes],
        parent: bytes | None,
        token_ids: Sequence[int],
        salt: str | None,
    ) -> None:
        """Cache newly full ``blocks`` (their digests and tokens given in order)."""
        run: list[bytes] = []
        run_start = 0
        for i, (block, digest) in enumerate(zip(blocks, digests, strict=True)):
            if digest in self._cached:
                self._record_run(run, parent, token_ids, run_start, salt)
                run, run_start, parent, salt = [], i + 1, digest, None
                continue
            block.digest = digest
            self._cached[digest] = block
            run.append(digest)
        self._record_run(run, parent, token_ids, run_start, salt)

    def _record_run(
        self,
        run: list[bytes],
        parent: bytes | None,
        token_ids: Sequence[int],
        start: int,
        salt: str | None,
    ) -> None:
        if not run:
            return
        size = self.block_size
        tokens = tuple(token_ids[start * size : (start + len(run)) * size])
        self._events.append(BlocksStored(tuple(run), parent, tokens, salt))

    def _evict(self, block: KVBlock) -> None:
        if block.digest is None:
            return
        if self._cached.get(block.digest) is block:
            del self._cached[block.digest]
            self._events.append(BlockEvicted(block.digest))
        block.digest = None

    def clear_cache(self) -> bool:
        """Forget every cached digest (``/reset_prefix_cache``); refused, like vLLM,
        while any block is in use."""
        if len(self._free) != self.num_blocks:
            return False
        for block in self.blocks:
            block.digest = None
        self._cached.clear()
        self._events.append(AllCleared())
        return True

    def reset(self) -> None:
        """Back to a fresh start, silently: what an engine restart looks like."""
        self.__post_init__()

    def take_events(self) -> list[PoolEvent]:
        events, self._events = self._events, []
        return events
