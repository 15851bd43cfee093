"""A workload's warm-up settings: which prefixes count as hot, and how a new replica is warmed.

Proxies keep, per workload, the token ids of prefixes at least ``min_requests`` distinct
requests began with (so one client's private prompt is never kept), and report them to
the control plane. When a replica joins empty (new, restarted, its cache cleared), the
control plane's leader sends each hot prefix to it once as a one-token completion, most
valuable first, within ``tokens_per_s`` and ``max_tokens``; meanwhile the replica takes
only ``new_prefix_share`` of the requests whose prefix no replica holds yet, and none of
those starting with a prefix it is being warmed with. See ``docs/operations.md``.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class WarmupSettings(BaseModel):
    """How a workload's hot prefixes are kept and replayed into replicas that join empty."""

    model_config = ConfigDict(frozen=True, extra="forbid", validate_default=True)

    enabled: bool = Field(
        False,
        description="Keep this workload's hot prefixes in the proxies and warm replicas "
        "that join empty with them.",
    )
    min_requests: int = Field(
        8,
        ge=2,
        le=10_000,
        description="A prefix is hot once this many distinct requests (distinct prompts) "
        "began with it; only hot prefixes' token ids are kept.",
    )
    max_prefixes: int = Field(
        32,
        ge=1,
        le=1024,
        description="Hot prefixes each proxy keeps and reports for this workload (the "
        "most requested).",
    )
    max_prefix_tokens: int = Field(
        8192,
        ge=16,
        le=131_072,
        description="Longest prefix kept, in tokens (a longer shared beginning is kept "
        "up to this length).",
    )
    tokens_per_s: float = Field(
        50_000.0,
        gt=0,
        description="Warm-up budget: prompt tokens per second sent to one warming replica.",
    )
    max_tokens: int = Field(
        1_000_000,
        ge=1,
        description="Warm-up budget: prompt tokens sent to one replica per warm-up in all.",
    )
    new_prefix_share: float = Field(
        0.25,
        ge=0,
        le=1,
        description="While a replica warms, the share of requests whose prefix no replica "
        "holds yet that it takes (as smg's --worker-warmup-share); it takes no other "
        "request unless every replica is warming.",
    )
    max_duration_s: float = Field(
        120.0,
        gt=0,
        le=3600,
        description="A warm-up not finished after this long ends (the replica is then "
        "routed to as any other).",
    )
    source: Literal["recompute", "transfer"] = Field(
        "recompute",
        description="How a warming replica gets each prefix: recompute (sent as a "
        "one-token completion, the replica prefills it) or transfer (vLLM pools whose "
        "engines run a KV connector in kv_both role, e.g. NixlConnector: a replica "
        "holding the prefix runs it as a one-token prefill for a remote decode, a cache "
        "hit there, and the warming replica reads its KV blocks instead of computing "
        "them; recomputed, one at a time, when no replica holds it, when every holder has "
        "requests waiting while the warming replica is idle, when the transfer fails, or "
        "when either engine is SGLang).",
    )
