"""A fake engine's ZMQ side: XPUB for live batches, ROUTER replay with a bounded buffer.

It speaks exactly the wire protocol of vLLM's ``ZmqEventPublisher`` (3-frame messages,
8-byte big-endian seq, replay ``[b"", start_seq]`` answered batch by batch then with the
end marker, in the old or the new reply framing), so the sidecar's source can be tested
without an engine. XPUB (instead of PUB) lets a test wait until the sidecar has actually
subscribed, instead of sleeping.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from typing import Literal

import zmq
import zmq.asyncio

END = (-1).to_bytes(8, "big", signed=True)


class FakeEngine:
    def __init__(
        self,
        *,
        topic: bytes = b"kv@test",
        buffer_steps: int = 1000,
        framing: Literal["old", "new"] = "new",
        replay: bool = True,
    ) -> None:
        self.topic = topic
        self.framing = framing
        self.seq = 0
        self.buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self.paused = False
        self.replay_requests: list[int] = []
        self._ctx = zmq.asyncio.Context()
        self._pub = self._ctx.socket(zmq.XPUB)
        self._pub.setsockopt(zmq.LINGER, 0)
        port = self._pub.bind_to_random_port("tcp://127.0.0.1")
        self.endpoint = f"tcp://127.0.0.1:{port}"
        self.replay_endpoint: str | None = None
        self._router: zmq.asyncio.Socket | None = None
        if replay:
            self._router = self._ctx.socket(zmq.ROUTER)
            self._router.setsockopt(zmq.LINGER, 0)
            rport = self._router.bind_to_random_port("tcp://127.0.0.1")
            self.replay_endpoint = f"tcp://127.0.0.1:{rport}"
        self._task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> FakeEngine:
        if self._router is not None:
            self._task = asyncio.create_task(self._serve_replay())
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        self._pub.close(linger=0)
        if self._router is not None:
            self._router.close(linger=0)
        self._ctx.destroy(linger=0)

    async def wait_subscribed(self, deadline_s: float = 5.0) -> None:
        """Return once a subscriber's subscription message has arrived."""
        async with asyncio.timeout(deadline_s):
            while True:
                message = await self._pub.recv()
                if message[:1] == b"\x01":
                    return

    async def publish(self, payload: bytes, *, on_the_wire: bytes | None = None) -> int:
        """Send one batch (unless paused: then it is only buffered, as if dropped by HWM).

        ``on_the_wire`` replaces the payload on the live socket only (corrupted in
        transit), while the replay buffer keeps the real one.
        """
        seq, self.seq = self.seq, self.seq + 1
        self.buffer.append((seq, payload))
        if not self.paused:
            live = payload if on_the_wire is None else on_the_wire
            await self._pub.send_multipart([self.topic, seq.to_bytes(8, "big"), live])
        return seq

    async def send_raw(self, parts: list[bytes]) -> None:
        await self._pub.send_multipart(parts)

    def restart(self) -> None:
        """What an engine restart looks like on the wire: seq from 0, replay buffer empty."""
        self.seq = 0
        self.buffer.clear()

    async def _serve_replay(self) -> None:
        assert self._router is not None
        while True:
            identity, _empty, start = await self._router.recv_multipart()
            first = int.from_bytes(start, "big")
            self.replay_requests.append(first)
            for seq, payload in list(self.buffer):
                if seq >= first:
                    await self._router.send_multipart([identity, b"", *self._reply(seq, payload)])
            end = [END, b""] if self.framing == "old" else [b"", END, b""]
            await self._router.send_multipart([identity, b"", *end])

    def _reply(self, seq: int, payload: bytes) -> list[bytes]:
        body = [seq.to_bytes(8, "big"), payload]
        return body if self.framing == "old" else [self.topic, *body]
