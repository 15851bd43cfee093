"""vLLM v1's block pool and KV cache manager, block for block (read from vLLM 0.33.0).

What a router can observe of vLLM's prefix cache follows from the rules of
``vllm/v1/core/block_pool.py``, ``kv_cache_utils.py`` (``FreeKVCacheBlockQueue``),
``kv_cache_manager.py`` and ``single_type_kv_cache_manager.py`` (``FullAttentionManager``)
of vLLM 0.33.0, for one full-attention KV cache group with prefix caching and KV events on:

- **the null block**: block 0 is taken off the free queue at start-up and never handed
  out, so ``num_blocks`` blocks give ``num_blocks - 1`` usable ones, and the usage is
  ``1 - free / (num_blocks - 1)``;
- **the free queue** starts in block-id order; allocation takes blocks from its head and,
  if a block taken is cached, drops its hash from the cache (``BlockRemoved``);
- **freeing** (a request finished, aborted or preempted) goes through the request's
  blocks tail first; a block whose last reference goes joins the queue's tail if it is
  cached (so a shared prefix outlives its suffixes, least recently used first) and the
  queue's head if it holds no hash (reused first);
- **a cache hit** is the longest run of leading full blocks whose hashes are cached,
  capped at ``num_tokens - 1`` tokens (at least the last token is recomputed), so a
  block-aligned prompt recomputes its whole last block; a hit block is taken off the free
  queue (``touch``) and admission counts those blocks against the free ones;
- **caching** happens when blocks are allocated, before the forward pass
  (``allocate_slots`` → ``cache_full_blocks``): every full block of the tokens scheduled
  is inserted under its hash, one ``BlockStored`` per call whose ``parent`` is the hash of
  the block before the run; decode caches a block when the token that fills it is
  scheduled;
- **duplicates are kept**: a block computed again under a cached hash (a block-aligned
  prompt sent twice, the identical answers of ``n`` samples) is cached as a second copy and
  published again; a lookup takes the oldest copy; evicting one copy publishes
  ``BlockRemoved`` for the hash although the other copy still hits;
- ``reset_prefix_cache`` succeeds only while no request holds a block (the null block
  aside): every hash goes, one ``AllBlocksCleared``.

Allocation follows ``allocate_slots`` without chunked prefill: admission allocates for
the request's whole token list (the prompt; the prompt and its output when a preempted
request resumes), each decode step for one more token. ``allocate_slots`` returns
``None`` when the blocks it needs (new ones, plus hit blocks it takes off the free queue)
exceed the free ones; the scheduler then preempts (``scheduler.py``).

Events are domain objects (``kv_manager.py``); ``wire.py`` turns them into an engine's
bytes.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from enginesim.errors import PoolExhausted
from enginesim.kv_manager import AllCleared, BlockEvicted, BlocksStored, PoolEvent

if TYPE_CHECKING:
    from enginesim.request import LoraTag, SimRequest

__all__ = ["BlockPool", "KVBlock", "RequestBlocks", "VllmKVCacheManager"]


@dataclass(slots=True, eq=False)
class KVBlock:
    block_id: int
    ref_cnt: int = 0
    digest: bytes | None = None


class FreeBlockQueue:
    """vLLM's ``FreeKVCacheBlockQueue``: free blocks in eviction order, head first,
    with removal from the middle (a cache hit) in O(1)."""

    def __init__(self, blocks: Iterable[KVBlock]) -> None:
        self._queue: OrderedDict[int, KVBlock] = OrderedDict((b.block_id, b) for b in blocks)

    def __len__(self) -> int:
        return len(self._queue)

    def popleft(self) -> KVBlock:
        return self._queue.popitem(last=False)[1]

    def remove(self, block: KVBlock) -> None:
        del self._queue[block.block_id]

    def append_n(self, blocks: Sequence[KVBlock]) -> None:
        for block in blocks:
            self._queue[block.block_id] = block

    def prepend_n(self, blocks: Sequence[KVBlock]) -> None:
        """Put ``blocks`` at the head, keeping their order."""
        for block in reversed(blocks):
            self._queue[block.block_id] = block
            self._queue.move_to_end(block.block_id, last=False)

    def block_ids(self) -> list[int]:
        return list(self._queue)


@dataclass(slots=True)
class BlockPool:
    """vLLM's ``BlockPool`` (module docstring): blocks, free queue, hash → blocks."""

    num_blocks: int
    block_size: int
    blocks: list[KVBlock] = field(init=False)
    _free: FreeBlockQueue = field(init=False)
    _cached: dict[bytes, dict[int, KVBlock]] = field(init=False)  # oldest copy first
    _events: list[PoolEvent] = field(init=False)

    def __post_init__(self) -> None:
        if self.num_blocks < 2 or self.block_size < 1:
            raise ValueError("num_blocks must be >= 2 (block 0 is vLLM's null block)")
        self.blocks = [KVBlock(i) for i in range(self.num_blocks)]
        self._free = FreeBlockQueue(self.blocks)
        self._free.popleft()  # the null block
        self._cached = {}
        self._events = []

    # -- queries -----------------------------------------------------------------------

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        """Fraction of usable blocks referenced by requests (``kv_cache_usage_perc``)."""
        return 1.0 - len(self._free) / (self.num_blocks - 1)

    def cached_digests(self) -> set[bytes]:
        return set(self._cached)

    def free_block_ids(self) -> list[int]:
        """The free queue, head (next evicted) first."""
        return self._free.block_ids()

    def resident(self) -> dict[bytes, list[int]]:
        """Every cached digest and the ids of its copies, oldest first."""
        return {digest: list(copies) for digest, copies in self._cached.items()}

    def longest_cached_prefix(self, digests: Sequence[bytes]) -> list[KVBlock]:
        hits: list[KVBlock] = []
        for digest in digests:
            copies = self._cached.get(digest)
            if copies is None:
                break
            hits.append(next(iter(copies.values())))
        return hits

    def can_allocate(self, hits: Sequence[KVBlock], n_new: int) -> bool:
        """Whether ``n_new`` blocks are free once the free ``hits`` are taken."""
        free_hits = sum(1 for b in hits if b.ref_cnt == 0)
        return n_new + free_hits <= len(self._free)

    # -- mutations ---------------------------------------------------------------------

    def touch(self, hits: Sequence[KVBlock]) -> None:
        for block in hits:
            if block.ref_cnt == 0:
                self._free.remove(block)
            block.ref_cnt += 1

    def allocate(self, n: int) -> list[KVBlock]:
        if n > len(self._free):
            raise PoolExhausted(f"{n} blocks asked for, {len(self._free)} free")
        taken = [self._free.popleft() for _ in range(n)]
        for block in taken:
            self._evict(block)
            block.ref_cnt = 1
        return taken

    def free(self, blocks: Sequence[KVBlock]) -> None:
        """Release a request's blocks (given in sequence order), tail first."""
        cached: list[KVBlock] = []
        fresh: list[KVBlock] = []
        for block in reversed(blocks):
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                (fresh if block.digest is None else cached).append(block)
        self._free.prepend_n(fresh)
        self._free.append_n(cached)

    def cache_run(
        self,
        blocks: Sequence[KVBlock],
        digests: Sequence[bytes],
        parent: bytes | None,
        token_ids: Sequence[int],
        salt: str | None,
        lora: LoraTag | None = None,
    ) -> None:
        """Cache newly full ``blocks`` (their digests and tokens given in order)."""
        if not blocks:
            return
        for block, digest in zip(blocks, digests, strict=True):
            block.digest = digest
            self._cached.setdefault(digest, {})[block.block_id] = block
        self._events.append(BlocksStored(tuple(digests), parent, tuple(token_ids), salt, lora))

    def _evict(self, block: KVBlock) -> None:
        digest = block.digest
        if digest is None:
            return
        block.digest = None
        copies = self._cached.get(digest)
        if copies is None or copies.pop(block.block_id, None) is None:
            return
        if not copies:
            del self._cached[digest]
        self._events.append(BlockEvicted(digest))

    def clear_cache(self) -> bool:
        """Forget every cached digest (``/reset_prefix_cache``); refused, like vLLM,
        while any block but the null block is in use."""
        if len(self._free) != self.num_blocks - 1:
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


@dataclass(slots=True, eq=False)
class RequestBlocks:
    """What one request holds: its blocks in sequence order, and how many of the leading
    ones are known to the cache (hit or stored)."""

    blocks: list[KVBlock]
    num_cached: int


class VllmKVCacheManager:
    """vLLM's ``KVCacheManager`` over one ``BlockPool``: ``kv_manager.KVCacheManager``."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.pool = BlockPool(num_blocks, block_size)
        self._held: dict[SimRequest, RequestBlocks] = {}

    @property
    def capacity_blocks(self) -> int:
        return self.num_blocks - 1

    @property
    def num_free(self) -> int:
        return self.pool.num_free

    @property
    def usage(self) -> float:
        return self.pool.usage

    def admit(self, req: SimRequest) -> bool:
        """``get_computed_blocks`` then ``allocate_slots`` for all of ``req``'s tokens."""
        hits = self._hits(req)
        n_new = self._blocks_for(self._admission_tokens(req)) - len(hits)
        if not self.pool.can_allocate(hits, n_new):
            return False
        self.pool.touch(hits)
        held = RequestBlocks([*hits, *self.pool.allocate(n_new)], len(hits))
        self._held[req] = held
        req.hit_tokens = len(hits) * self.block_size
        self._cache_full_blocks(req, held)
        return True

    def cached_prefix_tokens(self, req: SimRequest) -> int:
        """The hit ``get_computed_blocks`` finds for ``req`` now, in tokens, changing
        nothing (a P/D decode's connector reads the rest of its prompt)."""
        return len(self._hits(req)) * self.block_size

    def _hits(self, req: SimRequest) -> list[KVBlock]:
        """The cached blocks of ``req``'s longest leading run, capped so that at least its
        last token is computed."""
        max_hit = (req.num_tokens - 1) // self.block_size
        return self.pool.longest_cached_prefix(req.digests[:max_hit])

    def grow(self, req: SimRequest) -> bool:
        """``allocate_slots`` for one decode token."""
        # (once per running request per step: most tokens fit in the last block, which
        # they fill only every block_size tokens)
        held, num_tokens = self._held[req], req.num_tokens
        n_new = self._blocks_for(num_tokens) - len(held.blocks)
        if n_new > 0:
            if n_new > self.pool.num_free:
                return False
            held.blocks.extend(self.pool.allocate(n_new))
        if num_tokens // self.block_size > held.num_cached:
            self._cache_full_blocks(req, held)
        return True

    def after_forward(self, admitted: Sequence[SimRequest]) -> None:
        """Nothing: vLLM cached the prompts' blocks when it allocated them."""

    def finish(self, req: SimRequest) -> None:
        held = self._held.pop(req, None)
        if held is not None:
            self.pool.free(held.blocks)

    preempt = finish  # recompute mode: the blocks go back to the pool, tail first

    def clear(self) -> bool:
        return self.pool.clear_cache()

    def reset(self) -> None:
        self.pool.reset()
        self._held.clear()

    def take_events(self) -> list[PoolEvent]:
        return self.pool.take_events()

    def cached_digests(self) -> set[bytes]:
        return self.pool.cached_digests()

    def block_ids(self, req: SimRequest) -> list[int]:
        """``req``'s block table (empty when it holds none)."""
        held = self._held.get(req)
        return [] if held is None else [b.block_id for b in held.blocks]

    def _admission_tokens(self, req: SimRequest) -> int:
        """The tokens admission allocates slots for: all of ``req``'s, as
        ``allocate_slots`` does without chunked prefill."""
        return req.num_tokens

    def _blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _cache_full_blocks(self, req: SimRequest, held: RequestBlocks) -> None:
        """``cache_full_blocks`` for every full block of ``req``'s tokens."""
        bs = self.block_size
        start, full = held.num_cached, req.num_tokens // bs
        if full <= start:
            return
        parent = req.digests[start - 1] if start else None
        salt = req.salt if start == 0 else None
        tokens = req.tokens[start * bs : full * bs]
        self.pool.cache_run(
            held.blocks[start:full], req.digests[start:full], parent, tokens, salt, req.lora
        )
        held.num_cached = full
