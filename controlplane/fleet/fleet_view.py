"""The fleet as others read it: the admin API (:class:`contracts.FleetView`), routing
(kvcore's :class:`ReplicaState` and ``StateView``) and proxies (``routing_pb2.Replica``).

One place turns a :class:`ReplicaRecord` into each of those shapes, so the admin API,
``explain`` and the proxies all see the same status, load and draining flag.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from controlplane.contracts import (
    ReplicaInfo,
    ReplicaStatusName,
    ResidencySummary,
    SharedPrefix,
    UnknownReplica,
)
from controlplane.fleet.fleet import Fleet, ReplicaRecord
from kvcore.index.columns import MostShared
from kvcore.pb import events_pb2, routing_pb2
from kvcore.policies import ReplicaState, StaticStateView
from kvcore.roles import role_name

ENGINE_KIND_NAMES = {events_pb2.ENGINE_KIND_VLLM: "vllm", events_pb2.ENGINE_KIND_SGLANG: "sglang"}


class DrainStore(Protocol):
    """Where drain flags persist (etcd), so the other instance and a restart see them."""

    async def persist_draining(self, pool: str, replica_id: str, draining: bool) -> None: ...


def status_of(record: ReplicaRecord) -> ReplicaStatusName:
    if record.down or not record.announced:
        return "down"
    return "draining" if record.is_draining else "healthy"


_STATUS_PB = {
    "healthy": routing_pb2.REPLICA_STATUS_HEALTHY,
    "draining": routing_pb2.REPLICA_STATUS_DRAINING,
    "down": routing_pb2.REPLICA_STATUS_UNHEALTHY,
}


def replica_pb(record: ReplicaRecord) -> routing_pb2.Replica:
    """The replica as proxies receive it."""
    msg = routing_pb2.Replica(
        ordinal=record.ordinal,
        replica_id=record.replica_id,
        pool=record.pool,
        status=_STATUS_PB[status_of(record)],
        state_incomplete=record.state_incomplete,
    )
    announce = record.announce
    if announce is not None:
        msg.base_url, msg.model = announce.base_url, announce.model
        msg.served_names.extend(announce.served_names)
        msg.engine_kind, msg.block_size = announce.engine_kind, announce.block_size
        msg.engine_block_size = announce.engine_block_size
        msg.role, msg.bootstrap_port = announce.role, announce.bootstrap_port
        msg.labels.update(announce.labels)
        msg.lora_adapters.update(announce.lora_adapters)
    if record.load is not None:
        msg.load.CopyFrom(record.load)
    if record.warmup is not None:
        msg.warmup.warming = True
        msg.warmup.pending_keys.extend(sorted(record.warmup))
    return msg


def replica_state(record: ReplicaRecord) -> ReplicaState:
    """The replica as kvcore's policies see it (for explain)."""
    announce, load = record.announce, record.load
    models = (
        frozenset((announce.model, *announce.served_names, *announce.lora_adapters))
        if announce
        else frozenset()
    )  # an adapter: a name only its holders serve, as the proxies see it
    return ReplicaState(
        ordinal=record.ordinal,
        replica_id=record.replica_id,
        models=models - {""},
        healthy=status_of(record) != "down",
        draining=record.is_draining,
        running=load.running if load else 0,
        waiting=load.waiting if load else 0,
        kv_usage=min(max(load.kv_usage, 0.0), 1.0) if load else 0.0,
    )


def replica_info(
    record: ReplicaRecord,
    resident_blocks: int,
    warmup: dict[str, Any] | None = None,
    learned: dict[str, Any] | None = None,
) -> ReplicaInfo:
    announce, load = record.announce, record.load
    return ReplicaInfo(
        replica_id=record.replica_id,
        pool=record.pool,
        base_url=announce.base_url if announce else "",
        model=announce.model if announce else "",
        served_names=tuple(announce.served_names) if announce else (),
        engine_kind=ENGINE_KIND_NAMES.get(announce.engine_kind, "") if announce else "",
        status=status_of(record),
        draining=record.draining,
        state_incomplete=record.state_incomplete,
        epoch=record.stream.epoch or (announce.sidecar_epoch if announce else 0),
        block_size=announce.block_size if announce else 0,
        running=load.running if load else 0,
        waiting=load.waiting if load else 0,
        kv_usage=load.kv_usage if load else 0.0,
        resident_blocks=resident_blocks,
        prefix_cache_queries=load.prefix_cache_queries if load else None,
        prefix_cache_hits=load.prefix_cache_hits if load else None,
        last_seen=record.last_seen_wall,
        stale=record.stale,
        role=role_name(announce.role) if announce else "both",
        bootstrap_port=announce.bootstrap_port if announce else 0,
        lora_adapters=dict(announce.lora_adapters) if announce else {},
        warmup=warmup,
        learned=learned,
    )


class LiveFleetView:
    """:class:`controlplane.contracts.FleetView` over the live fleet."""

    def __init__(
        self,
        fleet: Fleet,
        *,
        drains: DrainStore | None = None,
        is_leader: Callable[[], bool] = lambda: False,
        warmup: Callable[[str], dict[str, Any] | None] = lambda replica_id: None,
        learned: Callable[[str], dict[str, Any] | None] = lambda replica_id: None,
        position: Callable[[], tuple[int, int]] = lambda: (0, 0),
    ) -> None:
        self.fleet = fleet
        self.drains = drains
        self._is_leader = is_leader
        self.summary_rows = 1 << 18  # rows of the index ranked between two yields
        self.warmup = warmup
        self.learned = learned
        self.position = position

    def replicas(self, pool: str | None = None) -> Sequence[ReplicaInfo]:
        index = self.fleet.index
        records = self.fleet.replicas_in(None if pool is None else frozenset({pool}))
        return [self._info(r, index.key_count(r.ordinal)) for r in records]

    async def set_draining(self, replica_id: str, draining: bool) -> ReplicaInfo:
        record = self.fleet.by_id.get(replica_id)
        if record is None:
            raise UnknownReplica(replica_id)
        if self.drains is not None:
            await self.drains.persist_draining(record.pool, replica_id, draining)
        self.fleet.set_draining(replica_id, draining)
        return self._info(record, self.fleet.index.key_count(record.ordinal))

    def _info(self, record: ReplicaRecord, resident_blocks: int) -> ReplicaInfo:
        replica_id = record.replica_id
        return replica_info(
            record, resident_blocks, self.warmup(replica_id), self.learned(replica_id)
        )

    async def residency_summary(self, top: int = 20) -> ResidencySummary:
        """Counts per replica, and the most shared keys ranked piece by piece
        (:class:`MostShared`), the event loop running between pieces: at 10M keys a walk
        of every key in Python held it for seconds."""
        fleet = self.fleet
        index = fleet.index
        ranking = MostShared(top)
        for keys, masks in index.residency_chunks(self.summary_rows):
            ranking.add(keys, masks)
            await asyncio.sleep(0)
        per_replica = {r.replica_id: index.key_count(r.ordinal) for r in fleet.by_id.values()}
        names = {ordinal: r.replica_id for ordinal, r in fleet.by_ordinal.items()}
        most = tuple(
            SharedPrefix(key, tuple(names[o] for o in _ordinals(mask) if o in names))
            for key, mask in ranking.result()
        )
        return ResidencySummary(index.key_count(), per_replica, most)

    def state_view(self, pool: str | None = None) -> StaticStateView:
        records = self.fleet.replicas_in(None if pool is None else frozenset({pool}))
        states = [replica_state(r) for r in records if r.announced]
        return StaticStateView(states, self.fleet.index)

    def state_position(self) -> tuple[int, int]:
        return self.position()

    def is_leader(self) -> bool:
        return self._is_leader()


def _ordinals(mask: int) -> list[int]:
    return [bit for bit in range(mask.bit_length()) if mask >> bit & 1]
