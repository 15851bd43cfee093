"""The KV event transport: a ZMQ PUB socket and a ROUTER replay socket, in one thread.

This is vLLM's ``ZmqEventPublisher`` protocol (``vllm/distributed/kv_events.py``):

- live message: ``[topic, seq as 8-byte big-endian, payload]``; ``seq`` counts batches
  from 0 per engine start;
- replay: a client sends ``[b"", start_seq8]`` from a DEALER (``start_seq8`` from a REQ);
  the ROUTER answers every buffered batch with ``seq >= start`` as
  ``[topic, seq8, payload]`` (vLLM ≥0.26 framing), then ``[b"", ff * 8, b""]``;
  any other request shape is ignored, as vLLM does;
- the buffer keeps the last ``buffer_steps`` batches (a bounded deque).

The sockets live in a dedicated thread so that no socket call ever runs on the event
loop. The loop hands batches and commands over an inproc PUSH/PULL pair (one socket per
side, so no ZMQ socket is shared between threads); the thread blocks in ``zmq.Poller``
on that pipe and the ROUTER. Both sockets always *bind* (the simulator is the stable
side); port 0 picks a free port, reported by ``endpoints``.

Commands implement the transport faults: ``pause`` (batches still get a seq and enter
the replay buffer but are not sent live, so subscribers see a gap they can replay),
``resume``, ``restart`` (seq back to 0 and buffer emptied, as an engine restart), and
``drop_replay`` (buffer emptied).
"""

from __future__ import annotations

import itertools
import logging
import threading
from collections import deque
from dataclasses import dataclass

import zmq

END_SEQ = (-1).to_bytes(8, "big", signed=True)
log = logging.getLogger(__name__)
_ids = itertools.count()


@dataclass(frozen=True)
class PublisherConfig:
    endpoint: str
    replay_endpoint: str | None
    topic: str = ""
    buffer_steps: int = 10_000
    hwm: int = 100_000


class EventPublisher:
    """Owns the publisher thread; ``publish`` and the fault commands are loop-safe."""

    def __init__(self, config: PublisherConfig) -> None:
        self.config = config
        self._ctx = zmq.Context()
        self._pipe_addr = f"inproc://enginesim-events-{next(_ids)}"
        self._push = self._ctx.socket(zmq.PUSH)
        self._push.set_hwm(config.hwm)
        self._push.bind(self._pipe_addr)
        self._ready = threading.Event()
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self.endpoint = config.endpoint
        self.replay_endpoint = config.replay_endpoint
        self.dropped = 0

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="enginesim-events", daemon=True)
        self._thread.start()
        self._ready.wait()
        if self._error is not None:
            raise self._error

    def publish(self, payload: bytes) -> None:
        self._send(b"batch", payload)

    def command(self, name: str) -> None:
        if name not in _COMMANDS:
            raise ValueError(f"unknown publisher command {name!r}")
        self._send(name.encode(), b"")

    def _send(self, kind: bytes, payload: bytes) -> None:
        try:
            self._push.send_multipart([kind, payload], flags=zmq.NOBLOCK)
        except zmq.Again:
            self.dropped += 1
            log.warning("event queue full: batch dropped (%d so far)", self.dropped)

    def close(self) -> None:
        if self._thread is not None and self._thread.is_alive():
            self._push.send_multipart([b"quit", b""])
            self._thread.join(timeout=10)
        self._push.close(linger=0)
        self._ctx.term()

    def _run(self) -> None:
        try:
            worker = _Worker(self._ctx, self.config, self._pipe_addr)
        except BaseException as exc:  # reported to start(), which re-raises
            self._error = exc
            self._ready.set()
            return
        self.endpoint, self.replay_endpoint = worker.endpoints()
        self._ready.set()
        try:
            worker.loop()
        finally:
            worker.close()


_COMMANDS = frozenset({"pause", "resume", "restart", "drop_replay"})


class _Worker:
    """The thread's side: sockets, sequence numbers and the replay ring."""

    def __init__(self, ctx: zmq.Context[zmq.Socket[bytes]], cfg: PublisherConfig, pipe: str):
        self.cfg = cfg
        self.topic = cfg.topic.encode("utf-8")
        self.pull = ctx.socket(zmq.PULL)
        self.pub = ctx.socket(zmq.PUB)
        self.router: zmq.Socket[bytes] | None = None
        try:
            self.pull.connect(pipe)
            self.pub.set_hwm(cfg.hwm)
            self.pub.bind(cfg.endpoint)
            if cfg.replay_endpoint:
                self.router = ctx.socket(zmq.ROUTER)
                self.router.setsockopt(zmq.SNDHWM, 2 * (cfg.buffer_steps + 1))
                self.router.bind(cfg.replay_endpoint)
        except zmq.ZMQError:
            self.close()
            raise
        self.seq = 0
        self.paused = False
        self.buffer: deque[tuple[bytes, bytes]] = deque(maxlen=cfg.buffer_steps)

    def endpoints(self) -> tuple[str, str | None]:
        pub = self.pub.getsockopt_string(zmq.LAST_ENDPOINT)
        replay = self.router.getsockopt_string(zmq.LAST_ENDPOINT) if self.router else None
        return pub, replay

    def loop(self) -> None:
        poller = zmq.Poller()
        poller.register(self.pull, zmq.POLLIN)
        if self.router is not None:
            poller.register(self.router, zmq.POLLIN)
        while True:
            ready = dict(poller.poll())
            if not self._drain_pipe():
                return
            if self.router is not None and self.router in ready:
                self._answer_replay()

    def _drain_pipe(self) -> bool:
        """Handle every queued batch and command first, so that a replay answers with
        everything published before it was asked for."""
        while True:
            try:
                kind, payload = self.pull.recv_multipart(flags=zmq.NOBLOCK)
            except zmq.Again:
                return True
            if not self._handle(kind, payload):
                return False

    def _handle(self, kind: bytes, payload: bytes) -> bool:
        if kind == b"batch":
            self._publish(payload)
        elif kind == b"quit":
            return False
        elif kind == b"pause":
            self.paused = True
        elif kind == b"resume":
            self.paused = False
        elif kind == b"restart":
            self.seq = 0
            self.buffer.clear()
        elif kind == b"drop_replay":
            self.buffer.clear()
        return True

    def _publish(self, payload: bytes) -> None:
        seq8 = self.seq.to_bytes(8, "big")
        self.seq += 1
        self.buffer.append((seq8, payload))
        if not self.paused:
            self.pub.send_multipart([self.topic, seq8, payload])

    def _answer_replay(self) -> None:
        assert self.router is not None
        frames = self.router.recv_multipart()
        if len(frames) != 3 or frames[1] != b"" or len(frames[2]) != 8:
            log.warning("invalid replay request ignored (%d frames)", len(frames))
            return
        identity, start = frames[0], int.from_bytes(frames[2], "big")
        for seq8, payload in list(self.buffer):
            if int.from_bytes(seq8, "big") >= start:
                self.router.send_multipart([identity, b"", self.topic, seq8, payload])
        self.router.send_multipart([identity, b"", b"", END_SEQ, b""])

    def close(self) -> None:
        for sock in (self.pull, self.pub, self.router):
            if sock is not None:
                sock.close(linger=0)
