"""Drain and undrain a replica: the fleet half flips the flag, the audit log records who.

The flag lives in etcd (the fleet half's leadership writes it); the audit entry is this
service's one SQL commit, made after the flag is set, so a refused replica id leaves
no entry.
"""

from __future__ import annotations

from sqlalchemy.ext.asyncio import AsyncSession

from controlplane.contracts import FleetView, ReplicaInfo, UnknownReplica
from controlplane.records.db.repositories import AuditRepository
from controlplane.records.errors import NotFound


class DrainService:
    def __init__(self, fleet: FleetView, session: AsyncSession, actor: str) -> None:
        self.fleet = fleet
        self.session = session
        self.actor = actor

    async def set_draining(self, replica_id: str, draining: bool) -> ReplicaInfo:
        """Set the flag, audit it and commit; :class:`NotFound` for an unknown replica."""
        try:
            info = await self.fleet.set_draining(replica_id, draining)
        except UnknownReplica:
            raise NotFound(f"no replica {replica_id!r}") from None
        AuditRepository(self.session).add(
            actor=self.actor,
            action="drain" if draining else "undrain",
            target=f"replica/{replica_id}",
            result="ok",
        )
        await self.session.commit()
        return info
