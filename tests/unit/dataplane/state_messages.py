"""Real ``routing.proto`` messages for the proxy-state tests: snapshots, deltas, configs."""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from typing import Any

from kvcore.pb import events_pb2, routing_pb2

HEALTHY = routing_pb2.REPLICA_STATUS_HEALTHY
DRAINING = routing_pb2.REPLICA_STATUS_DRAINING
UNHEALTHY = routing_pb2.REPLICA_STATUS_UNHEALTHY
MODEL = "m"


def replica(
    ordinal: int,
    *,
    model: str = MODEL,
    served: Sequence[str] = (),
    status: int = HEALTHY,
    running: int = 0,
    waiting: int = 0,
    report_ts: float = 0.0,
    capacity: int = 64,
    replica_id: str | None = None,
) -> routing_pb2.Replica:
    info = routing_pb2.Replica(
        ordinal=ordinal,
        replica_id=replica_id or f"r{ordinal}",
        pool="default",
        base_url=f"http://127.0.0.1:{9000 + ordinal}",
        model=model,
        served_names=list(served),
        engine_kind=events_pb2.ENGINE_KIND_VLLM,
        block_size=16,
        status=status,
        capacity_seqs=capacity,
    )
    if report_ts:
        info.load.CopyFrom(load(running, waiting, report_ts))
    return info


def load(running: int, waiting: int, ts: float, kv_usage: float = 0.0) -> events_pb2.LoadReport:
    return events_pb2.LoadReport(running=running, waiting=waiting, kv_usage=kv_usage, ts=ts)


def config(
    workloads: Iterable[dict[str, Any]] = (),
    *,
    rules: dict[str, Any] | None = None,
    models: Iterable[routing_pb2.Model] = (),
    revision: int = 1,
) -> routing_pb2.RoutingConfig:
    return routing_pb2.RoutingConfig(
        revision=revision,
        workloads=[
            routing_pb2.Workload(name=w["name"], policy_json=json.dumps(w)) for w in workloads
        ],
        rules_json=json.dumps(rules) if rules else "",
        models=list(models),
    )


def model_entry(name: str, **entry: Any) -> routing_pb2.Model:
    return routing_pb2.Model(
        name=name,
        tokenizer=entry.get("tokenizer", "builtin"),
        block_size=16,
        pool="default",
        model_json=json.dumps({"name": name, **entry}),
    )


def snapshot(
    epoch: int,
    version: int,
    replicas: Sequence[routing_pb2.Replica],
    residency: dict[int, Sequence[int]] | None = None,
    *,
    routing: routing_pb2.RoutingConfig | None = None,
    chunks: int = 1,
) -> list[routing_pb2.StateUpdate]:
    """A snapshot cut into ``chunks``: config and replicas on the first, residency
    spread over all (one replica's keys may straddle two chunks)."""
    blocks = [(o, list(keys)) for o, keys in (residency or {}).items()]
    parts: list[list[routing_pb2.ReplicaBlocks]] = [[] for _ in range(chunks)]
    for ordinal, keys in blocks:
        half = len(keys) // 2
        parts[ordinal % chunks].append(routing_pb2.ReplicaBlocks(ordinal=ordinal, keys=keys[:half]))
        parts[-1].append(routing_pb2.ReplicaBlocks(ordinal=ordinal, keys=keys[half:]))
    updates = []
    for index in range(chunks):
        chunk = routing_pb2.SnapshotChunk(
            chunk_index=index, last_chunk=index == chunks - 1, residency=parts[index]
        )
        if index == 0:
            chunk.replicas.extend(replicas)
            chunk.config.CopyFrom(routing or routing_pb2.RoutingConfig())
        updates.append(routing_pb2.StateUpdate(epoch=epoch, version=version, snapshot=chunk))
    return updates


def delta(epoch: int, version: int, **body: Any) -> routing_pb2.StateUpdate:
    return routing_pb2.StateUpdate(epoch=epoch, version=version, delta=routing_pb2.Delta(**body))


def residency_change(
    ordinal: int, added: Sequence[int] = (), removed: Sequence[int] = (), cleared: bool = False
) -> routing_pb2.ResidencyChange:
    return routing_pb2.ResidencyChange(
        ordinal=ordinal, cleared=cleared, added=list(added), removed=list(removed)
    )
