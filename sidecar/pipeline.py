"""One engine frame through the domain: decode, translate, queue for publishing.

The synchronous heart of the sidecar, free of sockets so that the service, the fuzz test
and the throughput benchmark all run the very same code. It holds the sidecar's state
(the key mapper), knows when that state is incomplete, and reacts to what the source
reports: a restart clears state and opens a new epoch, a history replay rebuilds it.

Events that are lost for good -- a range replay could not cover, a frame that cannot be
decoded, a removal that cannot be read -- may have removed anything, so the rank's keys
are withdrawn at once (published as removals, or a clear) and the state is flagged
incomplete: keys go missing rather than stale. Whatever arrives next is keyed again
(:meth:`KeyMapper.withdraw_rank` keeps the rank's blocks as positions to chain from).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from kvcore.engine_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EngineEvent,
    EngineEventBatch,
)
from sidecar.adapters import EngineAdapter
from sidecar.adapters.sglang import UNCHAINED_HASHES, UNCHAINED_MESSAGE
from sidecar.errors import FrameError
from sidecar.key_mapper import KeyMapper, MapperStats, RouterCleared
from sidecar.outbox import Outbox
from sidecar.zmq_source import EngineRestarted, Frame, FramesLost, HistoryReplay

log = logging.getLogger(__name__)

REBUILD_CHUNK_FRAMES = 200
LATENCY_BUCKETS_S = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)
_EVENT_TYPES = {BlockStored: "stored", BlockRemoved: "removed", AllBlocksCleared: "cleared"}


@dataclass(slots=True)
class LatencyHistogram:
    """Receive-to-publish latency: cumulative buckets for /metrics, recent samples for bench."""

    buckets: list[int] = field(default_factory=lambda: [0] * len(LATENCY_BUCKETS_S))
    count: int = 0
    total_s: float = 0.0
    recent: deque[float] = field(default_factory=lambda: deque(maxlen=200_000))

    def observe(self, seconds: float) -> None:
        self.count += 1
        self.total_s += seconds
        self.recent.append(seconds)
        for i, bound in enumerate(LATENCY_BUCKETS_S):
            if seconds <= bound:
                self.buckets[i] += 1


@dataclass(slots=True)
class PipelineStats:
    events_received: dict[str, int] = field(default_factory=dict)
    events_rejected: dict[str, int] = field(default_factory=dict)
    frames_undecodable: dict[str, int] = field(default_factory=dict)
    router_events: int = 0
    rebuilds: int = 0
    internal_errors: int = 0
    engine_lag_s: float = 0.0
    latency: LatencyHistogram = field(default_factory=LatencyHistogram)


def _bump(counter: dict[str, int], key: str, by: int = 1) -> None:
    counter[key] = counter.get(key, 0) + by


class Pipeline:
    """The sidecar's state and what changes it. ``ranks`` is the number of engine streams
    (data-parallel ranks); every method takes the ``rank`` an item came from."""

    def __init__(
        self,
        *,
        adapter: EngineAdapter,
        model: str,
        router_block_size: int,
        outbox: Outbox,
        new_epoch: Callable[[], int],
        ranks: int = 1,
    ) -> None:
        self.adapter = adapter
        self.outbox = outbox
        self.ranks = ranks
        self.stats = PipelineStats()
        self.mapper_stats = MapperStats()
        self._new_epoch = new_epoch
        self.mapper = KeyMapper(model, router_block_size, stats=self.mapper_stats)
        self._incomplete: set[int] = set()  # ranks whose state may be missing blocks
        self._rebuilding: set[int] = set()  # ranks half way through a history rebuild
        self.refusal: str | None = None  # why this engine's stores cannot be keyed at all
        self.engine_block_size = 0

    @property
    def state_incomplete(self) -> bool:
        return bool(self._incomplete or self._rebuilding or self.refusal)

    def handle(self, item: Frame | EngineRestarted | FramesLost, rank: int = 0) -> bool:
        """Apply one source item; ``True`` if the state changed in a way worth announcing.
        A :class:`HistoryReplay` goes through :meth:`rebuild_steps` instead."""
        if isinstance(item, Frame):
            return self.handle_frame(item, rank)
        if isinstance(item, EngineRestarted):
            self._restarted(rank)
        else:
            self._lost(rank, time.monotonic_ns())
        return True

    def internal_error(self, rank: int) -> None:
        """An item failed for a reason no input should cause: its effect is unknown."""
        self.stats.internal_errors += 1
        self._lost(rank, time.monotonic_ns())

    def _lost(self, rank: int, received_ns: int | None) -> None:
        """Events of ``rank`` are gone for good: withdraw its keys, flag the state.
        ``received_ns`` is ``None`` while replaying a history (nothing is published)."""
        self._incomplete.add(rank)
        withdrawn = self.mapper.withdraw_rank(rank)
        if received_ns is not None:
            self.outbox.add(withdrawn, received_ns)

    def _restarted(self, rank: int) -> None:
        """One engine: a new epoch opening with a clear. A rank of several: its blocks go.
        A refused engine may come back upgraded: its next store says again if not."""
        self._incomplete.discard(rank)
        self.refusal = None
        now = time.monotonic_ns()
        if self.ranks == 1:
            self.mapper.clear()
            self.outbox.new_epoch(self._new_epoch())
            self.outbox.add([RouterCleared()], now)  # seq 0 of the new epoch
        else:
            self.outbox.add(self.mapper.clear_rank(rank), now)

    def _decode(self, frame: Frame, rank: int, received_ns: int | None) -> EngineEventBatch | None:
        """The frame's batch, its skipped events counted; ``None`` (and the rank's keys
        withdrawn, since it may have held removals) when it cannot be decoded."""
        try:
            batch = self.adapter.decode(frame.payload)
        except FrameError as exc:
            _bump(self.stats.frames_undecodable, exc.reason)
            self._lost(rank, received_ns)
            return None
        for reason in batch.rejected:
            _bump(self.stats.events_rejected, reason)
        if UNCHAINED_HASHES in batch.rejected and self.refusal is None:
            self.refusal = UNCHAINED_MESSAGE
            log.error(UNCHAINED_MESSAGE)
        return batch

    def _replay_frame(self, frame: Frame, rank: int) -> None:
        batch = self._decode(frame, rank, None)
        if batch is not None:
            self._apply_batch(batch, rank, None)

    def handle_frame(self, frame: Frame, rank: int = 0) -> bool:
        """Decode and translate one frame; ``True`` if it revealed an unknown parent,
        lost events (the service may then ask for the engine's history) or an engine
        whose stores cannot be keyed (worth announcing at once)."""
        refused = self.refusal
        batch = self._decode(frame, rank, frame.received_ns)
        if batch is None:
            return True
        self.stats.engine_lag_s = max(0.0, time.time() - batch.ts)
        changed = self._apply_batch(batch, rank, frame.received_ns)
        return changed or self.refusal is not refused

    def _apply_batch(self, batch: EngineEventBatch, rank: int, received_ns: int | None) -> bool:
        """Apply a decoded batch (published unless ``received_ns`` is ``None``); ``True``
        if it revealed an unknown parent or lost a removal."""
        unknown_before = self.mapper_stats.unknown_parents
        for event in batch.events:
            self._apply(event, rank, received_ns)
        if batch.removals_lost:
            self._lost(rank, received_ns)
            return True
        if self.mapper_stats.unknown_parents != unknown_before:
            self._incomplete.add(rank)
            return True
        return False

    def _apply(self, event: EngineEvent, rank: int, received_ns: int | None) -> None:
        routed = self.mapper.apply(event, rank)
        if isinstance(event, AllBlocksCleared):
            self._incomplete.discard(rank)
        if received_ns is None:
            return
        _bump(self.stats.events_received, _EVENT_TYPES[type(event)])
        if isinstance(event, BlockStored):
            self.engine_block_size = event.block_size
        if routed:
            self.stats.router_events += len(routed)
            self.outbox.add(routed, received_ns)

    def rebuild_steps(
        self, history: HistoryReplay, rank: int = 0, *, chunk: int = REBUILD_CHUNK_FRAMES
    ) -> Iterator[int]:
        """Replace a rank's state with what its whole history yields, then snapshot it all.

        Runs in steps of ``chunk`` frames, yielding the frames done so far, so that an event
        loop can run between steps: a history of 10,000 batches takes seconds to replay.
        The rank counts as incomplete until the last step. Events the history itself lost
        (an undecodable frame, an unreadable removal) withdraw the rank's keys there, as
        live, and the rebuild goes on from what follows; it is complete again only after
        a later clear."""
        self.mapper.clear_rank(rank)  # not published: the snapshot below replaces it
        self._incomplete.discard(rank)  # from seq 0: the engine started empty
        self._rebuilding.add(rank)
        finished = False
        try:
            for done, frame in enumerate(history.frames, 1):
                self._replay_frame(frame, rank)
                if done % chunk == 0:
                    yield done
            finished = True
        finally:
            self._rebuilding.discard(rank)
            if not finished:
                self._incomplete.add(rank)
        self.stats.rebuilds += 1
        self.outbox.needs_snapshot = True
