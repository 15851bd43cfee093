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
- **warm-ups**: ``warming/<pool>/<id>`` (JSON: the keys of the prefixes being warmed there,
  not confirmed yet), written by the leader's warmer on its lease while a replica warms and
  deleted when the warm-up ends. The standby applies them to its replicas, so the proxies
  watching it keep a warming replica's prefixes off it as the leader's proxies do; a new
  leader drops what it applied (the keys died with the old lease) and warms afresh. An
  instance that stops leading drops the warm-up states it had yet to write and calls its
  :meth:`Leadership.on_step_down` callbacks (the warmer drops its own plans), so that if
  it leads again it acts on none of its past term's.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Callable

import aetcd
from aetcd.leases import Lease

from controlplane.fleet.fleet import Fleet
from controlplane.fleet.fleet_view import status_of
from controlplane.settings import ControlPlaneSettings
from kvcore.subjects import EtcdKeys, InvalidName
from kvruntime.tasks import BackgroundTasks

log = logging.getLogger(__name__)
_RETRY_S = 0.5
_Apply = Callable[[str, bytes | None], None]  # (key, value; None when deleted)


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
        self._warm_out: dict[tuple[str, str], frozenset[int] | None] = {}  # to write
        self._warm_wake = asyncio.Event()
        self._warm_applied: set[str] = set()  # replicas whose warm-up state came from etcd
        self._stepped_down: list[Callable[[], None]] = []

    def on_step_down(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` (synchronously, never blocking) whenever this instance stops
        leading."""
        self._stepped_down.append(callback)

    def is_leader(self) -> bool:
        return self.leader

    async def start(self) -> None:
        drains, warming = self.keys.drains_prefix(), self.keys.warming_prefix()
        revision = await self._load(drains, self._apply_drain)
        self._tasks.spawn(self._watch(drains, revision + 1, self._apply_drain), name="drain-watch")
        revision = await self._load(warming, self._apply_warming)
        self._tasks.spawn(
            self._watch(warming, revision + 1, self._apply_warming), name="warm-watch"
        )
        self._tasks.spawn(self._write_warmups(), name="warm-write")
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
        for replica_id in self._warm_applied:  # the old leader's: its lease took them
            self.fleet.set_warmup(replica_id, None)
        self._warm_applied.clear()
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
        was_leader = self.leader
        self.leader, self._lease = False, None
        if not was_leader:
            return
        log.warning("no longer leader", extra={"reason": why})
        self._warm_out.clear()  # a past term's states: the next leader shares its own
        for callback in self._stepped_down:
            callback()

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

    async def _load(self, prefix: str, apply: _Apply) -> int:
        found = await self.etcd.get_prefix(prefix.encode())
        for kv in found:
            apply(kv.key.decode(), kv.value)
        return int(found.header.revision)

    async def _watch(self, prefix: str, start_revision: int, apply: _Apply) -> None:
        while True:
            try:
                watch = await self.etcd.watch_prefix(prefix.encode(), start_revision=start_revision)
                async for event in watch:
                    apply(event.kv.key.decode(), event.kv.value if event.kind == "PUT" else None)
                    start_revision = event.kv.mod_revision + 1
            except aetcd.ClientError:
                await asyncio.sleep(_RETRY_S)

    def _apply_drain(self, key: str, value: bytes | None) -> None:
        try:
            _, replica_id = self.keys.drain_parts(key)
        except InvalidName:
            log.warning("ignoring a malformed drain key")
            return
        self.fleet.set_draining(replica_id, value is not None)

    # -- warm-ups ------------------------------------------------------------------------
    def share_warmup(self, pool: str, replica_id: str, pending: frozenset[int] | None) -> None:
        """The leader's warmer: a replica's warm-up state (``None``: not warming), written
        for the standby soon after (never blocking the caller)."""
        self._warm_out[(pool, replica_id)] = pending
        self._warm_wake.set()

    async def _write_warmups(self) -> None:
        while True:
            await self._warm_wake.wait()
            self._warm_wake.clear()
            while self._warm_out:
                (pool, replica_id), pending = item = self._warm_out.popitem()
                lease = self._lease
                if not self.leader or lease is None:
                    continue  # a standby shares nothing; a new leader shares its own
                try:
                    key = self.keys.replica_warming(pool, replica_id).encode()
                    if pending is None:
                        await self.etcd.delete(key)
                    else:
                        await self.etcd.put(key, json.dumps(sorted(pending)).encode(), lease=lease)
                except InvalidName:
                    log.warning("not sharing the warm-up of a replica with a malformed id")
                except aetcd.ClientError:
                    self._warm_out.setdefault(*item)  # unless a newer state came meanwhile
                    await asyncio.sleep(_RETRY_S)

    def _apply_warming(self, key: str, value: bytes | None) -> None:
        if self.leader:
            return  # the leader's warmer holds its own state
        try:
            _, replica_id = self.keys.warming_parts(key)
            pending = None if value is None else frozenset(int(k) for k in json.loads(value))
        except (InvalidName, ValueError, TypeError):
            log.warning("ignoring a malformed warm-up key")
            return
        if pending is None:
            self._warm_applied.discard(replica_id)
        else:
            self._warm_applied.add(replica_id)
        self.fleet.set_warmup(replica_id, pending)
