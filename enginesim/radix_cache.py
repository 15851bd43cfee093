"""SGLang's prefix cache: the radix tree of SGLang 0.5.23 and the request lifecycle
around it, so a simulator in SGLang mode keeps, hits, evicts and publishes what SGLang
would.

Read from the SGLang 0.5.23 wheel on PyPI (``sglang-0.5.23-cp311``):
``srt/mem_cache/radix_cache.py`` (``RadixCache``, ``RadixKey``), ``events.py``
(``KVCacheEventRecorder``), ``common.py`` (``match_kv_cache``, ``checkpoint_kv_cache``,
``release_kv_cache``), ``allocation.py`` and ``allocator/`` (how much is evicted before an
allocation), ``managers/schedule_batch.py`` (``check_decode_mem``, ``retract_decode``,
``release_req``) and ``schedule_policy.py`` (the match limit). Defaults throughout:
``--radix-eviction-policy lru``, ``--schedule-policy fcfs``, no LoRA, no hierarchical
cache, no speculative decoding.

**The tree.** A node holds a run of tokens, always a whole number of pages (``page_size``
tokens each, 1 by default), and each page's digest (``hashing.py``: SGLang's chained
SHA-256). Children are keyed by their first page (by ``(scope, page)`` for a salted
or LoRA request, the scope being its salt and adapter, so requests of different scopes
share nothing). A lookup or an insert
that ends inside a node splits it in two (the new upper node takes the lower node's lock
count). Every lookup and insert stamps the nodes it passes with one clock reading; a
node made by a split or an insert is stamped when it is made.

**Locks.** A request locks the node its cached prefix ends on, which locks every node
up to the root; a locked node is never evicted.

**Eviction** (``RadixCache.evict``): the unlocked leaves, least recently stamped first
(a heap built at each call); a parent left childless and unlocked joins the heap; whole
nodes go until at least the asked-for number of tokens is freed. How much is asked for
is SGLang's (``evict_to_free_tokens``): the allocation's demand minus what is free, the
demand being the tokens to extend, plus one page when pages are larger than a token
(``alloc_paged_token_slots_extend``'s overestimate).

**A request's life.**

- *Admission* (``match_kv_cache``, ``PrefillAdder``): look up its tokens but the last
  (at least one is computed), page-aligned; lock the hit; admitted within SGLang's
  memory budget (``AdmissionBudget``: room for its tokens and expected output beside the
  running requests' expected output). A step's admissions are matched and locked first,
  then allocated together (``alloc_for_extend``), evicting for all of them at once.
- *After its prefill* (``checkpoint``): insert its page-aligned tokens. Pages another
  request inserted meanwhile are freed (the copy in the tree wins: nothing is stored
  twice), the rest become the tree's; the lock moves to the new last node. Until then a
  prompt is not in the cache, so two requests admitted in one step share nothing.
- *Decode* (``check_decode_mem``, ``alloc_for_decode``): before a step's decode
  allocation, the cache evicts the step's demand (one page per request starting a page)
  and, with pages larger than a token, one page per running request more. When the
  demand does not fit, requests are retracted until it does.
- *Retraction* (``release_req``): the request's own pages are freed without being
  inserted (its cached prefix stays, unlocked), and the cache evicts until 20 tokens
  per request still running are free (``SGLANG_RETRACT_DECODE_STEPS``). It is admitted
  again later with its prompt and output so far.
- *Finish* (``release_kv_cache``, checkpoint on): insert the prompt and every computed
  output token, page-aligned (a partial last page is freed), split the new leaf at the
  prompt's boundary, then unlock.
- ``/flush_cache`` (``reset``): only when no request holds memory; ``AllBlocksCleared``.

**Events** (``KVCacheEventRecorder``): a new node is one ``BlockStored`` run of its
pages, its parent the digest of the parent node's last page (none under the root), the
salt on every run of a salted request; an evicted node is one ``BlockRemoved`` of its
pages. SGLang's recorder coalesces: a store whose parent is the previous store's last
page (same salt) extends it, which this cache reproduces, and consecutive removals merge,
which ``wire.py`` does when it encodes a step's batch (this cache records a removal per
page): the published events are the same.

**Disabled** (``disable``): SGLang's tree with ``disable_radix_cache``, which a P/D decode
server runs unless started with ``--disaggregation-decode-enable-radix-cache``
(``handle_pd_disaggregation`` resolves ``disable_radix_cache`` true; the factory builds
the tree with ``disable`` set, what older versions called the chunk cache): every lookup
matches nothing, nothing is inserted, nothing is evicted, no KV event is recorded
(``enable_kv_cache_events`` is forced off) and a request's pages are its own until it
ends.

Not reproduced: SGLang picks the request to retract by fewest output tokens (the engine
core picks its own), it refreshes the waiting requests' prefixes in LRU order every 32
scheduling passes, and its first event batch after start carries an ``AllBlocksCleared``
(the simulator's restart is silent). Where SGLang would never admit a request whose
expected output does not fit beside an empty engine, the simulator admits it if its
prompt fits; the budget's ratio starts over whenever no request holds memory (SGLang:
when its scheduler idles).
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from enginesim.kv_manager import AllCleared, BlockEvicted, BlocksStored, PoolEvent
from enginesim.request import LoraTag

# A request's namespace in the tree: SGLang keys children under ``(extra_key, page)``,
# its ``extra_key`` being the salt and the adapter's id; None for neither.
Scope = tuple[str | None, LoraTag | None] | None

RETRACT_DECODE_STEPS = 20  # SGLANG_RETRACT_DECODE_STEPS: tokens kept free per request
CLIP_MAX_NEW_TOKENS = 4096  # SGLANG_CLIP_MAX_NEW_TOKENS_ESTIMATION
INIT_NEW_TOKEN_RATIO = 0.7  # SGLANG_INIT_NEW_TOKEN_RATIO x --schedule-conservativeness 1
MIN_NEW_TOKEN_RATIO = INIT_NEW_TOKEN_RATIO * 0.14  # SGLANG_MIN_NEW_TOKEN_RATIO_FACTOR
NEW_TOKEN_RATIO_DECAY = (INIT_NEW_TOKEN_RATIO - MIN_NEW_TOKEN_RATIO) / 600  # per decode step


class CacheRequest(Protocol):
    """What the cache reads of a request, and the one field it sets."""

    prompt: list[int]
    output: list[int]
    max_tokens: int
    salt: str | None
    lora: LoraTag | None
    digests: list[bytes]  # of every full page of ``tokens``
    hit_tokens: int

    @property
    def tokens(self) -> list[int]: ...


@dataclass(eq=False, slots=True)
class RadixNode:
    tokens: tuple[int, ...]
    digests: list[bytes]
    parent: RadixNode | None
    stamp: int  # the clock reading of its last lookup or insert (LRU order)
    scope: Scope = None
    lock_ref: int = 0
    children: dict[Hashable, RadixNode] = field(default_factory=dict)
    born: int = field(init=False)  # its first stamp: breaks ties in the LRU heap

    def __post_init__(self) -> None:
        self.born = self.stamp


@dataclass(slots=True)
class _Row:
    """A request's hold on the cache: its locked node and its own pages."""

    node: RadixNode
    protected: int  # leading tokens the tree owns (``cache_protected_len``)
    committed: int  # tokens whose KV is allocated (``kv_committed_len``)


class AdmissionBudget:
    """SGLang's ``PrefillAdder`` memory budget, in tokens: a request is admitted when
    its uncached tokens, its expected output and a page fit in what is free or evictable,
    less what the running requests are expected to still write (their remaining output
    times ``new_token_ratio``) and what this step's earlier admissions reserved (their
    tokens, a page and their whole output). Once that is spent, the step admits no more.

    The ratio starts at 0.7, falls by a 600th of the way to 0.098 each decode step, is
    re-estimated from the requests left after a retraction and starts over when the
    engine runs dry (``NewTokenRatioTracker``)."""

    def __init__(self, page_size: int) -> None:
        self.page_size = page_size
        self.ratio = INIT_NEW_TOKEN_RATIO
        self.step_reserved = 0  # ``total_offset`` of this step's admissions
        self.step_immediate = 0  # ``current_offset``: their tokens and a page each
        self.closed = False

    def new_step(self) -> None:
        self.step_reserved = self.step_immediate = 0
        self.closed = False

    def admits(
        self, req: CacheRequest, extend: int, room: int, running: list[CacheRequest]
    ) -> bool:
        """Whether ``req``, ``extend`` tokens short of cached, fits; ``room`` is the
        free and evictable tokens with its prefix locked."""
        if not running and not self.step_reserved:
            # SGLang would wait for room for the whole expected output too, forever when
            # that is more than the cache; the simulator's own check has let it in.
            return self._paged(extend) <= room
        total = extend + _remaining_output(req) + self.page_size
        return total < room - self._expected(running) - self.step_reserved

    def reserve(
        self, req: CacheRequest, extend: int, room: int, running: list[CacheRequest]
    ) -> None:
        """Charge an admitted request; close the step when nothing is left."""
        immediate = self._paged(extend) + self.page_size
        self.step_reserved += immediate + min(req.max_tokens, CLIP_MAX_NEW_TOKENS)
        self.step_immediate += immediate
        left = room - self._expected(running) - self.step_reserved
        self.closed = left <= 0 or room - self.step_immediate <= 0

    def decayed(self) -> None:
        self.ratio = max(self.ratio - NEW_TOKEN_RATIO_DECAY, MIN_NEW_TOKEN_RATIO)

    def retracted(self, running: list[CacheRequest]) -> None:
        decoded = sum(len(r.output) for r in running) + RETRACT_DECODE_STEPS * len(running)
        self.ratio = min(1.0, decoded / (sum(r.max_tokens for r in running) + 1))

    def _expected(self, running: list[CacheRequest]) -> float:
        return sum(_remaining_output(r) * self.ratio for r in running)

    def _paged(self, tokens: int) -> int:
        return -(-tokens // self.page_size) * self.page_size


def _remaining_output(req: CacheRequest) -> int:
    return min(max(req.max_tokens - len(req.output), 0), CLIP_MAX_NEW_TOKENS)


class SglangRadixCache:
    """SGLang 0.5.23's radix cache and request lifecycle (see the module docstring)."""

    def __init__(self, num_blocks: int, block_size: int, *, disable: bool = False) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be >= 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.disable = disable  # holds nothing, publishes nothing (see the module docstring)
        self._events: list[PoolEvent] = []
        self._fresh_tree()

    def _fresh_tree(self) -> None:
        self._clock = itertools.count(1)
        self.root = RadixNode((), [], None, 0, lock_ref=1)
        self._free = self.num_blocks
        self._evictable_tokens = 0
        self._leaves: set[RadixNode] = set()
        self._rows: dict[CacheRequest, _Row] = {}
        self._admitted: list[CacheRequest] = []  # this step's, not yet allocated
        self._budget = AdmissionBudget(self.block_size)
        self._decode_ok: bool | None = None  # this step's decode check, once made
        self._retracted = False  # in this step

    # -- queries -----------------------------------------------------------------------

    @property
    def capacity_blocks(self) -> int:
        return self.num_blocks

    @property
    def num_free(self) -> int:
        """Pages no request holds: free, or cached and unlocked."""
        return self._free + self._evictable_tokens // self.block_size

    @property
    def usage(self) -> float:
        """SGLang's ``token_usage``: the share of pages requests hold."""
        return 1.0 - self.num_free / self.num_blocks

    def cached_digests(self) -> set[bytes]:
        found: set[bytes] = set()
        stack = [self.root]
        while stack:
            node = stack.pop()
            found.update(node.digests)
            stack.extend(node.children.values())
        return found

    def cached_prefix_tokens(self, req: CacheRequest) -> int:
        """The leading tokens of ``req`` the tree holds now, as its admission would
        match them (page-aligned, the last token left out), with nothing stamped or
        split: what a decode server with a radix cache does not read from its prefill
        (SGLang's decode matches the whole prompt: one page more for a prompt of whole
        pages, not reproduced)."""
        tokens = req.tokens
        key, scope = tokens[: self._aligned(len(tokens) - 1)], _scope(req)
        node, pos = self.root, 0
        while pos < len(key):
            child = node.children.get(self._child_key(key, scope, pos))
            if child is None:
                break
            n = self._common(child.tokens, key, pos)
            pos += n
            if n < len(child.tokens):
                break
            node = child
        return pos

    def take_events(self) -> list[PoolEvent]:
        events, self._events = self._events, []
        return events

    # -- the request lifecycle ---------------------------------------------------------

    def admit(self, req: CacheRequest) -> bool:
        """Match and lock ``req``'s prefix and reserve its tokens in the step's budget;
        pages are allocated for the whole step's admissions in ``after_forward``, before
        the forward pass, as SGLang allocates a prefill batch."""
        budget = self._budget
        if budget.closed:
            return False
        if not self._rows:
            budget.ratio = INIT_NEW_TOKEN_RATIO  # the engine ran dry: the ratio starts over
        tokens = req.tokens
        hit, node = self._match(tokens[: self._aligned(len(tokens) - 1)], _scope(req))
        self._lock(node)
        extend = len(tokens) - hit
        room = self._free * self.block_size + self._evictable_tokens
        running = [r for r in self._rows if r not in self._admitted]
        if not budget.admits(req, extend, room, running):
            self._unlock(node)
            return False
        budget.reserve(req, extend, room, running)
        self._rows[req] = _Row(node, hit, len(tokens))
        self._admitted.append(req)
        req.hit_tokens = hit
        return True

    def after_forward(self, admitted: Sequence[CacheRequest]) -> None:
        self._allocate_admitted()
        for req in admitted:
            self._checkpoint(req, self._rows[req])
        if self._decode_ok and not self._retracted:
            self._budget.decayed()
        self._budget.new_step()
        self._decode_ok, self._retracted = None, False

    def grow(self, req: CacheRequest) -> bool:
        if self._decode_ok is None:
            self._check_decode()
        if not self._decode_ok:
            return False
        row = self._rows[req]
        if row.committed % self.block_size == 0:
            self._free -= 1
        row.committed += 1
        return True

    def preempt(self, req: CacheRequest) -> None:
        self._release(self._rows.pop(req))
        self._evict_for(len(self._rows) * RETRACT_DECODE_STEPS)
        self._retracted = True
        self._budget.retracted(list(self._rows))
        if self._decode_ok is False:
            self._check_decode()

    def finish(self, req: CacheRequest) -> None:
        row = self._rows.pop(req)
        self._checkpoint(req, row)
        self._release(row)

    def clear(self) -> bool:
        if self._rows:
            return False
        self._fresh_tree()
        if not self.disable:
            self._events.append(AllCleared())
        return True

    def reset(self) -> None:
        self._fresh_tree()
        self._events = []

    # -- lifecycle steps ---------------------------------------------------------------

    def _allocate_admitted(self) -> None:
        """``alloc_for_extend`` for the step's admissions: evict for their tokens (plus
        a page each with pages larger than a token), then take their pages."""
        rows = [self._rows[req] for req in self._admitted]
        self._admitted = []
        if not rows:
            return
        extend = sum(row.committed - row.protected for row in rows)
        self._evict_for(extend + (len(rows) * self.block_size if self.block_size > 1 else 0))
        self._free -= sum(self._pages(row.committed - row.protected) for row in rows)

    def _checkpoint(self, req: CacheRequest, row: _Row) -> None:
        """Insert what ``req`` computed, free the pages the tree already had, move the
        lock to the new last node (``RadixCache.checkpoint``). A disabled tree keeps
        nothing: the pages stay the request's own."""
        if self.disable:
            return
        tokens = req.tokens
        key_len = self._aligned(row.committed)
        pages = key_len // self.block_size
        if len(req.digests) < pages:
            raise ValueError("the request's digests do not cover its full pages")
        scope = _scope(req)
        in_tree, _ = self._insert(tokens[:key_len], req.digests[:pages], scope)
        self._free += (in_tree - row.protected) // self.block_size
        prompt_len = self._aligned(len(req.prompt))
        if 0 < prompt_len < key_len:  # split the leaf at the prompt's end
            self._insert(tokens[:prompt_len], req.digests[: prompt_len // self.block_size], scope)
        _, node = self._match(tokens[:key_len], scope)
        row.protected = key_len
        self._unlock(row.node)
        self._lock(node)
        row.node = node

    def _release(self, row: _Row) -> None:
        """Free the request's own pages and drop its lock."""
        self._free += self._pages(row.committed - row.protected)
        self._unlock(row.node)

    def _check_decode(self) -> None:
        """SGLang's ``check_decode_mem`` for every running request, then the decode
        allocation's own overestimate (one page per request) when it fits."""
        size = self.block_size
        starting = sum(1 for row in self._rows.values() if row.committed % size == 0)
        self._evict_for(starting * size)
        self._decode_ok = starting <= self._free
        if self._decode_ok and size > 1:
            self._evict_for(len(self._rows) * size)

    def _evict_for(self, demand_tokens: int) -> None:
        shortfall = demand_tokens - self._free * self.block_size
        if shortfall > 0:
            self._evict(shortfall)

    # -- the tree ----------------------------------------------------------------------

    def _aligned(self, n: int) -> int:
        return max(n, 0) // self.block_size * self.block_size

    def _pages(self, n_tokens: int) -> int:
        return -(-n_tokens // self.block_size)

    def _child_key(self, tokens: Sequence[int], scope: Scope, at: int = 0) -> Hashable:
        """A child's key in its parent: its first page, under the scope if any."""
        size = self.block_size
        page: Hashable = tokens[at] if size == 1 else tuple(tokens[at : at + size])
        return page if scope is None else (scope, page)

    def _common(self, node_tokens: Sequence[int], key: Sequence[int], at: int) -> int:
        """Page-aligned length of the common prefix of a node's tokens and ``key[at:]``."""
        n, limit = 0, min(len(node_tokens), len(key) - at)
        while n < limit and node_tokens[n] == key[at + n]:
            n += 1
        return n // self.block_size * self.block_size

    def _walk(self, key: Sequence[int], scope: Scope) -> tuple[int, RadixNode]:
        """Follow ``key`` (page-aligned) down the tree, stamping the nodes passed and
        splitting the one it ends inside: how far it got, and the node there."""
        stamp = next(self._clock)
        node, pos = self.root, 0
        while pos < len(key):
            child = node.children.get(self._child_key(key, scope, pos))
            if child is None:
                break
            child.stamp = stamp
            n = self._common(child.tokens, key, pos)
            pos += n
            if n < len(child.tokens):
                return pos, self._split(child, n, scope)
            node = child
        return pos, node

    def _match(self, key: Sequence[int], scope: Scope) -> tuple[int, RadixNode]:
        """The longest cached prefix of ``key`` (page-aligned): its length and last node."""
        return self._walk(key, scope) if key and not self.disable else (0, self.root)

    def _insert(
        self, key: Sequence[int], digests: Sequence[bytes], scope: Scope
    ) -> tuple[int, RadixNode]:
        """Insert ``key`` (page-aligned); returns how much of it was already cached."""
        pos, node = self._walk(key, scope)
        if pos == len(key):
            return pos, node
        first = pos // self.block_size
        leaf = RadixNode(tuple(key[pos:]), list(digests[first:]), node, next(self._clock), scope)
        node.children[self._child_key(key, scope, pos)] = leaf
        self._evictable_tokens += len(leaf.tokens)
        self._update_leaf(node)
        self._update_leaf(leaf)
        self._record_store(leaf, scope)
        return pos, leaf

    def _split(self, child: RadixNode, n: int, scope: Scope) -> RadixNode:
        """Cut ``child`` after ``n`` tokens; returns the new upper node."""
        parent = child.parent
        assert parent is not None
        k = n // self.block_size
        upper = RadixNode(
            child.tokens[:n], child.digests[:k], parent, next(self._clock), scope, child.lock_ref
        )
        parent.children[self._child_key(child.tokens, scope)] = upper
        child.tokens, child.digests, child.parent = child.tokens[n:], child.digests[k:], upper
        upper.children[self._child_key(child.tokens, scope)] = child
        return upper

    def _lock(self, node: RadixNode) -> None:
        while node.parent is not None:
            if node.lock_ref == 0:
                self._evictable_tokens -= len(node.tokens)
            node.lock_ref += 1
            self._update_leaf(node)
            node = node.parent

    def _unlock(self, node: RadixNode) -> None:
        while node.parent is not None:
            if node.lock_ref == 1:
                self._evictable_tokens += len(node.tokens)
            node.lock_ref -= 1
            self._update_leaf(node)
            node = node.parent

    def _update_leaf(self, node: RadixNode) -> None:
        if node.lock_ref == 0 and not node.children and node is not self.root:
            self._leaves.add(node)
        else:
            self._leaves.discard(node)

    def _evict(self, n_tokens: int) -> None:
        """Drop unlocked leaves, least recently stamped first, until ``n_tokens`` are
        freed or nothing is left to drop."""
        heap = [(leaf.stamp, leaf.born, leaf) for leaf in self._leaves]
        heapq.heapify(heap)
        freed = 0
        while freed < n_tokens and heap:
            _, _, leaf = heapq.heappop(heap)
            parent = leaf.parent
            assert parent is not None
            del parent.children[self._child_key(leaf.tokens, leaf.scope)]
            self._leaves.discard(leaf)
            self._evictable_tokens -= len(leaf.tokens)
            self._free += len(leaf.digests)
            freed += len(leaf.tokens)
            self._update_leaf(parent)
            if not parent.children and parent.lock_ref == 0:
                heapq.heappush(heap, (parent.stamp, parent.born, parent))
            self._events.extend(BlockEvicted(d) for d in leaf.digests)

    def _record_store(self, leaf: RadixNode, scope: Scope) -> None:
        parent = leaf.parent
        above = parent.digests[-1] if parent is not None and parent.digests else None
        tail = self._events[-1] if self._events else None
        if (
            isinstance(tail, BlocksStored)
            and above is not None
            and (tail.salt, tail.lora) == _salt_and_lora(scope)
            and tail.digests[-1] == above
        ):
            self._events[-1] = BlocksStored(
                tail.digests + tuple(leaf.digests),
                tail.parent,
                tail.token_ids + leaf.tokens,
                *_salt_and_lora(scope),
            )
            return
        stored = BlocksStored(tuple(leaf.digests), above, leaf.tokens, *_salt_and_lora(scope))
        self._events.append(stored)


def _scope(req: CacheRequest) -> Scope:
    return None if req.salt is None and req.lora is None else (req.salt, req.lora)


def _salt_and_lora(scope: Scope) -> tuple[str | None, LoraTag | None]:
    return (None, None) if scope is None else scope
