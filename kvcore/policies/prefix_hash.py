"""Level 2: prompts that start alike go to one replica (bounded-load consistent hashing).

The ring key is the router block key of the last full block within the first
``prefix_tokens`` tokens: block keys chain, so that one key stands for the whole prefix
(and for model, adapter and tenant). Prompts with no full block there are keyed by a
hash of their first tokens.
"""

from __future__ import annotations

import random
from typing import ClassVar

import xxhash

from kvcore.keys import token_bytes
from kvcore.policies.base import Decision, RouteContext, StateView
from kvcore.policies.hash_ring import RingRouter
from kvcore.workload import PrefixHashWorkload


def prefix_key(ctx: RouteContext, prefix_tokens: int) -> int:
    """The ring key of the prompt's first ``prefix_tokens`` tokens."""
    blocks = min(len(ctx.block_keys), prefix_tokens // ctx.block_size)
    if blocks:
        return ctx.block_keys[blocks - 1]
    head = token_bytes(ctx.token_ids[:prefix_tokens])
    return xxhash.xxh3_64_intdigest(ctx.model.encode() + b"\0" + head)


class PrefixHashPolicy:
    """The prefix's owner on the ring, passed on past saturated replicas."""

    name: ClassVar[str] = "prefix_hash"
    reads_keys = True

    def __init__(self, workload: PrefixHashWorkload, rng: random.Random) -> None:
        del rng
        self._prefix_tokens = workload.prefix_tokens
        self._router = RingRouter(workload.virtual_nodes)

    def select(self, ctx: RouteContext, state: StateView) -> Decision:
        key = prefix_key(ctx, self._prefix_tokens)
        return self._router.route(self.name, key, ctx, state)
