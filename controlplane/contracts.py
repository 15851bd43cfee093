"""The seams between the control plane's parts, so each can be built and tested alone.

Two halves meet here:

- the **fleet** half (``fleet``/ingest, membership, leader election, the gRPC
  ``RoutingState`` server) keeps what the sidecars report and serves proxies;
- the **records** half (the etcd config store, SQL, the admin REST API, stats, alerts)
  keeps what operators decide and what happened.

The fleet half gives the admin API a :class:`FleetView`; the records half gives the
gRPC stream a :class:`ConfigSource` (what proxies must know: workloads, models, rules,
hashed inference keys) and a :class:`ReportSink` (where proxies' counters go). Each side
depends only on these protocols, never on the other's modules.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from kvcore.pb import routing_pb2
from kvcore.policies import StateView

ReplicaStatusName = Literal["healthy", "draining", "down"]


@dataclass(frozen=True, slots=True)
class ReplicaInfo:
    """One replica as the admin API shows it."""

    replica_id: str
    pool: str
    base_url: str
    model: str
    served_names: tuple[str, ...]
    engine_kind: str  # "vllm" | "sglang"
    status: ReplicaStatusName
    draining: bool  # set by an operator (drain/undrain)
    state_incomplete: bool
    epoch: int
    block_size: int
    running: int
    waiting: int
    kv_usage: float
    resident_blocks: int
    # engine counters (tokens), for the engine-measured hit rate; None before a report
    prefix_cache_queries: int | None
    prefix_cache_hits: int | None
    last_seen: float  # wall-clock seconds of the last announce or load report
    # silent past the heartbeat timeout while silence was no evidence (this instance's
    # NATS link down, or most replicas silent at once): routed on its last state
    stale: bool = False
    role: str = "both"  # "both" | "prefill" | "decode" (kvcore.roles)
    bootstrap_port: int = 0  # an SGLang prefill server's bootstrap server; 0: none
    # the LoRA adapters the engine has loaded: name -> the path it was loaded from
    lora_adapters: dict[str, str] = field(default_factory=dict)
    # the leader's warm-up of the replica, running or last (controlplane.fleet.warmup):
    # warming, prefixes pending, and per workload planned/sent/confirmed/failed/outcome
    warmup: dict[str, Any] | None = None
    # the prefill speed the proxies have learned (controlplane.fleet.learned_rates):
    # medians over the proxies that reported one lately; None while none has
    learned: dict[str, Any] | None = None

    @property
    def hit_rate(self) -> float | None:
        if not self.prefix_cache_queries or self.prefix_cache_hits is None:
            return None
        return self.prefix_cache_hits / self.prefix_cache_queries


@dataclass(frozen=True, slots=True)
class SharedPrefix:
    key: int
    holders: tuple[str, ...]  # replica ids


@dataclass(frozen=True, slots=True)
class ResidencySummary:
    total_keys: int  # distinct keys held by any replica
    per_replica: dict[str, int]  # replica id -> keys held
    most_shared: tuple[SharedPrefix, ...] = field(default=())


class UnknownReplica(KeyError):
    """No replica with that id."""


class FleetView(Protocol):
    """What the admin API reads and changes of the fleet (implemented by the fleet half)."""

    def replicas(self, pool: str | None = None) -> Sequence[ReplicaInfo]: ...

    async def set_draining(self, replica_id: str, draining: bool) -> ReplicaInfo:
        """Drain or undrain; raises :class:`UnknownReplica`. Proxies see it in their next
        delta; the other instance learns it through etcd membership."""
        ...

    async def residency_summary(self, top: int = 20) -> ResidencySummary:
        """Keys per replica and the ``top`` keys held by the most replicas; the event
        loop runs while the residency is ranked."""
        ...

    def state_view(self, pool: str | None = None) -> StateView:
        """A kvcore view of the fleet (replicas with load, residency) for explain."""
        ...

    def state_position(self) -> tuple[int, int]:
        """``(epoch, version)`` of the routing state that carries everything this view
        shows now: a proxy watching this instance whose ``/readyz`` state shows this epoch
        and at least this version routes on it. ``(0, 0)`` before the stream starts."""
        ...

    def is_leader(self) -> bool: ...


class ConfigSource(Protocol):
    """The live routing config (implemented by the records half, from etcd and SQL)."""

    def current(self) -> routing_pb2.RoutingConfig:
        """Workloads, models, rules and hashed inference keys, with the etcd revision."""
        ...

    def subscribe(self, on_change: Callable[[], None]) -> None:
        """Call ``on_change`` (on the event loop) after every change to ``current()``."""
        ...


class ReportSink(Protocol):
    """Where proxies' ``RoutingState.Report`` counters go (implemented by the records half)."""

    async def record(self, report: routing_pb2.ProxyReport) -> None: ...
