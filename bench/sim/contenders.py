"""Policy specs -> router factories: kvroute's strategies, the peers' models, random.

A spec is what the command line and the reports call a contender:

- any kvroute strategy, with any fields of its workload model:
  ``round_robin``, ``kv_aware``, ``kv_aware:locality_weight=0.5,min_hit=0.2``, ...;
- ``sglang:cache_aware``, ``vllm-router:cache_aware``, ``llm-d:precise``, ``dynamo:kv``
  (models in :mod:`bench.sim.peers`);
- ``random``.

The oracle is not a router: every run reports the hit rate of one unlimited cache that
sees the same requests (:func:`bench.sim.workloads.oracle_hit_rate`).
"""

from __future__ import annotations

from bench.sim.engine import EngineShape
from bench.sim.peers import (
    SGLANG,
    VLLM_ROUTER,
    CacheAwareRouter,
    DynamoBook,
    DynamoRouter,
    LlmdRouter,
)
from bench.sim.routers import KvrouteRouter, RandomRouter, is_kvroute, parse_spec
from bench.sim.simulator import FleetReadout, RouterFactory, SimRouter

PEER_MODELS = ("sglang:cache_aware", "vllm-router:cache_aware", "llm-d:precise", "dynamo:kv")
PEERS = (*PEER_MODELS, "random")
KVROUTE = ("round_robin", "least_load", "prefix_hash", "kv_aware", "kv_cost")
DEFAULT = "kv_cost"  # the strategy of the default workload


def router_factory(
    spec: str, shape: EngineShape, *, seed: int, load_period_s: float
) -> RouterFactory:
    """How to build instance i of contender ``spec`` (raises ValueError for an unknown one)."""
    if is_kvroute(spec):
        parse_spec(spec)

        def kvroute(fleet: FleetReadout, i: int) -> SimRouter:
            place = i if fleet.routers > 1 else None  # as `--proxy-index` tells a proxy
            return KvrouteRouter(spec, fleet, shape, seed + i, load_period_s, place)

        return kvroute
    return _peer_factory(spec, shape, seed)


def _peer_factory(spec: str, shape: EngineShape, seed: int) -> RouterFactory:
    if spec == "random":
        return lambda fleet, i: RandomRouter(fleet, seed + i)
    if spec == "sglang:cache_aware":
        return lambda fleet, i: CacheAwareRouter(spec, SGLANG, fleet, shape)
    if spec == "vllm-router:cache_aware":
        return lambda fleet, i: CacheAwareRouter(spec, VLLM_ROUTER, fleet, shape)
    if spec == "llm-d:precise":
        return lambda fleet, i: LlmdRouter(fleet, seed + i)
    if spec == "dynamo:kv":
        books: dict[int, DynamoBook] = {}

        def dynamo(fleet: FleetReadout, i: int) -> SimRouter:
            book = books.setdefault(id(fleet), DynamoBook(len(fleet.replicas)))
            return DynamoRouter(fleet, book, shape, seed + i)

        return dynamo
    raise ValueError(
        f"unknown policy {spec!r}: a kvroute strategy ({', '.join(KVROUTE)}, ...) with "
        f"optional :field=value,..., or one of {', '.join(PEERS)}"
    )
