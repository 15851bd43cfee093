"""The engine's ZMQ KV-event stream, made gap-free where the engine allows it.

Transport only: this module turns ZMQ messages into in-order :class:`Frame` values
``(topic, seq, payload)`` and never looks inside a payload. It owns

- the SUB socket (connect by default; bind when the engine connects to us, vLLM's
  "bind stable, connect volatile"), 3-frame messages with an 8-byte big-endian ``seq``;
- sequence tracking: the next expected ``seq`` starts at 0, so a sidecar started beside a
  running engine first catches up through the replay socket;
- replay: on a gap, a DEALER sends ``[b"", start_seq]`` to the engine's ROUTER and reads
  every buffered batch until the end marker, in either reply framing (``[seq, payload]``
  up to vLLM 0.25, ``[topic, seq, payload]`` since vLLM 0.26 and in SGLang);
- duplicates and restarts: a ``seq`` lower than expected is a duplicate if its payload is
  the one already seen under that seq (live frames queued while a replay ran), and an
  engine restart otherwise (:class:`EngineRestarted`);
- what it cannot recover it reports (:class:`FramesLost`), never hides.

The consumer may ask for the engine's whole history (:meth:`ZmqEventSource.request_history`,
to rebuild state after an unknown parent) and for a probe
(:meth:`ZmqEventSource.request_restart_probe`, when the engine becomes reachable or has
been quiet): a restart is detected, and batches that never arrived live (a SUB socket
still connecting when the engine's first batches went out) are caught up. Without a replay
socket a restart shows only in the new process's first batch, which may be long in coming
(no request reaches it); the consumer's other evidence of one (its counters went back
between two scrapes: :meth:`ZmqEventSource.restarted_since_mark`) ends the old stream at
once, unless the stream saw that restart itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import OrderedDict
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import cast

import xxhash
import zmq
import zmq.asyncio

END_SEQ = (1 << 64) - 1  # (-1).to_bytes(8, "big", signed=True) read unsigned
_POLL_S = 0.1
_POLLIN = int(zmq.POLLIN)  # plain ints: pyzmq's flag enums cost a Python call per operation
_NOBLOCK = int(zmq.NOBLOCK)
_EVENTS, _FD = int(zmq.EVENTS), int(zmq.FD)


@dataclass(frozen=True, slots=True)
class Frame:
    topic: bytes
    seq: int
    payload: bytes
    received_ns: int
    replayed: bool = False


@dataclass(frozen=True, slots=True)
class EngineRestarted:
    """The engine's sequence went backwards or its history changed: it restarted."""

    seq: int


@dataclass(frozen=True, slots=True)
class FramesLost:
    """Batches ``first..last`` (inclusive) were missed and replay could not recover them."""

    first: int
    last: int


@dataclass(frozen=True, slots=True)
class HistoryReplay:
    """The engine's whole history from seq 0, in order: state can be rebuilt from it."""

    frames: tuple[Frame, ...]


SourceItem = Frame | EngineRestarted | FramesLost | HistoryReplay


@dataclass(slots=True)
class SourceStats:
    frames_received: int = 0
    frames_rejected: dict[str, int] = field(default_factory=dict)
    duplicates: int = 0
    gaps: int = 0
    frames_lost: int = 0
    restarts: int = 0
    replays_ok: int = 0
    replays_partial: int = 0
    replays_failed: int = 0
    replayed_frames: int = 0

    def reject(self, reason: str) -> None:
        self.frames_rejected[reason] = self.frames_rejected.get(reason, 0) + 1


def total_stats(parts: list[SourceStats]) -> SourceStats:
    """Several sources' counters added up (one source per data-parallel rank)."""
    total = SourceStats()
    for part in parts:
        for name in SourceStats.__dataclass_fields__:
            value = getattr(part, name)
            if isinstance(value, dict):
                for reason, count in value.items():
                    total.frames_rejected[reason] = total.frames_rejected.get(reason, 0) + count
            else:
                setattr(total, name, getattr(total, name) + value)
    return total


@dataclass(frozen=True, slots=True)
class SourceConfig:
    endpoint: str
    replay_endpoint: str | None = None
    topic: str = ""
    bind: bool = False
    replay_timeout_s: float = 1.0
    receive_hwm: int = 100_000
    seen_window: int = 16_384  # how many recent (seq, payload digest) pairs are remembered


class _SeenFrames:
    """Digests of recently delivered payloads by seq, to tell duplicates from restarts."""

    def __init__(self, capacity: int) -> None:
        self._capacity = capacity
        self._digests: OrderedDict[int, int] = OrderedDict()

    def add(self, frame: Frame) -> None:
        self._digests[frame.seq] = xxhash.xxh3_64_intdigest(frame.payload)
        if len(self._digests) > self._capacity:
            self._digests.popitem(last=False)

    def matches(self, frame: Frame) -> bool:
        return self._digests.get(frame.seq) == xxhash.xxh3_64_intdigest(frame.payload)

    def clear(self) -> None:
        self._digests.clear()


def _queued(sub: zmq.Socket[bytes]) -> bool:
    """A message is waiting on ``sub`` (reading ``EVENTS`` also re-arms its descriptor)."""
    return bool(cast(int, sub.getsockopt(_EVENTS)) & _POLLIN)


def _wake(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_result(None)


def parse_live(parts: list[bytes], received_ns: int) -> Frame | str:
    """A live message as a :class:`Frame`, or the reason it is not one."""
    if len(parts) != 3:
        return "bad_frame_count"
    topic, seq, payload = parts
    if len(seq) != 8:
        return "bad_seq"
    return Frame(topic, int.from_bytes(seq, "big"), payload, received_ns)


def parse_replay(parts: list[bytes], received_ns: int) -> Frame | str | None:
    """A replay reply (after the DEALER's empty frame): a frame, ``None`` at the end marker,
    or the reason it is neither. Accepts ``[seq, payload]`` and ``[topic, seq, payload]``."""
    if parts and parts[0] == b"":
        parts = parts[1:]
    if len(parts) == 2:
        topic, (seq, payload) = b"", parts
    elif len(parts) == 3:
        topic, seq, payload = parts
    else:
        return "bad_replay_frame_count"
    if len(seq) != 8:
        return "bad_seq"
    number = int.from_bytes(seq, "big")
    if number == END_SEQ:
        return None
    return Frame(topic, number, payload, received_ns, replayed=True)


def contiguous_from(frames: list[Frame], start: int) -> list[Frame]:
    """The run of ``frames`` that continues ``start`` without a hole, from its first seq."""
    run: list[Frame] = []
    for frame in sorted(frames, key=lambda f: f.seq):
        if frame.seq < start or (run and frame.seq != run[-1].seq + 1):
            if run:
                break
            continue
        run.append(frame)
    return run


class ZmqEventSource:
    """Yields the engine's batches in seq order, with the discontinuities it found."""

    def __init__(self, config: SourceConfig, stats: SourceStats | None = None) -> None:
        self.config = config
        self.stats = stats or SourceStats()
        self.expected = 0
        self._context = zmq.asyncio.Context()
        self._sub: zmq.asyncio.Socket | None = None
        self._sub_now: zmq.Socket[bytes] | None = None  # the same socket, read without futures
        self._watched: int | None = None  # its descriptor, once registered with the loop
        self._waiter: asyncio.Future[None] | None = None  # set while waiting for a message
        self._seen = _SeenFrames(config.seen_window)
        self._want_history = False
        self._want_probe = False
        self._marked_restarts = 0  # restarts seen at the consumer's last mark()
        self._restart_claim: int | None = None  # restarted_since_mark(): restarts at the mark
        self._closed = False
        self.caught_up = asyncio.Event()  # set once the start-up replay has been read
        self.last_frame_at = time.monotonic()  # of the last live message

    # -- lifecycle -------------------------------------------------------------------
    def open(self) -> None:
        sub = self._context.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.RCVHWM, self.config.receive_hwm)
        sub.setsockopt(zmq.SUBSCRIBE, self.config.topic.encode())
        if self.config.bind:
            sub.bind(self.config.endpoint)
        else:
            sub.connect(self.config.endpoint)
        self._sub = sub
        self._sub_now = zmq.Socket.shadow(sub.underlying)

    def close(self) -> None:
        self._closed = True
        if self._watched is not None:
            with contextlib.suppress(RuntimeError):  # no loop running: nothing registered
                asyncio.get_running_loop().remove_reader(self._watched)
            self._watched = None
        if self._sub is not None:
            self._sub.close(linger=0)
        self._context.destroy(linger=0)

    def request_history(self) -> None:
        """Ask for a rebuild from the engine's whole history on the next turn."""
        self._want_history = True

    def request_restart_probe(self) -> None:
        """Ask to check, through replay, whether the engine restarted unseen."""
        self._want_probe = True

    def mark(self) -> None:
        """Remember how many restarts were seen so far (the consumer marks each time it
        finds the engine process it knew still running)."""
        self._marked_restarts = self.stats.restarts

    def restarted_since_mark(self) -> None:
        """The engine process restarted since the last :meth:`mark`: unless this stream
        saw that restart (a seq going back), the next item is :class:`EngineRestarted`
        and the new process's seq 0 is expected."""
        self._restart_claim = self._marked_restarts

    # -- the stream ------------------------------------------------------------------
    async def items(self) -> AsyncIterator[SourceItem]:
        if self._sub is None:
            self.open()
        async for item in self._catch_up(self.expected):
            yield item
        self.caught_up.set()
        while not self._closed:
            if self._want_probe or self._want_history or self._restart_claim is not None:
                async for item in self._requested():
                    yield item
            frame = await self._receive()
            if frame is None:
                continue
            if frame.seq == self.expected:  # the usual case, without a generator per frame
                yield self._accept(frame)
            else:
                async for item in self._sequence(frame):
                    yield item

    async def _receive(self) -> Frame | None:
        sub = self._sub_now
        assert sub is not None
        if not _queued(sub) and not await self._readable(_POLL_S):
            return None
        try:  # through a plain (shadow) socket: a future per message cost more than the
            parts = sub.recv_multipart(_NOBLOCK)  # rest of the sidecar's work on it
        except zmq.Again:  # pragma: no cover - EVENTS said a message was queued
            return None
        self.stats.frames_received += 1
        self.last_frame_at = time.monotonic()
        parsed = parse_live(parts, time.monotonic_ns())
        if isinstance(parsed, str):
            self.stats.reject(parsed)
            return None
        return parsed

    async def _readable(self, timeout_s: float) -> bool:
        """Wait until a live message is queued (``False`` after ``timeout_s``); called when
        ``EVENTS`` has just said none is. ZMQ's file descriptor only signals that the
        socket's state may have changed, so ``EVENTS`` is read after every wake-up. The
        descriptor stays registered with the loop between waits (two ``epoll_ctl`` calls
        saved per batch)."""
        sub = self._sub_now
        assert sub is not None
        loop = asyncio.get_running_loop()
        if self._watched is None:
            self._watched = cast(int, sub.getsockopt(_FD))
            loop.add_reader(self._watched, self._on_readable)
        deadline = loop.time() + timeout_s
        while True:
            remaining = deadline - loop.time()
            if remaining <= 0 or self._closed:
                return False
            self._waiter = woken = loop.create_future()
            timer = loop.call_later(remaining, _wake, woken)
            try:
                await woken
            finally:
                self._waiter = None
                timer.cancel()
            if _queued(sub):
                return True

    def _on_readable(self) -> None:
        """The loop saw the descriptor readable: wake the waiting reader, or, when none
        waits, read ``EVENTS`` so that the descriptor stops signalling (what is queued is
        found by the next receive)."""
        if self._waiter is not None:
            _wake(self._waiter)
        elif self._sub_now is not None and not self._closed:
            _queued(self._sub_now)

    async def _requested(self) -> AsyncIterator[SourceItem]:
        claim, self._restart_claim = self._restart_claim, None
        if claim == self.stats.restarts and self.expected > 0:
            yield self._restarted(self.expected - 1)  # its first batches are still to come
        if self._want_probe:
            self._want_probe = False
            async for item in self._probe():
                yield item
        if self._want_history:
            self._want_history = False
            history = await self._history()
            if history is not None:
                yield history

    async def _sequence(self, frame: Frame) -> AsyncIterator[SourceItem]:
        if frame.seq < self.expected:
            if self._seen.matches(frame):
                self.stats.duplicates += 1
                return
            yield self._restarted(frame.seq)
        if frame.seq > self.expected:
            self.stats.gaps += 1
            async for item in self._catch_up(self.expected):
                yield item
            if frame.seq < self.expected:  # the replay already delivered it
                self.stats.duplicates += 1
                return
            if frame.seq > self.expected:
                yield self._lost(self.expected, frame.seq - 1)
        yield self._accept(frame)

    def _accept(self, frame: Frame) -> Frame:
        self._seen.add(frame)
        self.expected = frame.seq + 1
        return frame

    def _restarted(self, seq: int) -> EngineRestarted:
        self.stats.restarts += 1
        self._seen.clear()
        self.expected = 0
        return EngineRestarted(seq)

    def _lost(self, first: int, last: int) -> FramesLost:
        self.stats.frames_lost += last - first + 1
        self.expected = last + 1
        return FramesLost(first, last)

    async def _catch_up(self, start: int) -> AsyncIterator[SourceItem]:
        """Deliver what the replay buffer holds from ``start`` on; report what it lacks."""
        frames = await self._replay(start)
        if frames is None:
            return
        run = contiguous_from(frames, start)
        if run and run[0].seq > start:
            yield self._lost(start, run[0].seq - 1)
        for frame in run:
            yield self._accept(frame)

    async def _history(self) -> HistoryReplay | None:
        frames = await self._replay(0)
        run = contiguous_from(frames or [], 0)
        if not run or run[0].seq != 0 or run[-1].seq + 1 < self.expected:
            return None
        for frame in run:
            self._accept(frame)
        return HistoryReplay(tuple(run))

    async def _probe(self) -> AsyncIterator[SourceItem]:
        """Did the engine restart, or publish what never reached us? Ask the replay
        socket from the last batch seen (from 0 when none was: catch up)."""
        if not self.config.replay_endpoint:
            return
        if self.expected == 0:
            async for item in self._catch_up(0):
                yield item
            return
        frames = await self._replay(self.expected - 1)
        if frames is None:
            return
        last_seen = next((f for f in frames if f.seq == self.expected - 1), None)
        if last_seen is not None and self._seen.matches(last_seen):
            for frame in contiguous_from(frames, self.expected):
                yield self._accept(frame)
            return
        if frames and min(f.seq for f in frames) >= self.expected:
            async for item in self._sequence(min(frames, key=lambda f: f.seq)):
                yield item
            return
        yield self._restarted(self.expected - 1)
        async for item in self._catch_up(0):
            yield item

    # -- replay socket ---------------------------------------------------------------
    async def _replay(self, start: int) -> list[Frame] | None:
        """Every buffered batch from ``start`` on, ``None`` when replay is off or silent."""
        if not self.config.replay_endpoint:
            return None
        dealer = self._context.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        try:
            dealer.connect(self.config.replay_endpoint)
            await dealer.send_multipart([b"", start.to_bytes(8, "big")])
            frames, complete = await self._read_replay(dealer)
        finally:
            dealer.close(linger=0)
        self._count_replay(frames, complete)
        return frames if (frames or complete) else None

    async def _read_replay(self, dealer: zmq.asyncio.Socket) -> tuple[list[Frame], bool]:
        frames: list[Frame] = []
        timeout_ms = int(self.config.replay_timeout_s * 1000)
        while await dealer.poll(timeout_ms):
            parsed = parse_replay(await dealer.recv_multipart(), time.monotonic_ns())
            if parsed is None:
                return frames, True
            if isinstance(parsed, str):
                self.stats.reject(parsed)
                continue
            frames.append(parsed)
        return frames, False

    def _count_replay(self, frames: list[Frame], complete: bool) -> None:
        self.stats.replayed_frames += len(frames)
        if complete:
            self.stats.replays_ok += 1
        elif frames:
            self.stats.replays_partial += 1
        else:
            self.stats.replays_failed += 1
