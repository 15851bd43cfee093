"""The sidecar's NATS connection: publish bytes, answer requests, report connectivity.

Only this module imports ``nats``. It connects in the background (retrying until NATS
answers, so a sidecar can start before NATS), lets nats-py reconnect forever, and calls
``on_connected`` after the first connection and after every reconnection: the service
then republishes its state, because core NATS may have lost whatever was in flight when
the connection broke. The link is pinged every ``ping_interval_s``, so a server that
falls silent without closing the connection (a partition, a stopped process) is found
dead within ``MAX_OUTSTANDING_PINGS + 1`` intervals and reconnected to, as the control
plane's is (nats-py's default, a ping every 2 min, took up to 6 min). A publish while
disconnected returns ``False`` rather than queueing in nats-py's own buffer: the outbox
holds what waits, bounded and counted.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import nats
import nats.errors
from nats.aio.client import Client
from nats.aio.msg import Msg

from kvruntime.nats import redacted, subscriptions_live

log = logging.getLogger(__name__)

Respond = Callable[[bytes], Awaitable[None]]
RequestHandler = Callable[[bytes, Respond], Awaitable[None]]
_RETRY_S = 0.25
MAX_OUTSTANDING_PINGS = 2  # unanswered pings tolerated: the third tick declares it dead


class NatsLink:
    def __init__(
        self,
        url: str,
        *,
        name: str,
        on_connected: Callable[[], None],
        ping_interval_s: float = 1.0,
        token: str | None = None,
        user: str | None = None,
        password: str | None = None,
    ) -> None:
        self.url = url
        self._name = name
        self._on_connected = on_connected
        self._ping_interval_s = ping_interval_s
        self._auth = {"token": token, "user": user, "password": password}
        self._nc: Client | None = None
        self._subscriptions: list[tuple[str, RequestHandler]] = []

    @property
    def connected(self) -> bool:
        return self._nc is not None and self._nc.is_connected

    async def run(self) -> None:
        """Connect, retrying until NATS answers; returns once connected and serving
        (``connected`` is true only once the requests served here can be answered)."""
        nc = None
        while nc is None:
            try:
                nc = await nats.connect(**self._options())
            except (nats.errors.Error, OSError, TimeoutError) as exc:
                log.info(
                    "nats not reachable yet", extra={"url": redacted(self.url), "error": repr(exc)}
                )
                await asyncio.sleep(_RETRY_S)
        try:
            for subject, handler in self._subscriptions:
                await self._subscribe(nc, subject, handler)
            if not await subscriptions_live(nc):
                log.warning("nats subscriptions not confirmed live", extra={"timeout_s": 5.0})
        except BaseException:  # stopped meanwhile: nobody else would close it
            await nc.close()
            raise
        self._nc = nc
        log.info("nats connected", extra={"url": redacted(self.url)})
        self._on_connected()

    def _options(self) -> dict[str, Any]:
        options: dict[str, Any] = {
            "servers": [self.url],
            "name": self._name,
            "allow_reconnect": True,
            "max_reconnect_attempts": -1,
            "reconnect_time_wait": _RETRY_S,
            "connect_timeout": 2,
            "ping_interval": self._ping_interval_s,
            "max_outstanding_pings": MAX_OUTSTANDING_PINGS,
            "reconnected_cb": self._reconnected,
            "disconnected_cb": self._disconnected,
            "error_cb": self._error,
        }
        return options | {k: v for k, v in self._auth.items() if v}

    async def _reconnected(self) -> None:
        log.info("nats reconnected", extra={"url": redacted(self.url)})
        self._on_connected()

    async def _disconnected(self) -> None:
        log.warning("nats disconnected", extra={"url": redacted(self.url)})

    async def _error(self, exc: Exception) -> None:
        log.info("nats client error", extra={"error": repr(exc)})

    async def publish(self, subject: str, payload: bytes) -> bool:
        """Hand ``payload`` to NATS; ``False`` if the connection is down."""
        if not self.connected:
            return False
        assert self._nc is not None
        try:
            await self._nc.publish(subject, payload)
        except (nats.errors.Error, OSError):
            return False
        return True

    async def serve(self, subject: str, handler: RequestHandler) -> None:
        """Call ``handler(data, respond)`` for every request on ``subject``."""
        self._subscriptions.append((subject, handler))
        if self._nc is not None:
            await self._subscribe(self._nc, subject, handler)

    async def _subscribe(self, nc: Client, subject: str, handler: RequestHandler) -> None:
        async def on_message(msg: Msg) -> None:
            async def respond(reply: bytes) -> None:
                if msg.reply:
                    await msg.respond(reply)

            await handler(msg.data, respond)

        await nc.subscribe(subject, cb=on_message)

    async def flush(self, timeout_s: float = 2.0) -> bool:
        if not self.connected:
            return False
        assert self._nc is not None
        try:
            await self._nc.flush(timeout=timeout_s)  # type: ignore[arg-type]
        except (nats.errors.Error, OSError, TimeoutError):
            return False
        return True

    async def close(self) -> None:
        nc, self._nc = self._nc, None
        if nc is None:
            return
        try:
            await nc.drain()
        except (nats.errors.Error, OSError, TimeoutError):
            await nc.close()
