"""Workload policies: the typed, validated routing settings an operator writes.

A *workload* is a named routing policy; every request is classified into one. Its
settings are a discriminated union on ``strategy``, so that each strategy accepts
exactly its own fields and an unknown or misspelt field is refused by name. The models
are frozen: the control plane stores them in etcd as JSON and proxies receive them in
their routing state; nobody mutates one in place.
"""

from __future__ import annotations

import re
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from kvcore.workload.warmup import WarmupSettings

FallbackStrategy = Literal["round_robin", "least_load", "prefix_hash"]
NAME_PATTERN = r"^[A-Za-z0-9_-]{1,64}$"
_SESSION_KEY = re.compile(r"^(?:body\.[A-Za-z0-9_]{1,64}|[A-Za-z0-9-]{1,128})$")


class _Settings(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", validate_default=True)


class WorkloadBase(_Settings):
    """Settings every strategy shares."""

    name: str = Field(
        "default",
        pattern=NAME_PATTERN,
        description="Workload name: letters, digits, '_' and '-', at most 64 characters.",
    )
    description: str = Field("", max_length=500, description="Free text for operators.")
    load_threshold: float = Field(
        0.9,
        gt=0,
        le=1,
        description="A replica whose load (1: every seat taken) is at or above this is "
        "skipped (hashing strategies pass the key on along the ring), unless every replica is.",
    )
    max_inflight_per_replica: int = Field(
        256,
        ge=1,
        description="A replica with this many running + waiting + in-flight requests "
        "counts as saturated, like one over load_threshold.",
    )
    tenant_isolation: bool = Field(
        False,
        description="Salt block keys with the tenant's namespace so that tenants never "
        "share cached blocks (and set cache_salt upstream). The tenant is the API key's, or "
        "without keys the proxy's tenant header; a client's cache_salt only subdivides it.",
    )
    warmup: WarmupSettings = Field(
        WarmupSettings.model_validate({}),  # frozen, so one shared default; `make native`'s
        # type check refuses the class itself as a default_factory
        description="Hot prefixes kept by the proxies and replayed into replicas that join "
        "empty (see docs/operations.md, Warm-up and drain).",
    )
    lora_on_miss: Literal["refuse", "load"] = Field(
        "refuse",
        description="A request naming a LoRA adapter no routable replica has loaded: "
        "'refuse' answers OpenAI's 404 model_not_found; 'load' loads it (its path as a "
        "replica announced it) onto the least-loaded replica of its base model through the "
        "engine's API and routes there; 'load' also loads it onto another replica when "
        "every holder is at lora_spread_load.",
    )
    lora_spread_load: float = Field(
        0.6,
        gt=0,
        le=1,
        description="With lora_on_miss 'load': once every replica holding an adapter is at "
        "this load (1: every seat taken), the adapter is loaded onto one more replica "
        "(0.6: the best of 0.5-0.9 in kvroute bench sim's adapters scenarios).",
    )
    lora_max_per_replica: int = Field(
        8,
        ge=1,
        le=1024,
        description="With lora_on_miss 'load': adapters a replica keeps loaded; loading one "
        "more first unloads the one this proxy routed to least recently.",
    )
    lora_load_replicas: int = Field(
        0,
        ge=0,
        le=1024,
        description="POST /v1/load_lora_adapter through the proxy loads the adapter onto "
        "this many replicas of the model, least loaded first; 0: every one.",
    )


class RoundRobinWorkload(WorkloadBase):
    """Level 0: replicas in turn, skipping saturated ones."""

    strategy: Literal["round_robin"] = "round_robin"


class LeastLoadWorkload(WorkloadBase):
    """Level 0: the replica with the lowest load; ties at random."""

    strategy: Literal["least_load"] = "least_load"


class _RingSettings(WorkloadBase):
    virtual_nodes: int = Field(
        128,
        ge=1,
        le=4096,
        description="Points per replica on the consistent-hash ring; more points "
        "spread keys more evenly.",
    )


class _WithFallback(WorkloadBase):
    fallback: FallbackStrategy = Field(
        "least_load",
        description="Strategy used when this one has nothing to key on (no session id, "
        "no residency data).",
    )


class PrefixHashWorkload(_RingSettings):
    """Level 2: the hash of the prompt's first ``prefix_tokens`` tokens on a
    bounded-load consistent-hash ring."""

    strategy: Literal["prefix_hash"] = "prefix_hash"
    prefix_tokens: int = Field(
        256,
        ge=1,
        description="How many leading prompt tokens pick the replica (rounded down to "
        "whole blocks; a prompt shorter than one block is hashed whole).",
    )


class SessionAffinityWorkload(_RingSettings, _WithFallback):
    """Level 1: the session id on a bounded-load consistent-hash ring."""

    strategy: Literal["session_affinity"] = "session_affinity"
    session_key: str = Field(
        "x-session-id",
        description="Where the session id is: a request header name (e.g. "
        "'x-session-id') or 'body.<field>' for a top-level JSON body field (e.g. "
        "'body.user').",
    )

    @field_validator("session_key")
    @classmethod
    def _session_key_shape(cls, value: str) -> str:
        if not _SESSION_KEY.match(value):
            raise ValueError("must be a header name or 'body.<field>'")
        return value.lower() if not value.startswith("body.") else value


class _KvSettings(_WithFallback):
    locality_weight: float = Field(
        0.7,
        ge=0,
        le=1,
        description="How much cache locality counts against load (alpha): 0 ignores "
        "the cache, 1 ignores load below the threshold.",
    )
    speculative_ttl_s: float = Field(
        2.0,
        ge=0,
        le=600,
        description="After routing, count the prompt's blocks as held by the chosen "
        "replica for this long, until the engine's own events arrive (0 disables).",
    )
    hot_prefix_gap: int | None = Field(
        4,
        ge=0,
        description="When the prefix the chosen replica holds of the prompt is hot (its "
        "share of this router's recent requests would fill at least two replicas' fair "
        "share, such as one system prompt every request starts with, and enough of the "
        "fleet's requests stand behind that share) and the chosen replica has more than "
        "this many requests beyond the least busy usable replica, another takes the "
        "request and holds the prefix from then on (kv_aware: the least busy; kv_cost: "
        "the cheapest, each usable replica counted as holding the prefix): a hot prefix "
        "is cheap to replicate, and kept where it is cached it leaves a few replicas busy "
        "while the rest idle. null: off.",
    )
    prefix_tokens: int = Field(256, ge=1, description="prefix_tokens for the prefix_hash fallback.")
    max_imbalance: int | None = Field(
        64,
        ge=1,
        description="When the replica the score chose has more than this many requests "
        "(running, waiting and sent since its last report) beyond the least busy usable "
        "replica, that one takes the request instead (SGLang's balance_abs_threshold): a "
        "prefix that makes most of every prompt, such as a long system prompt, would "
        "otherwise keep all traffic on its first holder until it saturates. null: off.",
    )


class KvAwareWorkload(_KvSettings):
    """Level 3: score = alpha * hit + (1 - alpha) * (1 - load), highest wins."""

    strategy: Literal["kv_aware"] = "kv_aware"
    min_hit: float = Field(
        0.3,
        ge=0,
        le=1,
        description="A hit below this share of the prompt counts as none (SGLang's "
        "cache_threshold): a short prefix every request shares, such as a system prompt, "
        "is cheap to replicate and would otherwise pull every request to its first holder.",
    )


class KvCostWorkload(_KvSettings):
    """Level 3, the default: the lowest (1 - alpha) * wait + alpha * prefill, in seconds
    (queued prefill work ahead of the request, and this prompt's uncached tokens, at the
    replica's prefill rate)."""

    strategy: Literal["kv_cost"] = "kv_cost"
    locality_weight: float = Field(
        0.8,
        ge=0,
        le=1,
        description="alpha: how a second of prefill this replica's cache would not save "
        "weighs against a second of waiting there. 0.5 ranks by the plain predicted time "
        "to first token; above it a recomputed second counts alpha / (1 - alpha) queued "
        "ones (0.8: 4), since a miss also delays the requests that come after it; 1 ranks "
        "by the cache alone, 0 by the queue alone. While the engines report requests "
        "waiting, the prefill weighs (1 + their median per replica) times more: each "
        "second of it also delays those behind it.",
    )
    prefill_tokens_per_s: float = Field(
        10_000.0,
        gt=0,
        description="Prefill rate assumed for a replica that does not report its own (also "
        "how fast a replica is assumed to work through the prefill a proxy sent it).",
    )
    hot_prefix_gap: int | None = Field(
        0,
        ge=0,
        description="As kv_aware's, but the replica that takes a hot prefix is the "
        "cheapest by this score with the prefix counted as held by every usable replica "
        "(the holder keeps it when it is cheapest): 0, the default, counts a hot prefix "
        "as held everywhere as soon as its holder has any request beyond the least busy "
        "replica, since its prefill saving is no reason to prefer the replicas that "
        "happened to receive it first. null: off.",
    )
    queued_request_tokens: int = Field(
        1024,
        ge=0,
        description="Prompt tokens assumed per queued request when a replica reports "
        "only how many requests wait, not how many tokens.",
    )
    engine_prefill_rates: bool = Field(
        True,
        description="Rank a replica's prefill speed by its engine's own timing of its "
        "requests (the prefill totals of its load reports) where that tells, rather "
        "than by this router's first-token timings, which behind several routers also "
        "wait for the other routers' prefills queued there.",
    )


Workload = Annotated[
    RoundRobinWorkload
    | LeastLoadWorkload
    | SessionAffinityWorkload
    | PrefixHashWorkload
    | KvAwareWorkload
    | KvCostWorkload,
    Field(discriminator="strategy"),
]
STRATEGIES: tuple[str, ...] = (
    "round_robin",
    "least_load",
    "session_affinity",
    "prefix_hash",
    "kv_aware",
    "kv_cost",
)
