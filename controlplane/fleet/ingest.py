"""NATS in: the sidecars' announcements, event batches and load reports, into the fleet.

Only this module (and :mod:`controlplane.fleet.nats_options`) talks NATS. Each message is
decoded and handed to :class:`controlplane.fleet.fleet.Fleet` synchronously in the
subscription's callback, so one replica's batches are applied in the order NATS
delivered them. A message that does not decode, or whose ids disagree with its subject,
is counted by kind and skipped. Resync requests go out as NATS requests from their own
tasks; the reply says where the snapshot starts. A sweeper marks silent replicas down
and drops their residency in steps, yielding the event loop between steps; it counts
silence only while this instance's own NATS link is up (``heard_since``), and once the
link is back every replica is asked for its state, since whatever was published
meanwhile is lost.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter

import nats
import nats.errors
from google.protobuf.message import DecodeError
from nats.aio.client import Client
from nats.aio.msg import Msg

from controlplane.fleet.fleet import Fleet, FleetFull, ReplicaRecord
from controlplane.fleet.nats_options import connect_options
from controlplane.settings import ControlPlaneSettings
from kvcore import subjects
from kvcore.pb import events_pb2
from kvruntime.nats import redacted, subscriptions_live
from kvruntime.tasks import BackgroundTasks

log = logging.getLogger(__name__)
_RETRY_S = 0.25
_SUBJECTS_KEPT = 4096  # parsed subjects remembered (three per replica are in use)


class Ingest:
    """Subscribes to the pools this instance serves and feeds the fleet."""

    def __init__(self, settings: ControlPlaneSettings, fleet: Fleet) -> None:
        self.settings = settings
        self.fleet = fleet
        self.malformed: Counter[str] = Counter()  # by message kind
        self.resyncs_sent: Counter[str] = Counter()  # by outcome
        self._nc: Client | None = None
        self._tasks = BackgroundTasks()
        self._subjects: dict[str, subjects.Subject] = {}  # valid subjects, parsed once
        self._link_up_at = 0.0  # monotonic time the NATS link last came up
        fleet.resync = self._request_resync

    @property
    def connected(self) -> bool:
        return self._nc is not None and self._nc.is_connected

    @property
    def heard_since(self) -> float | None:
        """Since when this instance has been able to hear the sidecars (monotonic), or
        ``None`` while its NATS link is down."""
        return self._link_up_at if self.connected else None

    async def start(self) -> None:
        """Connect (retrying until NATS answers), subscribe, start the sweeper."""
        while self._nc is None:
            try:
                self._nc = await nats.connect(
                    **connect_options(self.settings),
                    disconnected_cb=self._on_disconnected,
                    reconnected_cb=self._on_reconnected,
                )
            except (nats.errors.Error, OSError, TimeoutError) as exc:
                log.info("nats not reachable yet", extra={"error": type(exc).__name__})
                await asyncio.sleep(_RETRY_S)
        for subject in self.subscriptions():
            await self._nc.subscribe(subject, cb=self._on_message, pending_msgs_limit=1_000_000)
        if not await subscriptions_live(self._nc):  # so a message sent after start() is seen
            log.warning("nats subscriptions not confirmed live", extra={"timeout_s": 5.0})
        self._link_up_at = time.monotonic()
        self._tasks.spawn(self._sweep(), name="sweep")
        log.info("nats subscribed", extra={"url": redacted(self.settings.nats_url)})

    async def _on_disconnected(self) -> None:
        log.warning("nats disconnected: replicas' silence is not counted until it is back")

    async def _on_reconnected(self) -> None:
        self._link_up_at = time.monotonic()
        log.info("nats reconnected: asking every replica for its state")
        self.fleet.resync_all("nats reconnected")

    async def aclose(self) -> None:
        await self._tasks.aclose()
        if self._nc is not None:
            with contextlib.suppress(nats.errors.Error, OSError):
                await self._nc.close()
            self._nc = None

    def subscriptions(self) -> list[str]:
        pools = self.settings.served_pools()
        if pools is None:
            return list(subjects.pool_subscriptions(None))
        return [s for pool in pools for s in subjects.pool_subscriptions(pool)]

    # -- messages ------------------------------------------------------------------------
    async def _on_message(self, msg: Msg) -> None:
        self.handle(msg.subject, msg.data, time.monotonic())

    def handle(self, subject: str, data: bytes, now: float) -> None:
        """Decode one message and apply it; malformed ones are counted and skipped."""
        parsed = self._subjects.get(subject)
        if parsed is None:
            try:
                parsed = subjects.parse_subject(subject)
            except subjects.InvalidName:
                self.malformed["subject"] += 1
                return
            if len(self._subjects) >= _SUBJECTS_KEPT:
                self._subjects.clear()
            self._subjects[subject] = parsed
        kind = parsed.kind
        try:
            if kind is subjects.SubjectKind.EVENTS:
                self._batch(events_pb2.KvEventBatch.FromString(data), parsed, now)
            elif kind is subjects.SubjectKind.LOAD:
                self._load(events_pb2.LoadReport.FromString(data), parsed, now)
            elif kind is subjects.SubjectKind.ANNOUNCE:
                self._announce(events_pb2.ReplicaAnnounce.FromString(data), parsed, now)
        except (DecodeError, ValueError):
            self.malformed[kind.value] += 1
        except FleetFull:
            self.malformed["fleet_full"] += 1

    def _batch(self, batch: events_pb2.KvEventBatch, subject: subjects.Subject, now: float) -> None:
        if batch.replica_id != subject.replica or batch.pool != subject.pool:
            raise ValueError("ids disagree with the subject")
        self.fleet.on_batch(batch, subject.pool, now)

    def _load(self, load: events_pb2.LoadReport, subject: subjects.Subject, now: float) -> None:
        if load.replica_id != subject.replica:
            raise ValueError("replica id disagrees with the subject")
        self.fleet.on_load(load, subject.pool, now)

    def _announce(
        self, msg: events_pb2.ReplicaAnnounce, subject: subjects.Subject, now: float
    ) -> None:
        subjects.check_name("replica", msg.replica_id)
        if msg.pool != subject.pool:
            raise ValueError("pool disagrees with the subject")
        self.fleet.on_announce(msg, now)

    # -- resync ------------------------------------------------------------------------
    def _request_resync(self, record: ReplicaRecord, reason: str, snapshot_id: int) -> None:
        if self._nc is not None:
            self._tasks.spawn(self._resync(record, reason, snapshot_id), name="resync")

    async def _resync(self, record: ReplicaRecord, reason: str, snapshot_id: int) -> None:
        assert self._nc is not None
        request = events_pb2.ResyncRequest(
            requester=self.settings.instance_id, reason=reason, snapshot_id=snapshot_id
        )
        subject = subjects.resync_subject(record.pool, record.replica_id)
        try:
            msg = await self._nc.request(
                subject, request.SerializeToString(), timeout=self.settings.resync_timeout_s
            )
            reply = events_pb2.ResyncReply.FromString(msg.data)
        except (nats.errors.Error, DecodeError, TimeoutError) as exc:
            self.resyncs_sent[type(exc).__name__] += 1
            return
        if not reply.accepted:
            self.resyncs_sent["refused"] += 1
            log.warning("resync refused", extra={"replica": record.replica_id})
            return
        self.resyncs_sent["accepted"] += 1
        self.fleet.on_resync_reply(record, snapshot_id, reply.epoch, reply.first_seq)

    # -- liveness ----------------------------------------------------------------------
    async def _sweep(self) -> None:
        interval = min(1.0, self.settings.heartbeat_timeout_s / 4)
        while True:
            await asyncio.sleep(interval)
            for record in self.fleet.expire(time.monotonic(), self.heard_since):
                log.info("replica down", extra={"replica": record.replica_id})
                for _ in self.fleet.drop_steps(record, self.settings.clear_chunk_keys):
                    await asyncio.sleep(0)
            self.fleet.retry_resyncs()
