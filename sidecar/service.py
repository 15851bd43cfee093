"""The sidecar service: wires the source, the pipeline, NATS and the HTTP endpoints.

Built once in ``main`` from :class:`~sidecar.settings.SidecarSettings`; ``run`` owns every
task in one ``TaskGroup`` until ``stop`` is set, then shuts down in order: stop reading the
engine, publish what is pending, drain NATS. Tasks:

- ``_consume``: one ZMQ source per engine stream (data-parallel rank), items -> pipeline;
  asks a source for a history rebuild when an unknown parent shows up (at most every
  ``_HISTORY_RETRY_S``);
- ``_flush``: publishes at most once per ``batch_delay_ms`` (coalescing what arrives meanwhile),
  or a snapshot when one is due (after drops, after a NATS reconnection, after a rebuild);
- ``_announce``: ``ReplicaAnnounce`` on start, every ``announce_interval_s``, on change,
  after a NATS reconnection and after a resync;
- ``_report_load``: scrapes ``/metrics`` (and ``/v1/models`` for the LoRA adapters,
  announced on change) every ``load_interval_s`` and publishes a ``LoadReport``; an
  engine that becomes reachable (first contact or after an outage), or that has sent
  nothing for ``restart_probe_s``, triggers a probe through replay; an engine whose
  counters went back between two scrapes restarted, and its old state goes at once;
- resync requests are answered with a ``ResyncReply``, then a snapshot and an announce
  (a control plane that restarted learns the replica's base URL at once, not one
  ``announce_interval_s`` later).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass, field

from kvcore import subjects
from kvcore.pb import events_pb2
from kvcore.roles import ROLE_PB
from sidecar.adapters import adapter_for
from sidecar.engine_http import EngineHttp, EventEndpoints, configured_endpoints
from sidecar.errors import EngineUnavailable
from sidecar.load_metrics import EngineLoad, PrefillTotals, restarted_between
from sidecar.nats_link import NatsLink, Respond
from sidecar.outbox import Outbox, OutboxConfig, OutgoingBatch
from sidecar.pipeline import Pipeline
from sidecar.settings import SidecarSettings
from sidecar.zmq_source import HistoryReplay, SourceConfig, SourceItem, ZmqEventSource

log = logging.getLogger(__name__)

_HISTORY_RETRY_S = 5.0
_YIELD_EVERY = 32
REFUSED_LABEL = "kvroute.io/keys-refused"  # announce label: why nothing is keyed
ENGINE_KIND_PB = {"vllm": events_pb2.ENGINE_KIND_VLLM, "sglang": events_pb2.ENGINE_KIND_SGLANG}


def new_epoch_after(previous: int) -> int:
    """A sidecar epoch: microseconds since the Unix epoch, always above ``previous``."""
    return max(previous + 1, time.time_ns() // 1000)


@dataclass(slots=True)
class EngineStatus:
    up: bool = False
    ever_up: bool = False
    load: EngineLoad | None = None
    adapters: dict[str, str] = field(default_factory=dict)  # LoRA name -> path


class SidecarService:
    def __init__(self, settings: SidecarSettings) -> None:
        self.settings = settings
        self.epoch = new_epoch_after(0)
        self.outbox = Outbox(
            OutboxConfig(
                replica_id=settings.replica_id,
                pool=settings.pool,
                max_batch_events=settings.max_batch_events,
                max_pending_events=settings.max_buffer_events,
                max_pending_keys=settings.max_buffer_keys,
            ),
            self.epoch,
        )
        self.pipeline = Pipeline(
            adapter=adapter_for(settings.engine_kind),
            model=settings.model,
            router_block_size=settings.router_block_size,
            outbox=self.outbox,
            new_epoch=self._next_epoch,
        )
        self.engine = EngineHttp(
            settings.engine_url,
            timeout_s=settings.scrape_timeout_s,
            ssl_context=settings.engine_ssl_context(),
        )
        self.engine_status = EngineStatus()
        self.link = NatsLink(
            settings.nats_url,
            name=f"kvroute-sidecar-{settings.replica_id}",
            on_connected=self._on_nats_connected,
            ping_interval_s=settings.nats_ping_interval_s,
            token=settings.nats_token.get_secret_value() if settings.nats_token else None,
            user=settings.nats_user,
            password=settings.nats_password.get_secret_value() if settings.nats_password else None,
        )
        self.sources: list[ZmqEventSource] = []  # one per data-parallel rank
        self.subject = subjects.events_subject(settings.pool, settings.replica_id)
        self._publish_lock = asyncio.Lock()
        self._wake_flush = asyncio.Event()
        self._delay_s = settings.batch_delay_ms / 1000
        self._last_publish = -self._delay_s  # monotonic time of the last publishing turn
        self._wake_announce = asyncio.Event()
        self.draining = False  # set on stop: announced, so proxies send nothing new
        self._last_history_request = -_HISTORY_RETRY_S
        self.started = asyncio.Event()

    # -- state shared with the HTTP endpoints ------------------------------------------
    @property
    def ready(self) -> bool:
        return self.engine_status.up and self.link.connected and bool(self.sources)

    @property
    def source(self) -> ZmqEventSource | None:
        """Rank 0's source (the only one unless the engine runs data-parallel)."""
        return self.sources[0] if self.sources else None

    def _next_epoch(self) -> int:
        self.epoch = new_epoch_after(self.epoch)
        log.info("engine restarted: new epoch", extra={"epoch": self.epoch})
        return self.epoch

    def _on_nats_connected(self) -> None:
        self.outbox.needs_snapshot = True  # whatever was in flight may be lost
        self._wake_flush.set()
        self._wake_announce.set()

    # -- lifecycle ---------------------------------------------------------------------
    async def run(self, stop: asyncio.Event) -> None:
        await self.link.serve(
            subjects.resync_subject(self.settings.pool, self.settings.replica_id),
            self._answer_resync,
        )
        try:
            async with asyncio.TaskGroup() as tasks:
                workers = [
                    tasks.create_task(self.link.run()),
                    tasks.create_task(self._consume()),
                    tasks.create_task(self._flush()),
                    tasks.create_task(self._announce()),
                    tasks.create_task(self._report_load()),
                ]
                self.started.set()
                await stop.wait()
                await self._drain()
                for worker in workers:
                    worker.cancel()
        finally:
            await self._shutdown()

    async def _drain(self) -> None:
        """Announce the replica draining (proxies stop sending it new requests), then
        give the engine ``drain_s`` to finish the ones it has."""
        self.draining = True
        with contextlib.suppress(Exception):
            subject = subjects.announce_subject(self.settings.pool)
            await asyncio.wait_for(
                self.link.publish(subject, self.announcement().SerializeToString()), timeout=2
            )
            await asyncio.wait_for(self.link.flush(), timeout=2)
        if self.settings.drain_s > 0:
            log.info("draining", extra={"seconds": self.settings.drain_s})
            await asyncio.sleep(self.settings.drain_s)  # the grace period, not a readiness wait

    async def _shutdown(self) -> None:
        for source in self.sources:
            source.close()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self._publish_pending(), timeout=5)
            await self.link.flush()
        await self.link.close()
        await self.engine.close()
        log.info("sidecar stopped", extra={"published": self.outbox.stats.events_published})

    # -- engine events -----------------------------------------------------------------
    async def _endpoints(self) -> list[EventEndpoints]:
        s = self.settings
        if s.kv_events_endpoint is not None:
            return configured_endpoints(s.kv_events_endpoint, s.replay_endpoint, s.topic)
        while True:
            try:
                found = await self.engine.discover(s.engine_kind)
            except EngineUnavailable as exc:
                log.info("waiting for engine discovery", extra={"error": str(exc)})
                await asyncio.sleep(s.load_interval_s)
                continue
            log.info("discovered kv events", extra={"ranks": [e.endpoint for e in found]})
            return found

    def _source(self, found: EventEndpoints) -> ZmqEventSource:
        config = SourceConfig(
            endpoint=found.endpoint,
            replay_endpoint=found.replay_endpoint,
            topic=found.topic,
            bind=self.settings.kv_events_bind,
            replay_timeout_s=self.settings.replay_timeout_s,
        )
        source = ZmqEventSource(config)
        source.open()
        return source

    async def _consume(self) -> None:
        endpoints = await self._endpoints()
        self.pipeline.ranks = len(endpoints)
        self.sources = [self._source(found) for found in endpoints]
        async with asyncio.TaskGroup() as ranks:
            for rank, source in enumerate(self.sources):
                ranks.create_task(self._consume_rank(rank, source))

    async def _consume_rank(self, rank: int, source: ZmqEventSource) -> None:
        handled = 0
        async for item in source.items():
            if await self._handle(item, rank):
                self._on_state_change(source)
            await self._publish_or_wake()
            handled += 1
            if handled % _YIELD_EVERY == 0:
                await asyncio.sleep(0)  # let the flusher run under a flood of frames

    async def _handle(self, item: SourceItem, rank: int) -> bool:
        """Apply one item; a bug met on one item is logged and counted, and the state is
        flagged incomplete (it may be half applied) rather than stopping the sidecar."""
        try:
            if isinstance(item, HistoryReplay):
                for _ in self.pipeline.rebuild_steps(item, rank):
                    await asyncio.sleep(0)  # a long history must not hold the event loop
                return True
            return self.pipeline.handle(item, rank)
        except Exception:
            log.exception("internal error on an engine item", extra={"rank": rank})
            self.pipeline.internal_error(rank)
            return True

    def _on_state_change(self, source: ZmqEventSource) -> None:
        self._wake_announce.set()
        if not self.pipeline.state_incomplete or not source.config.replay_endpoint:
            return
        now = time.monotonic()
        if now - self._last_history_request > _HISTORY_RETRY_S:
            self._last_history_request = now
            source.request_history()

    # -- publishing --------------------------------------------------------------------
    async def _flush(self) -> None:
        """Publish at most once per ``batch_delay_ms``: the first event after a quiet spell
        goes out at once (from the consumer, see :meth:`_publish_or_wake`), later ones
        coalesce here until the deadline (or a full batch)."""
        while True:
            await self._wake_flush.wait()
            self._wake_flush.clear()
            wait = self._last_publish + self._delay_s - time.monotonic()
            if wait > 0 and self.outbox.depth < self.settings.max_batch_events:
                await asyncio.sleep(wait)  # coalescing deadline
            self._last_publish = time.monotonic()
            await self._publish_pending()

    async def _publish_or_wake(self) -> None:
        """After an engine item: publish what it produced at once when the coalescing
        deadline has passed and nobody is publishing (what the flusher would do, without
        waking it for every batch), else leave it to the flusher."""
        if not self.outbox.depth and not self.outbox.needs_snapshot:
            return
        now = time.monotonic()
        if self._publish_lock.locked() or now < self._last_publish + self._delay_s:
            self._wake_flush.set()
            return
        self._last_publish = now
        await self._publish_pending()

    async def _publish_pending(self) -> None:
        async with self._publish_lock:
            if not self.link.connected:
                return
            if self.outbox.needs_snapshot:
                await self._send(self.outbox.snapshot(self.pipeline.mapper.held(), 0))
            while (batch := self.outbox.take_batch()) is not None:
                await self._send([batch])

    async def _send(self, batches: list[OutgoingBatch]) -> None:
        for batch in batches:
            if not await self.link.publish(self.subject, batch.payload):
                self.outbox.needs_snapshot = True  # lost on a broken connection
                continue
            if batch.oldest_received_ns is not None:
                latency = (time.monotonic_ns() - batch.oldest_received_ns) / 1e9
                self.pipeline.stats.latency.observe(latency)

    async def _answer_resync(self, data: bytes, respond: Respond) -> None:
        try:
            request = events_pb2.ResyncRequest.FromString(data)
        except Exception:  # protobuf raises DecodeError, which is not exported stably
            reply = events_pb2.ResyncReply(accepted=False, error="malformed ResyncRequest")
            await respond(reply.SerializeToString())
            return
        log.info("resync requested", extra={"requester": request.requester})
        async with self._publish_lock:
            batches = self.outbox.snapshot(self.pipeline.mapper.held(), request.snapshot_id)
            reply = events_pb2.ResyncReply(
                accepted=True, epoch=self.outbox.epoch, first_seq=batches[0].seq
            )
            await respond(reply.SerializeToString())
            await self._send(batches)
        self._wake_announce.set()  # a control plane asking may not know us yet (restarted)

    # -- announce and load -------------------------------------------------------------
    def announcement(self) -> events_pb2.ReplicaAnnounce:
        s, load = self.settings, self.engine_status.load
        return events_pb2.ReplicaAnnounce(
            replica_id=s.replica_id,
            pool=s.pool,
            base_url=s.advertised_url(),
            model=s.model,
            served_names=[s.model, *s.served_names],
            engine_kind=ENGINE_KIND_PB[s.engine_kind],
            block_size=s.router_block_size,
            engine_block_size=self.pipeline.engine_block_size
            or (load.engine_block_size if load else 0),
            capacity_blocks=load.capacity_blocks if load else 0,
            sidecar_epoch=self.outbox.epoch,
            state_incomplete=self.pipeline.state_incomplete,
            labels={REFUSED_LABEL: self.pipeline.refusal} if self.pipeline.refusal else {},
            ts=time.time(),
            role=ROLE_PB[self.role()],
            bootstrap_port=s.bootstrap_port or (load.bootstrap_port if load else 0),
            lora_adapters=self.engine_status.adapters,
            draining=self.draining,
        )

    def role(self) -> str:
        """The P/D role announced: the flag's, else the engine's, else both."""
        if self.settings.role != "auto":
            return self.settings.role
        load = self.engine_status.load
        return (load.role if load else "") or "both"

    async def _announce(self) -> None:
        subject = subjects.announce_subject(self.settings.pool)
        while True:
            await self.link.publish(subject, self.announcement().SerializeToString())
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(
                    self._wake_announce.wait(), self.settings.announce_interval_s
                )
            self._wake_announce.clear()

    async def _report_load(self) -> None:
        subject = subjects.load_subject(self.settings.pool, self.settings.replica_id)
        while True:
            await self._scrape()
            report = self.load_report()
            await self.link.publish(subject, report.SerializeToString())
            await asyncio.sleep(self.settings.load_interval_s)

    def _probe_if_idle(self) -> None:
        """An engine can restart without going unreachable (a fast restart, or a reset
        that also drops its replay buffer) and then publish nothing: after
        ``restart_probe_s`` without a live batch, ask the replay socket."""
        every = self.settings.restart_probe_s
        for source in self.sources:
            if not every or not source.config.replay_endpoint:
                continue
            if time.monotonic() - source.last_frame_at >= every:
                source.last_frame_at = time.monotonic()
                source.request_restart_probe()

    async def _scrape(self) -> None:
        self._probe_if_idle()
        status = self.engine_status
        try:
            load = await self.engine.load(self.settings.engine_kind)
        except EngineUnavailable as exc:
            if status.up:
                log.warning("engine unreachable", extra={"error": str(exc)})
            status.up = False
            return
        before, status.load = status.load, load
        self._note_restart(before, load)
        if before is None or (before.capacity_blocks, before.engine_block_size) != (
            load.capacity_blocks,
            load.engine_block_size,
        ):
            self._wake_announce.set()  # the announce carries capacity and block size
        await self._scrape_adapters()
        came_up = not status.up
        status.up = status.ever_up = True
        if came_up:  # first contact, or back after being unreachable
            log.info("engine reachable: probing its replay buffer")
            for source in self.sources:
                source.request_restart_probe()

    def _note_restart(self, before: EngineLoad | None, load: EngineLoad) -> None:
        """The engine's counters went back since the last scrape: a new process, its
        cache empty. Its KV events would say so only with its first batch (or through
        replay, which may be off): the state is replaced now, unless the events said so
        already."""
        restarted = restarted_between(before, load)
        if restarted:
            log.warning("engine restarted: its counters went back")
        for source in self.sources:
            if restarted:
                source.restarted_since_mark()
            source.mark()

    async def _scrape_adapters(self) -> None:
        """The engine's LoRA adapters; a change is announced at once (a replica that
        unloaded an adapter stops being chosen for it within one load interval)."""
        try:
            adapters = await self.engine.adapters()
        except EngineUnavailable:
            return  # an engine without /v1/models: none known; keep the last list
        if adapters != self.engine_status.adapters:
            self.engine_status.adapters = adapters
            self._wake_announce.set()

    def load_report(self) -> events_pb2.LoadReport:
        load = self.engine_status.load or EngineLoad()
        prefill = load.prefill or PrefillTotals()
        return events_pb2.LoadReport(
            replica_id=self.settings.replica_id,
            pool=self.settings.pool,
            epoch=self.outbox.epoch,
            running=load.running,
            waiting=load.waiting,
            kv_usage=load.kv_usage,
            prefix_cache_queries=load.prefix_cache_queries,
            prefix_cache_hits=load.prefix_cache_hits,
            engine_up=self.engine_status.up,
            ts=time.time(),
            prefill_requests=prefill.requests,
            prefill_seconds=prefill.seconds,
            prefill_computed_tokens=prefill.computed_tokens,
            queue_seconds=prefill.queue_seconds,
        )
