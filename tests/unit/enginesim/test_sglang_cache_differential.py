"""The simulator's SGLang cache (``enginesim/radix_cache.py``) against a reference model
of SGLang 0.5.23's ``RadixCache`` and request lifecycle, written here from SGLang's
source (``srt/mem_cache/radix_cache.py``, ``events.py``, ``common.py``,
``allocation.py``, ``allocator/paged.py``, ``managers/schedule_batch.py``), not imported:
CI cannot install SGLang.

The reference keeps what SGLang keeps: KV slot indices in the tree's values and in each
request's row, a paged allocator with a free list of page ids, hashes computed lazily
from a node's tokens (hex strings, as ``get_hash_str``), a clock read the way
``time.monotonic`` is read (twice per new node, once per lookup or insert), the event
recorder's coalescing. The simulator keeps counts, the request's own digests and a
logical clock. Both are driven by the simulator's engine core (``EngineCore``), each call to both in
lockstep, with
randomized request streams (sequential and concurrent, Zipf-weighted shared prefixes,
random suffixes, prompts as long as the cache, 16 to 4,096 pages of 1, 16 or 32 tokens);
every call must answer alike, every admission find the same cached tokens, every step
leave the same pages resident and publish the same events.
"""

from __future__ import annotations

import contextlib
import hashlib
import heapq
import itertools
import random
import struct
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from enginesim.errors import RequestRejected
from enginesim.hashing import SglangSha256Hasher
from enginesim.kv_manager import PoolEvent
from enginesim.radix_cache import SglangRadixCache
from enginesim.request import SimRequest
from enginesim.scheduler import CoreLimits, EngineCore
from enginesim.timing import TimingModel
from enginesim.wire import make_format

# -- the reference: SGLang 0.5.23, transcribed ---------------------------------------------

RETRACT_DECODE_STEPS = 20
CLIP_MAX_NEW_TOKENS = 4096
SALT_TAG = b"sglang-cache-salt-v1\0"
CONTINUE, NO_TOKEN = "continue", "no_token"


def get_hash_str(token_ids: list[int], prior_hash: str | None) -> str:
    h = hashlib.sha256()
    if prior_hash:
        h.update(bytes.fromhex(prior_hash))
    for t in token_ids:
        h.update(struct.pack("<I", t))
    return h.hexdigest()


def hash_str_to_int64(hash_str: str) -> int:
    value = int(hash_str[:16], 16)
    return value - 2**64 if value >= 2**63 else value


class MonotonicClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        self.now += 1.0
        return self.now


class TreeNode:
    def __init__(self, clock: MonotonicClock) -> None:
        self.children: dict[Any, TreeNode] = {}
        self.parent: TreeNode | None = None
        self.key: list[int] = []
        self.salt: str | None = None
        self.value: list[int] | None = None
        self.lock_ref = 0
        self.last_access_time = clock()
        self.creation_time = clock()
        self.event_hash_value: list[str] | None = None

    def __lt__(self, other: TreeNode) -> bool:
        return self.last_access_time < other.last_access_time


class Req:
    """SGLang's ``Req``, as far as the cache reads it."""

    def __init__(self, rid: str, prompt: list[int], max_new_tokens: int, salt: str | None):
        self.rid = rid
        self.origin_input_ids = prompt
        self.output_ids: list[int] = []
        self.max_new_tokens = max_new_tokens
        self.cache_salt = salt
        self.last_node: TreeNode | None = None
        self.prefix_len = 0
        self.cache_protected_len = 0
        self.row: list[int] = []  # req_to_token[req_pool_idx]
        self.kv_committed_len = 0

    @property
    def fill_ids(self) -> list[int]:
        return self.origin_input_ids + self.output_ids


class NewTokenRatioTracker:
    def __init__(self) -> None:
        self.init = min(0.7 * 1.0, 1.0)  # SGLANG_INIT_NEW_TOKEN_RATIO x schedule_conservativeness
        self.min = min(self.init * 0.14, 1.0)
        self.decay = (self.init - self.min) / 600
        self.current = self.init

    def decay_step(self) -> None:
        self.current = max(self.current - self.decay, self.min)

    def reset(self) -> None:
        self.current = self.init

    @staticmethod
    def estimate_new_token_ratio_after_retract(reqs: list[Req]) -> float:
        total_decoded_tokens = sum(len(r.output_ids) for r in reqs)
        total_max_new_tokens = sum(r.max_new_tokens for r in reqs)
        ratio = (total_decoded_tokens + RETRACT_DECODE_STEPS * len(reqs)) / (
            total_max_new_tokens + 1
        )
        return min(1.0, ratio)


class PrefillAdder:
    """One scheduling pass's admissions against ``PrefillBudget``."""

    def __init__(self, cache: ReferenceRadixCache, running: list[Req], new_token_ratio: float):
        self.cache = cache
        self.page_size = cache.page_size
        self.running = running
        self.total_offset = sum(
            min(r.max_new_tokens - len(r.output_ids), CLIP_MAX_NEW_TOKENS) * new_token_ratio
            for r in running
        )
        self.current_offset = 0
        self.can_run_list: list[Req] = []
        self.stopped = False

    def ceil_paged_tokens(self, tokens: int) -> int:
        return -(-tokens // self.page_size) * self.page_size

    def available_and_evictable(self) -> int:
        return self.cache.available_size() + self.cache.evictable_size_

    def budget_state(self) -> str:
        remaining_total = self.available_and_evictable() - self.total_offset
        remaining_current = self.available_and_evictable() - self.current_offset
        return CONTINUE if remaining_total > 0 and remaining_current > 0 else NO_TOKEN

    def add_one_req(self, req: Req) -> str:
        max_new = min(max(req.max_new_tokens - len(req.output_ids), 0), CLIP_MAX_NEW_TOKENS)
        extend_input_len = len(req.fill_ids) - req.prefix_len
        total_tokens = extend_input_len + max_new + self.page_size
        assert req.last_node is not None
        self.cache.inc_lock_ref(req.last_node)  # _lock_node: out of the evictable budget
        if not self.running and not self.can_run_list:
            # the simulator's deviation: an engine with nothing running admits a
            # request whose prompt fits, whatever output it may write
            ok = self.ceil_paged_tokens(extend_input_len) <= self.available_and_evictable()
        else:
            ok = total_tokens < self.available_and_evictable() - self.total_offset
        self.cache.dec_lock_ref(req.last_node)
        if not ok:
            return NO_TOKEN
        self.cache.inc_lock_ref(req.last_node)  # _commit_prefill_admission
        self.can_run_list.append(req)
        immediate = self.ceil_paged_tokens(extend_input_len) + self.page_size
        self.total_offset += immediate + min(req.max_new_tokens, CLIP_MAX_NEW_TOKENS)
        self.current_offset += immediate
        return self.budget_state()


class ReferenceRadixCache:
    """``RadixCache`` plus ``PagedTokenToKVPoolAllocator`` and the scheduler's calls."""

    def __init__(self, page_size: int, num_pages: int) -> None:
        self.page_size = page_size
        self.num_pages = num_pages
        self.clock = MonotonicClock()
        self.free_pages = list(range(1, num_pages + 1))  # page 0 is SGLang's padding page
        self.kv_event_queue: list[dict[str, Any]] = []
        self.evictable_leaves: set[TreeNode] = set()
        self.reqs: dict[str, Req] = {}  # the running batch
        self.decode_checked: bool | None = None
        self.retracted = False
        self.adder: PrefillAdder | None = None
        self.new_token_ratio = NewTokenRatioTracker()
        self.reset()

    # allocator
    def available_size(self) -> int:
        return len(self.free_pages) * self.page_size

    def alloc_pages(self, n: int) -> list[int]:
        assert n <= len(self.free_pages), "alloc beyond the free pages"
        out, self.free_pages = self.free_pages[:n], self.free_pages[n:]
        return out

    def free(self, slots: list[int]) -> None:
        pages = sorted({s // self.page_size for s in slots})
        assert not set(pages) & set(self.free_pages), "page freed twice"
        self.free_pages.extend(pages)

    # RadixCache
    def reset(self) -> None:
        self.root_node = TreeNode(self.clock)
        self.root_node.value = []
        self.root_node.lock_ref = 1
        self.evictable_size_ = 0
        self.evictable_leaves.clear()
        self.kv_event_queue.append({"type": "AllBlocksCleared"})

    def child_key(self, key: list[int], salt: str | None) -> Any:
        plain = key[0] if self.page_size == 1 else tuple(key[: self.page_size])
        return plain if salt is None else ((None, salt), plain)

    def key_match(self, key0: list[int], key1: list[int]) -> int:
        i = 0
        while i < min(len(key0), len(key1)):
            if key0[i : i + self.page_size] != key1[i : i + self.page_size]:
                break
            i += self.page_size
        return i

    def page_aligned(self, key: list[int]) -> list[int]:
        return key[: len(key) // self.page_size * self.page_size]

    def match_prefix(self, key: list[int], salt: str | None) -> tuple[list[int], TreeNode]:
        if len(key) == 0:
            return [], self.root_node
        key = self.page_aligned(key)
        if len(key) == 0:
            return [], self.root_node
        access_time = self.clock()
        node = self.root_node
        node.last_access_time = access_time
        value: list[int] = []
        while len(key) > 0 and self.child_key(key, salt) in node.children:
            child = node.children[self.child_key(key, salt)]
            child.last_access_time = access_time
            prefix_len = self.key_match(child.key, key)
            if prefix_len < len(child.key):
                new_node = self.split_node(child, prefix_len)
                assert new_node.value is not None
                value += new_node.value
                node = new_node
                break
            assert child.value is not None
            value += child.value
            node = child
            key = key[prefix_len:]
        return value, node

    def split_node(self, child: TreeNode, split_len: int) -> TreeNode:
        assert child.parent is not None and child.value is not None
        new_node = TreeNode(self.clock)
        new_node.children = {self.child_key(child.key[split_len:], child.salt): child}
        new_node.parent = child.parent
        new_node.salt = child.salt
        new_node.lock_ref = child.lock_ref
        new_node.key = child.key[:split_len]
        new_node.value = child.value[:split_len]
        child.parent = new_node
        child.key = child.key[split_len:]
        child.value = child.value[split_len:]
        new_node.parent.children[self.child_key(new_node.key, child.salt)] = new_node
        if child.event_hash_value is not None:
            pages = split_len // self.page_size
            new_node.event_hash_value = child.event_hash_value[:pages]
            child.event_hash_value = child.event_hash_value[pages:]
        return new_node

    def insert(self, key: list[int], value: list[int], salt: str | None) -> tuple[int, TreeNode]:
        key = self.page_aligned(key)
        value = value[: len(key)]
        node = self.root_node
        node.last_access_time = access_time = self.clock()
        if len(key) == 0:
            return 0, node
        total_prefix_length = 0
        while len(key) > 0 and self.child_key(key, salt) in node.children:
            node = node.children[self.child_key(key, salt)]
            node.last_access_time = access_time
            prefix_len = self.key_match(node.key, key)
            total_prefix_length += prefix_len
            key = key[prefix_len:]
            value = value[prefix_len:]
            if prefix_len < len(node.key):
                node = self.split_node(node, prefix_len)
        if len(key):
            new_node = TreeNode(self.clock)
            new_node.parent = node
            new_node.key = key
            new_node.salt = salt
            new_node.value = list(value)
            node.children[self.child_key(key, salt)] = new_node
            self.evictable_size_ += len(key)
            self.update_leaf_status(node)
            self.update_leaf_status(new_node)
            self.record_store(new_node)
            node = new_node
        return total_prefix_length, node

    def evict(self, num_tokens: int) -> None:
        eviction_heap = [(n.last_access_time, n) for n in self.evictable_leaves]
        heapq.heapify(eviction_heap)
        num_evicted = 0
        while num_evicted < num_tokens and len(eviction_heap):
            _, x = heapq.heappop(eviction_heap)
            assert x.value is not None and x.parent is not None
            self.free(x.value)
            num_evicted += len(x.value)
            self.delete_leaf(x)
            if len(x.parent.children) == 0 and x.parent.lock_ref == 0:
                heapq.heappush(eviction_heap, (x.parent.last_access_time, x.parent))
            self.record_remove(x)

    def delete_leaf(self, node: TreeNode) -> None:
        assert node.parent is not None
        v = node.parent.children.pop(self.child_key(node.key, node.salt), None)
        assert v is node
        self.evictable_size_ -= len(node.key)
        self.evictable_leaves.discard(node)
        self.update_leaf_status(node.parent)

    def update_leaf_status(self, node: TreeNode) -> None:
        if node.value is None or node.lock_ref > 0 or node.children:
            self.evictable_leaves.discard(node)
        else:
            self.evictable_leaves.add(node)

    def inc_lock_ref(self, node: TreeNode) -> None:
        while node is not self.root_node:
            if node.lock_ref == 0:
                self.evictable_size_ -= len(node.key)
            node.lock_ref += 1
            self.update_leaf_status(node)
            assert node.parent is not None
            node = node.parent

    def dec_lock_ref(self, node: TreeNode) -> None:
        while node is not self.root_node:
            if node.lock_ref == 1:
                self.evictable_size_ += len(node.key)
            node.lock_ref -= 1
            self.update_leaf_status(node)
            assert node.parent is not None
            node = node.parent

    # KVCacheEventRecorder
    def event_hashes(self, node: TreeNode) -> list[str]:
        if node.event_hash_value is None:
            parent = node.parent
            assert parent is not None
            if parent is self.root_node:
                prior = (
                    hashlib.sha256(SALT_TAG + node.salt.encode()).hexdigest() if node.salt else None
                )
            else:
                prior = self.event_hashes(parent)[-1]
            hashes = []
            for start in range(0, len(node.key), self.page_size):
                prior = get_hash_str(node.key[start : start + self.page_size], prior)
                hashes.append(prior)
            node.event_hash_value = hashes
        return node.event_hash_value

    def enqueue(self, event: dict[str, Any]) -> None:
        if self.kv_event_queue:
            tail = self.kv_event_queue[-1]
            if tail["type"] == event["type"] == "BlockRemoved":
                tail["block_hashes"].extend(event["block_hashes"])
                return
            if (
                tail["type"] == event["type"] == "BlockStored"
                and tail["block_size"] == event["block_size"]
                and tail["cache_salt"] == event["cache_salt"]
                and event["parent_block_hash"] == tail["block_hashes"][-1]
            ):
                tail["block_hashes"].extend(event["block_hashes"])
                tail["token_ids"].extend(event["token_ids"])
                return
        self.kv_event_queue.append(event)

    def record_store(self, node: TreeNode) -> None:
        hashes = self.event_hashes(node)
        parent = node.parent
        assert parent is not None
        parent_block_hash = None
        if parent is not self.root_node:
            parent_block_hash = hash_str_to_int64(self.event_hashes(parent)[-1])
        for i, start in enumerate(range(0, len(node.key), self.page_size)):
            page_tokens = node.key[start : start + self.page_size]
            block_hash = hash_str_to_int64(hashes[i])
            self.enqueue(
                {
                    "type": "BlockStored",
                    "block_hashes": [block_hash],
                    "parent_block_hash": parent_block_hash,
                    "token_ids": list(page_tokens),
                    "block_size": len(page_tokens),
                    "cache_salt": node.salt,
                }
            )
            parent_block_hash = block_hash

    def record_remove(self, node: TreeNode) -> None:
        hashes = [hash_str_to_int64(h) for h in self.event_hashes(node)]
        self.enqueue({"type": "BlockRemoved", "block_hashes": hashes})

    # the scheduler's calls (common.py, allocation.py, schedule_batch.py)
    def evict_from_tree_cache(self, num_tokens: int) -> None:
        shortfall = num_tokens - self.available_size()
        if shortfall > 0:
            self.evict(shortfall)

    def admit(self, req: Req) -> tuple[bool, int]:
        """One candidate of ``get_new_batch_prefill``'s loop: ``init_next_round_input``,
        then ``PrefillAdder.add_one_req``."""
        if self.adder is None:
            running = [r for r in self.reqs.values()]
            if not running:
                self.new_token_ratio.reset()  # the scheduler idled
            self.adder = PrefillAdder(self, running, self.new_token_ratio.current)
        if self.adder.stopped:
            return False, 0
        fill_ids = req.fill_ids
        prefix, last_node = self.match_prefix(fill_ids[: len(fill_ids) - 1], req.cache_salt)
        req.prefix_len = len(prefix)
        req.cache_protected_len = len(prefix)
        req.last_node = last_node
        req.row = prefix
        result = self.adder.add_one_req(req)
        admitted = bool(self.adder.can_run_list) and self.adder.can_run_list[-1] is req
        if result != CONTINUE:
            self.adder.stopped = True
        return admitted, req.prefix_len if admitted else 0

    def run_prefill_batch(self) -> None:
        """``alloc_for_extend`` for the pass's batch, then its results: every request
        checkpointed; then the decode step's ratio bookkeeping."""
        batch = self.adder.can_run_list if self.adder is not None else []
        self.adder = None
        if batch:
            extend_num_tokens = sum(len(r.fill_ids) - r.prefix_len for r in batch)
            if self.page_size == 1:
                self.evict_from_tree_cache(extend_num_tokens)
            else:
                self.evict_from_tree_cache(extend_num_tokens + len(batch) * self.page_size)
        for req in batch:
            extend = len(req.fill_ids) - req.prefix_len
            pages = self.alloc_pages(-(-extend // self.page_size))
            slots = [p * self.page_size + i for p in pages for i in range(self.page_size)]
            req.row = req.row + slots[:extend]
            req.kv_committed_len = len(req.fill_ids)
            self.reqs[req.rid] = req
        for req in batch:
            self.checkpoint(req, req.kv_committed_len)
        if self.decode_checked and not self.retracted:
            self.new_token_ratio.decay_step()
        self.decode_checked, self.retracted = None, False

    def checkpoint(self, req: Req, up_to: int) -> None:
        token_ids = req.fill_ids[:up_to]
        kv_indices = req.row[: len(token_ids)]
        key = self.page_aligned(token_ids)
        prefix_len, _ = self.insert(key, kv_indices, req.cache_salt)
        prompt_key = self.page_aligned(token_ids[: len(req.origin_input_ids)])
        if 0 < len(prompt_key) < len(key):
            self.insert(prompt_key, kv_indices[: len(prompt_key)], req.cache_salt)
        self.free(kv_indices[req.cache_protected_len : prefix_len])
        new_indices, new_last_node = self.match_prefix(key, req.cache_salt)
        assert len(new_indices) == len(key)
        req.row[req.cache_protected_len : len(new_indices)] = new_indices[req.cache_protected_len :]
        req.cache_protected_len = len(new_indices)
        assert req.last_node is not None
        self.dec_lock_ref(req.last_node)
        self.inc_lock_ref(new_last_node)
        req.last_node = new_last_node

    def release_kv_cache(self, req: Req, checkpoint: bool) -> None:
        owned_kv_len = req.kv_committed_len
        if checkpoint:
            self.checkpoint(req, owned_kv_len)
        self.free(req.row[req.cache_protected_len : owned_kv_len])
        assert req.last_node is not None
        self.dec_lock_ref(req.last_node)
        del self.reqs[req.rid]

    def check_decode_mem(self) -> bool:
        new_pages = sum(1 for r in self.reqs.values() if r.kv_committed_len % self.page_size == 0)
        self.evict_from_tree_cache(new_pages * self.page_size)
        return self.available_size() >= new_pages * self.page_size

    def grow(self, req: Req) -> bool:
        if self.decode_checked is None:
            self.decode_checked = self.check_decode_mem()
            if self.decode_checked and self.page_size > 1:  # alloc_paged_token_slots_decode
                self.evict_from_tree_cache(len(self.reqs) * self.page_size)
        if not self.decode_checked:
            return False
        if req.kv_committed_len % self.page_size == 0:
            req.row.append(self.alloc_pages(1)[0] * self.page_size)
        else:
            req.row.append(req.row[-1] + 1)
        req.kv_committed_len += 1
        return True

    def retract(self, req: Req) -> None:
        """``release_req``, then the retract loop's check of the requests left."""
        self.release_kv_cache(req, checkpoint=False)
        self.evict_from_tree_cache(len(self.reqs) * RETRACT_DECODE_STEPS)
        self.retracted = True
        running = list(self.reqs.values())
        self.new_token_ratio.current = NewTokenRatioTracker.estimate_new_token_ratio_after_retract(
            running
        )
        if self.decode_checked is False:
            self.decode_checked = self.check_decode_mem()
            if self.decode_checked and self.page_size > 1:
                self.evict_from_tree_cache(len(self.reqs) * self.page_size)

    def flush_cache(self) -> bool:
        if self.reqs:
            return False
        self.reset()
        self.free_pages = list(range(1, self.num_pages + 1))  # token_to_kv_pool_allocator.clear()
        return True

    def resident_hashes(self) -> set[bytes]:
        found: set[bytes] = set()
        stack = list(self.root_node.children.values())
        while stack:
            node = stack.pop()
            found.update(bytes.fromhex(h) for h in self.event_hashes(node))
            stack.extend(node.children.values())
        return found

    def check_accounting(self) -> None:
        """Every page is free, in the tree, or in a request's row: none twice, none lost."""
        owned: list[int] = list(self.free_pages)
        stack = list(self.root_node.children.values())
        while stack:
            node = stack.pop()
            assert node.value is not None
            owned += sorted({s // self.page_size for s in node.value})
            stack.extend(node.children.values())
        for r in self.reqs.values():
            own = r.row[r.cache_protected_len : r.kv_committed_len]
            owned += sorted({s // self.page_size for s in own})
        assert sorted(owned) == list(range(1, self.num_pages + 1))


# -- the engine core drives both -----------------------------------------------------------


class Lockstep:
    """A KV cache manager for the engine core that passes every call to the simulator's
    cache and to the reference; their answers must match."""

    def __init__(self, page_size: int, num_pages: int) -> None:
        self.sim = SglangRadixCache(num_pages, page_size)
        self.ref = ReferenceRadixCache(page_size, num_pages)
        self.ref.kv_event_queue.clear()  # SGLang's start-up AllBlocksCleared: not simulated
        self.block_size, self.num_blocks = page_size, num_pages
        self.refs: dict[SimRequest, Req] = {}
        self.fmt = make_format("sglang", page_size)
        self.retractions = 0
        self.flushes = 0
        self.pages_evicted = 0

    @property
    def capacity_blocks(self) -> int:
        return self.sim.capacity_blocks

    @property
    def num_free(self) -> int:
        return self.sim.num_free

    @property
    def usage(self) -> float:
        return self.sim.usage

    def sync(self) -> None:
        """The engine core samples between steps; SGLang's ``Req`` has every token."""
        for req, ref in self.refs.items():
            ref.output_ids = list(req.output)

    def admit(self, req: SimRequest) -> bool:
        ref = self.refs.setdefault(req, Req(req.request_id, req.prompt, req.max_tokens, req.salt))
        self.sync()
        ok, hit = self.ref.admit(ref)
        assert self.sim.admit(req) == ok, f"{req.request_id}: admission differs"
        if ok:
            assert req.hit_tokens == hit, f"{req.request_id}: cached tokens differ"
        return ok

    def grow(self, req: SimRequest) -> bool:
        self.sync()
        ok = self.ref.grow(self.refs[req])
        assert self.sim.grow(req) == ok, f"{req.request_id}: decode room differs"
        return ok

    def after_forward(self, admitted: Sequence[SimRequest]) -> None:
        self.ref.run_prefill_batch()
        self.sim.after_forward(admitted)

    def preempt(self, req: SimRequest) -> None:
        self.retractions += 1
        self.sync()
        self.ref.retract(self.refs[req])
        self.sim.preempt(req)

    def finish(self, req: SimRequest) -> None:
        self.sync()
        ref = self.refs.pop(req)
        self.ref.release_kv_cache(ref, checkpoint=True)
        self.sim.finish(req)

    def clear(self) -> bool:
        ok = self.ref.flush_cache()
        assert self.sim.clear() == ok
        self.flushes += ok
        return ok

    def reset(self) -> None:
        raise AssertionError("not driven here")

    def take_events(self) -> list[PoolEvent]:
        raise AssertionError("compare() takes them")

    def cached_digests(self) -> set[bytes]:
        return self.sim.cached_digests()

    def compare(self, step: int) -> None:
        """After a step: the same events, pages free and, when either published anything
        (else neither changed what it holds), the same pages resident."""
        self.ref.check_accounting()
        ref_free = self.ref.available_size() + self.ref.evictable_size_
        assert self.sim.num_free * self.sim.block_size == ref_free, f"step {step}: free pages"
        events = self.sim_events()
        assert events == self.ref_events(), f"step {step}: events"
        if events:
            assert self.sim.cached_digests() == self.ref.resident_hashes(), f"step {step}"

    def sim_events(self) -> list[tuple[Any, ...]]:
        encoded = self.fmt.encode_events(self.sim.take_events())  # type: ignore[attr-defined]
        return [_event_tuple(msgspec.to_builtins(e) | {"type": type(e).__name__}) for e in encoded]

    def ref_events(self) -> list[tuple[Any, ...]]:
        events, self.ref.kv_event_queue = self.ref.kv_event_queue, []
        removed = (e["block_hashes"] for e in events if e["type"] == "BlockRemoved")
        self.pages_evicted += sum(len(hashes) for hashes in removed)
        return [_event_tuple(e) for e in events]


def _event_tuple(e: dict[str, Any]) -> tuple[Any, ...]:
    kind = e["type"].removeprefix("_Sg")
    if kind == "BlockStored":
        fields = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "cache_salt")
        return (kind, *(_freeze(e.get(f)) for f in fields))
    if kind == "BlockRemoved":
        return (kind, tuple(e["block_hashes"]))
    return (kind,)


def _freeze(value: Any) -> Any:
    return tuple(value) if isinstance(value, list) else value


# -- request streams ------------------------------------------------------------------------


@dataclass(frozen=True)
class Stream:
    page_size: int
    num_pages: int
    max_running: int
    n_requests: int
    n_prefixes: int
    seed: int
    arrivals_per_step: int = 1
    flush_every: int = 0  # a /flush_cache attempt every N steps (0: never)
    output: int | None = None  # every request's max_tokens (None: drawn)


def make_requests(s: Stream) -> list[SimRequest]:
    """Zipf-weighted shared prefixes, random suffixes over a small vocabulary (so that
    suffixes share leading tokens too and nodes split mid-way), some salted, some as
    long as the whole cache."""
    rng = random.Random(s.seed)
    capacity = s.num_pages * s.page_size
    longest = max(4, min(capacity // 3, 600))
    prefixes = [
        [rng.randrange(40) for _ in range(rng.randint(1, longest))] for _ in range(s.n_prefixes)
    ]
    weights = [1 / (rank + 1) for rank in range(s.n_prefixes)]
    reqs = []
    for i in range(s.n_requests):
        max_tokens = s.output if s.output is not None else rng.choice([0, 1, 2, 5, 12, 40, 150])
        if rng.random() < 0.05:  # as long as the cache allows, or longer (rejected)
            prompt = [rng.randrange(40) for _ in range(capacity - max_tokens + rng.choice([-1, 1]))]
        else:
            prefix = rng.choices(prefixes, weights)[0]
            cut = rng.randint(1, len(prefix))
            prompt = prefix[:cut] + [rng.randrange(8) for _ in range(rng.randint(0, longest // 2))]
        salt = "tenant-a" if rng.random() < 0.1 else None
        reqs.append(SimRequest(f"r{i}", prompt, max_tokens, salt))
    return reqs


def run_stream(s: Stream) -> tuple[list[SimRequest], Lockstep]:
    cache = Lockstep(s.page_size, s.num_pages)
    limits = CoreLimits(s.page_size, s.num_pages, s.max_running, max_model_len=1 << 20)
    core = EngineCore(limits, SglangSha256Hasher(), TimingModel(), cache)
    pending = deque(make_requests(s))
    done: list[SimRequest] = []
    for step in itertools.count():
        for _ in range(s.arrivals_per_step):
            if pending:
                with contextlib.suppress(RequestRejected):  # longer than the cache
                    core.add(pending.popleft())
        if not (pending or core.has_work):
            break
        done += core.step().finished
        if s.flush_every and step % s.flush_every == 0:
            cache.clear()
        cache.compare(step)
        assert step < 50_000, "the stream did not drain"
    return done, cache


# -- the tests ------------------------------------------------------------------------------

SIZES: list[tuple[int, int]] = [(1, 16), (1, 64), (1, 512), (1, 4096), (16, 16), (16, 128)]
SIZES += [(16, 4096), (32, 16), (32, 96), (32, 1024)]


@pytest.mark.parametrize(("page_size", "num_pages"), SIZES)
@pytest.mark.parametrize("max_running", [1, 6])
def test_sim_cache_matches_sglang_at_every_size(page_size: int, num_pages: int, max_running: int):
    s = Stream(page_size, num_pages, max_running, n_requests=60, n_prefixes=6, seed=num_pages)
    done, cache = run_stream(s)
    assert any(r.num_cached_tokens for r in done), "no request hit the cache"
    if num_pages * page_size <= 2048:
        assert cache.pages_evicted, "the cache never filled"


def test_a_small_cache_evicts_and_still_agrees():
    """Pressure on every path at once: a cache of 16 tokens, eight requests at a time."""
    s = Stream(1, 16, 8, n_requests=120, n_prefixes=3, seed=7, arrivals_per_step=3)
    done, cache = run_stream(s)
    assert len(done) > 60
    assert cache.pages_evicted


@pytest.mark.parametrize(
    ("page_size", "num_pages", "output", "seed"),
    [(1, 96, 40, 1), (1, 160, 60, 0), (4, 32, 40, 0), (16, 16, 100, 0), (32, 16, 100, 1)],
)
def test_long_outputs_outgrow_the_budget_and_are_retracted_alike(
    page_size: int, num_pages: int, output: int, seed: int
):
    """The admission budget expects 70% of a running request's remaining output; every
    request writing all of it, some must be retracted (and the ratio re-estimated)."""
    s = Stream(page_size, num_pages, 8, 80, 2, seed, arrivals_per_step=4, output=output)
    done, cache = run_stream(s)
    assert len(done) == 80
    assert cache.retractions


def test_flushes_between_requests_agree():
    s = Stream(16, 64, 4, n_requests=60, n_prefixes=4, seed=3, flush_every=5)
    _, cache = run_stream(s)
    assert cache.flushes


stream_params: Callable[..., Any] = st.builds(
    Stream,
    page_size=st.sampled_from([1, 16, 32]),
    num_pages=st.sampled_from([16, 24, 48, 128, 512, 4096]),
    max_running=st.integers(1, 8),
    n_requests=st.integers(1, 40),
    n_prefixes=st.integers(1, 8),
    seed=st.integers(0, 2**32),
    arrivals_per_step=st.integers(1, 4),
    flush_every=st.sampled_from([0, 0, 0, 7]),
    output=st.sampled_from([None, None, None, 100]),
)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(stream_params)
def test_random_streams_agree(s: Stream):
    run_stream(s)
