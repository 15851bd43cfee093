"""Leader election, membership and drain flags in etcd.

Both instances of a shard ingest and serve proxies; the leader alone keeps the shard's
records in etcd:

- **election**: ``shards/<shard>/leader`` holds the leader's instance id, created only
  if absent (a transaction on its create revision) and attached to a lease of
  ``lease_ttl_s`` that the leader refreshes every third of it. When the leader dies, the
  lease expires and etcd deletes the key; the standby, watching it, creates it at once.
  So the standby takes over within the lease TTL, its map already warm.
- **membership**: the leader writes ``pools/<pool>/replicas/<id>`` (JSON: base URL,
  model, status) for every replica that is not down, on its lease, and deletes the key
  of a replica that goes down; and ``pools/<pool>/shard`` (JSON: shard, leader) for each
  pool named by ``--pools``. A new leader writes them all again.
- **drain flags**: ``draining/<pool>/<id>`` (no lease: a drain outlives both instances),
  written by whichever instance the operator asked; both watch the prefix and apply it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging

import aetcd
from aetcd.leases import Lease

from controlplane.fleet.fleet import Fleet
from controlplane.fleet.fleet_view import status_of
from controlplane.settings import ControlPlaneSettings
from kvcore.subjects import EtcdKeys, InvalidName
from kvruntime.tasks import BackgroundTasks

log = logging.getLogger(__name__)
_RETRY_S = 0.5


class Leadership:
    """Campaigns for the shard's leadership and keeps membership and drains in etcd."""

    def __init__(self, settings: ControlPlaneSettings, etcd: aetcd.Client, fleet: Fleet) -> None:
        self.settings, self.etcd, self.fleet = settings, etcd, fleet
        self.keys = EtcdKeys(settings.etcd_prefix)
        self.leader = False
        self.leader_instance = ""  # the shard's leader as last seen ("" unknown)
        self._leader_key = self.keys.shard_leader(settings.shard).encode()
        self._written: dict[str, bytes] = {}  # membership key -> value, this term
        self._tasks = BackgroundTasks()
        self._lease: Lease | None = None

    def is_leader(self) -> bool:
        return self.leader

    async def start(self) -> None:
        revision = await self._load_drains()
        self._tasks.spawn(self._watch_drains(revision + 1), name="drain-watch")
        self._tasks.spawn(self._campaign(), name="campaign")

    async def aclose(self) -> None:
        await self._tasks.aclose()
        if self.leader and self._lease is not None:  # hand over at once, not after the TTL
            with contextlib.suppress(aetcd.ClientError):
                await self._lease.revoke()
        self.leader = False

    # -- election ----------------------------------------------------------------------
    async def _campaign(self) -> None:
        while True:
            try:
                won, revision = await self._try_lead()
                if won:
                    await self._lead()
                else:
                    await self._await_vacancy(revision)
            except aetcd.ClientError as exc:
                self._step_down(f"etcd: {type(exc).__name__}")
                await asyncio.sleep(_RETRY_S)

    async def _try_lead(self) -> tuple[bool, int]:
        lease = await self.etcd.lease(self.settings.lease_ttl_s)
        txn = self.etcd.transactions
        won, responses = await self.etcd.transaction(
            compare=[txn.create(self._leader_key) == 0],
            success=[txn.put(self._leader_key, self.settings.instance_id.encode(), lease)],
            failure=[txn.get(self._leader_key)],
        )
        if won:
            self._lease, self.leader_instance = lease, self.settings.instance_id
            return True, 0
        await lease.revoke()
        found = responses[0] if responses else []
        self.leader_instance = found[0][0].decode() if found else ""
        return False, found[0][1].header.revision if found else 0

    async def _await_vacancy(self, revision: int) -> None:
        """Until the leader key is deleted (or a TTL passes: then look again)."""
        with contextlib.suppress(aetcd.WatchTimeoutError):
            await self.etcd.watch_once(
                self._leader_key,
                timeout=self.settings.lease_ttl_s,
                start_revision=revision + 1 if revision else None,
            )

    async def _lead(self) -> None:
        assert self._lease is not None
        self.leader, self._written = True, {}
        log.info("leader", extra={"shard": self.settings.shard})
        period = self.settings.lease_ttl_s / 3
        while True:
            reply = await self._lease.refresh()
            if reply is None or reply.TTL <= 0:
                self._step_down("lease expired")
                return
            await self.sync_membership()
            await asyncio.sleep(period)

    def _step_down(self, why: str) -> None:
        if self.leader:
            log.warning("no longer leader", extra={"reason": why})
        self.leader, self._lease = False, None

    # -- membership ----------------------------------------------------------------------
    async def sync_membership(self) -> None:
        """Write what changed since the last sync (leader only)."""
        if self._lease is None:
            return
        wanted = self._membership()
        for key in set(self._written) - set(wanted):
            await self.etcd.delete(key.encode())
            del self._written[key]
        for key, value in wanted.items():
            if self._written.get(key) != value:
                await self.etcd.put(key.encode(), value, lease=self._lease)
                self._written[key] = value

    def _membership(self) -> dict[str, bytes]:
        wanted = {}
        for record in self.fleet.by_ordinal.values():
            status = status_of(record)
            if status == "down":
                continue
            announce = record.announce
            value = {
                "replica_id": record.replica_id,
                "pool": record.pool,
                "base_url": announce.base_url if announce else "",
                "model": announce.model if announce else "",
                "status": status,
                "instance": self.settings.instance_id,
            }
            key = self.keys.replica(record.pool, record.replica_id)
            wanted[key] = json.dumps(value, sort_keys=True).encode()
        shard = {"shard": self.settings.shard, "leader": self.settings.instance_id}
        for pool in self.settings.pools:
            wanted[self.keys.pool_shard(pool)] = json.dumps(shard, sort_keys=True).encode()
        return wanted

    # -- drain flags ---------------------------------------------------------------------
    async def persist_draining(self, pool: str, replica_id: str, draining: bool) -> None:
        key = self.keys.replica_drain(pool, replica_id).encode()
        if draining:
            await self.etcd.put(key, b"1")
        else:
            await self.etcd.delete(key)

    async def _load_drains(self) -> int:
        found = await self.etcd.get_prefix(self.keys.drains_prefix().encode())
        for kv in found:
            self._apply_drain(kv.key.decode(), True)
        return int(found.header.revision)

    async def _watch_drains(self, start_revision: int) -> None:
        prefix = self.keys.drains_prefix().encode()
        while True:
            try:
                watch = await self.etcd.watch_prefix(prefix, start_revision=start_revision)
                async for event in watch:
                    self._apply_drain(event.kv.key.decode(), event.kind == "PUT")
                    start_revision = event.kv.mod_revision + 1
            except aetcd.ClientError:
                await asyncio.sleep(_RETRY_S)

    def _apply_drain(self, key: str, draining: bool) -> None:
        try:
            _, replica_id = self.keys.drain_parts(key)
        except InvalidName:
            log.warning("ignoring a malformed drain key")
            return
        self.fleet.set_draining(replica_id, draining)
