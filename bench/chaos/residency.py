"""Does the router's residency equal the engines' caches? Checked key for key.

Two views are compared for every replica:

- the **engine's cache**: each ``kvroute-sim``'s ``GET /sim/state`` (the engine block
  hashes it can hit now);
- the **residency** a proxy routes by: a fresh snapshot of the control plane's
  ``RoutingState.Watch`` stream (each replica's router block keys), asked as a proxy
  asks, with no epoch held.

They live in different key spaces (engine hashes, router keys), so a :class:`PromptBook`
of every prompt sent translates: for each prompt's tokens it computes the engine's block
hashes (``enginesim.hashing``, the engine's own chain) and the router keys
(``kvcore.keys``, the router's), independently of the sidecar whose translation is under
test. A block that holds generated tokens is in no prompt: those are compared by count.

Under load both views move, so one check reads the engines, then the control plane a
moment later, then the engines again (:func:`compare`): a key the engine held at both
reads must be in the residency (else *missing*), a key in the residency must have been
in the engine at one of them (else *extra*: the router believes in a block the engine
no longer has). Equal means neither, on every replica; except that a replica the control
plane flags ``state_incomplete`` (its sidecar lost events for good and says its keys may
be missing, never wrong) is held only to that promise: no extra key, missing ones counted
apart.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import grpc

from enginesim.hashing import prompt_digests
from enginesim.tokens import PromptTokenizer
from enginesim.wire import make_format
from kvcore.engine_events import normalize_hash
from kvcore.keys import DEFAULT_BLOCK_SIZE, block_keys
from kvcore.pb import routing_pb2

WATCH_METHOD = "/kvroute.v1.RoutingState/Watch"  # the method the proxies call
SNAPSHOT_TIMEOUT_S = 10.0
SETTLE_S = 0.5  # the residency is read this long after the engines: events' way through


class PromptBook:
    """Engine block hash -> router key of every full block of every prompt sent."""

    def __init__(self, model: str, tokenizer: str, event_format: str = "vllm") -> None:
        self.model = model
        self.tokenizer = PromptTokenizer(tokenizer)
        self.hasher = make_format(event_format, DEFAULT_BLOCK_SIZE).hasher  # type: ignore[arg-type]
        self.router_of: dict[int, int] = {}  # engine hash -> router key
        self.router_keys: set[int] = set()

    def add_chat(self, messages: list[dict[str, Any]]) -> None:
        tokens = self.tokenizer.encode_chat(messages, tools=None, add_generation_prompt=True)
        engine = prompt_digests(self.hasher, tokens, DEFAULT_BLOCK_SIZE, None)
        router = block_keys(tokens, model=self.model, block_size=DEFAULT_BLOCK_SIZE)
        for digest, key in zip(engine, router, strict=True):
            self.router_of[normalize_hash(self.hasher.event_id(digest))] = key
        self.router_keys.update(router)


@dataclass
class ReplicaCheck:
    """One replica's comparison (router keys)."""

    replica: str
    engine_blocks: int  # what the engine held at the second read
    residency_keys: int
    missing: int  # held by the engine at both reads, absent from the residency
    extra: int  # in the residency, in the engine at neither read
    unexplained: int  # engine blocks no prompt explains (generated tokens): by count
    incomplete: bool = False  # flagged state_incomplete: may miss keys, never hold wrong ones

    @property
    def equal(self) -> bool:
        return self.extra == 0 and (self.missing == 0 or self.incomplete)


@dataclass
class Check:
    at: float  # the checker's clock when the residency was read
    controlplane: str
    replicas: list[ReplicaCheck] = field(default_factory=list)

    @property
    def equal(self) -> bool:
        return all(r.equal for r in self.replicas)

    @property
    def above_caches(self) -> int:
        """Keys the residency holds that no engine had: the residency above the caches."""
        return sum(r.extra for r in self.replicas)

    def summary(self) -> dict[str, Any]:
        return {
            "controlplane": self.controlplane,
            "missing": sum(r.missing for r in self.replicas),
            "incomplete": sorted(r.replica for r in self.replicas if r.incomplete),
            "extra": self.above_caches,
            "engine_blocks": sum(r.engine_blocks for r in self.replicas),
            "residency_keys": sum(r.residency_keys for r in self.replicas),
        }


@dataclass
class Residency:
    keys: dict[str, set[int]]  # replica id -> router keys
    incomplete: set[str]  # replicas flagged state_incomplete


async def residency_snapshot(address: str) -> Residency:
    """Each replica's router keys in a fresh snapshot from the control plane at
    ``address`` (``host:port`` of its gRPC server), as a new proxy would get it."""
    async with grpc.aio.insecure_channel(address) as channel:
        watch = channel.unary_stream(
            WATCH_METHOD,
            request_serializer=routing_pb2.WatchRequest.SerializeToString,
            response_deserializer=routing_pb2.StateUpdate.FromString,
        )
        call = watch(routing_pb2.WatchRequest(proxy_id="kvroute-bench-chaos"))
        names: dict[int, str] = {}
        keys: dict[int, set[int]] = {}
        incomplete: set[str] = set()
        try:
            async with asyncio.timeout(SNAPSHOT_TIMEOUT_S):
                while True:
                    update = await call.read()
                    if update is grpc.aio.EOF:
                        raise ConnectionError(f"{address} ended the stream mid-snapshot")
                    if not update.HasField("snapshot"):
                        continue
                    chunk = update.snapshot
                    names.update((r.ordinal, r.replica_id) for r in chunk.replicas)
                    incomplete.update(r.replica_id for r in chunk.replicas if r.state_incomplete)
                    for blocks in chunk.residency:
                        keys.setdefault(blocks.ordinal, set()).update(blocks.keys)
                    if chunk.last_chunk:
                        break
        finally:
            call.cancel()
    by_name = {name: keys.get(ordinal, set()) for ordinal, name in names.items()}
    return Residency(by_name, incomplete)


async def engine_cache(session: aiohttp.ClientSession, url: str) -> set[int]:
    """The engine block hashes ``kvroute-sim`` at ``url`` can hit now."""
    async with session.get(f"{url}/sim/state") as response:
        response.raise_for_status()
        state = await response.json()
    return {normalize_hash(h) for h in state["cached_block_hashes"]}


def compare_replica(
    replica: str, before: set[int], after: set[int], residency: set[int], book: PromptBook
) -> ReplicaCheck:
    """One replica's check; see the module's docstring."""
    both, either = before & after, before | after
    known = book.router_of
    held = {known[h] for h in both if h in known}
    held_once = {known[h] for h in either if h in known}
    explained = residency & book.router_keys
    unexplained_engine = sum(1 for h in after if h not in known)
    unexplained_lo = sum(1 for h in both if h not in known)
    unexplained_hi = sum(1 for h in either if h not in known)
    others = len(residency) - len(explained)  # generated-token blocks, by count
    return ReplicaCheck(
        replica,
        len(after),
        len(residency),
        len(held - explained) + max(0, unexplained_lo - others),
        len(explained - held_once) + max(0, others - unexplained_hi),
        unexplained_engine,
    )


async def compare(
    session: aiohttp.ClientSession,
    engines: dict[str, str],
    controlplane: str,
    book: PromptBook,
    clock: Any,
) -> Check:
    """Engines, then (``SETTLE_S`` later) the residency at ``controlplane``, then the
    engines again; ``engines`` maps replica id -> engine URL (the live ones)."""
    before = await _engine_caches(session, engines)
    await asyncio.sleep(SETTLE_S)  # the events' way to the control plane: the check's schedule
    residency = await residency_snapshot(controlplane)
    at = clock()
    after = await _engine_caches(session, engines)
    check = Check(at, controlplane)
    for replica in engines:
        held = residency.keys.get(replica, set())
        one = compare_replica(replica, before[replica], after[replica], held, book)
        one.incomplete = replica in residency.incomplete
        check.replicas.append(one)
    check.replicas.extend(_unknown_replicas(residency.keys, engines))
    return check


def _unknown_replicas(residency: dict[str, set[int]], engines: Iterable[str]) -> list[ReplicaCheck]:
    """Replicas the residency holds keys for that are not live engines: all extra."""
    return [
        ReplicaCheck(name, 0, len(keys), 0, len(keys), 0)
        for name, keys in residency.items()
        if name not in engines and keys
    ]


async def _engine_caches(
    session: aiohttp.ClientSession, engines: dict[str, str]
) -> dict[str, set[int]]:
    caches = await asyncio.gather(*(engine_cache(session, url) for url in engines.values()))
    return dict(zip(engines, caches, strict=True))
