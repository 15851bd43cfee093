"""The KV cache manager protocol: what the engine core asks of an engine's prefix cache.

The engine core (``scheduler.py``) owns batching: which requests run, in which order,
when one is preempted. Everything about KV memory belongs to a cache manager, one per
engine, because vLLM and SGLang keep their caches by different rules (vLLM v1's block
pool with its free-block queue, ``blockpool.py``; SGLang's radix tree). The core calls,
in one step:

1. ``grow(req)`` for every running request, in order: room for the token the request
   computes this step (its last sampled one); ``False`` means the cache is full, and the
   core preempts the last running request (``preempt``) and tries again;
2. ``admit(req)`` for waiting requests, first come first served: look the request's
   tokens up in the cache, lock the hit, allocate the rest; sets ``req.hit_tokens`` to
   the hit (the core reports the first admission's as ``num_cached_tokens``); ``False``,
   with nothing changed, when there is no room (the request waits);
3. ``after_forward(admitted)`` once the step's forward pass has computed the admitted
   requests' prompts;
4. ``finish(req)`` when a request ends (done or aborted) and releases what it holds.

A manager reads a request's tokens (``req.tokens``) and the engine's digests of its full
blocks (``req.digests``, kept up to date by the core as tokens are sampled) and records
what it decides as ``PoolEvent`` s, which ``wire.py`` encodes as the engine's KV events.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from enginesim.request import LoraTag, SimRequest


@dataclass(frozen=True, slots=True)
class BlocksStored:
    """A run of newly cached full blocks, in sequence order."""

    digests: tuple[bytes, ...]
    parent: bytes | None  # the digest of the block before the run; None at block 0
    token_ids: tuple[int, ...]
    salt: str | None  # vLLM: on a salted request's first block's run; SGLang: on every run
    lora: LoraTag | None = None  # the adapter the blocks were computed with (every run)


@dataclass(frozen=True, slots=True)
class BlockEvicted:
    digest: bytes


@dataclass(frozen=True, slots=True)
class AllCleared:
    pass


PoolEvent = BlocksStored | BlockEvicted | AllCleared


class KVCacheManager(Protocol):
    """One engine's KV cache, as the engine core drives it (see the module docstring)."""

    block_size: int  # tokens per block (SGLang: per page)
    num_blocks: int  # blocks configured, reserved ones included

    @property
    def capacity_blocks(self) -> int:
        """The most blocks one request can ever hold: a longer request is rejected."""
        ...

    @property
    def num_free(self) -> int:
        """Blocks no request holds (free or cached but evictable)."""
        ...

    @property
    def usage(self) -> float:
        """Fraction of usable blocks that requests hold (``kv_cache_usage_perc``)."""
        ...

    def admit(self, req: SimRequest) -> bool:
        """Take ``req``'s cached prefix and allocate the rest of its tokens; sets
        ``req.hit_tokens``."""
        ...

    def grow(self, req: SimRequest) -> bool:
        """Make room for ``req``'s last sampled token, computed in this step."""
        ...

    def after_forward(self, admitted: Sequence[SimRequest]) -> None:
        """The step's forward pass has computed ``admitted``'s tokens."""
        ...

    def finish(self, req: SimRequest) -> None:
        """``req`` ended (done or aborted): release what it holds."""
        ...

    def preempt(self, req: SimRequest) -> None:
        """``req`` goes back to waiting: release what it holds; it is admitted again
        later and recomputes what is no longer cached."""
        ...

    def clear(self) -> bool:
        """``/reset_prefix_cache``: forget every cached block; ``False`` when refused."""
        ...

    def reset(self) -> None:
        """Back to a fresh start, silently: what an engine restart looks like."""
        ...

    def take_events(self) -> list[PoolEvent]:
        """The events recorded since the last call, in order."""
        ...

    def cached_digests(self) -> set[bytes]:
        """The digests a lookup can hit now (the engine's ``/state``, tests)."""
        ...
