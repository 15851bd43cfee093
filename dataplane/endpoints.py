"""Where a replica is and what it serves: the part of a replica's announcement the
proxy sends requests by (``dataplane.fleet.replicas.ReplicaTable.endpoint``), apart from
its load and residency."""

from __future__ import annotations

from dataclasses import dataclass

from kvcore.pb import events_pb2, routing_pb2
from kvcore.roles import Role, role_name

ENGINE_KINDS = {events_pb2.ENGINE_KIND_VLLM: "vllm", events_pb2.ENGINE_KIND_SGLANG: "sglang"}
ENGINE_KIND_OF = {name: kind for kind, name in ENGINE_KINDS.items()}


@dataclass(frozen=True, slots=True)
class Endpoint:
    """Where a replica is and what it serves."""

    ordinal: int
    replica_id: str
    pool: str
    base_url: str
    model: str
    served_names: tuple[str, ...]
    engine_kind: str  # "vllm", "sglang" or "" when unknown
    role: Role = "both"  # its part in disaggregated prefill/decode (kvcore.roles)
    bootstrap_port: int = 0  # an SGLang prefill server's bootstrap server; 0: none


def endpoint_of(info: routing_pb2.Replica) -> Endpoint:
    """The endpoint of a replica as announced."""
    return Endpoint(
        ordinal=info.ordinal,
        replica_id=info.replica_id,
        pool=info.pool,
        base_url=info.base_url,
        model=info.model,
        served_names=tuple(info.served_names),
        engine_kind=ENGINE_KINDS.get(info.engine_kind, ""),
        role=role_name(info.role),
        bootstrap_port=info.bootstrap_port,
    )
