"""The proxy's ``RoutingState.Watch`` client: keeps a :class:`FleetState` current.

A proxy must keep routing whatever happens to the control plane, so this client never
gives up and never blocks routing:

- it watches the proxy's pools on one of the ``--controlplane`` addresses (starting at a
  random one, so proxies spread over the instances) and, when the stream fails or ends,
  reconnects to the next one after a jittered exponential backoff (full jitter, capped);
- it resumes with ``(have_epoch, have_version)`` so a short break costs only the deltas
  missed; after a version gap or an epoch change (``SnapshotNeeded``) it asks for a new
  snapshot at once, while the old state keeps serving;
- a stream silent for ``idle_timeout_s`` (no delta, not even a heartbeat) is treated as
  dead: a hung control plane looks like a connected one;
- updates are applied in steps, yielding to the event loop between them;
- the watch's initial metadata may carry this proxy's place among the proxies watching
  the shard (:data:`~kvcore.subjects.PROXY_PLACE_METADATA`), handed to ``on_place``.

The RPC is bound by its full method name (no generated stubs: see docs/architecture.md).
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import grpc

from dataplane.errors import SnapshotNeeded
from dataplane.fleet.state import FleetState
from dataplane.settings import ProxySettings
from kvcore.pb import routing_pb2
from kvcore.subjects import PROXY_PLACE_METADATA
from kvruntime.tasks import BackgroundTasks

log = logging.getLogger("dataplane.state")

WATCH_METHOD = "/kvroute.v1.RoutingState/Watch"
CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", 16 * 1024 * 1024),  # chunks stay below 4 MiB
    ("grpc.enable_retries", 0),  # this client decides when and where to reconnect
    # A channel's own connections: with gRPC's process-wide pool a new channel took over
    # another's connection to the same address while it waited out gRPC's own backoff, and
    # failed at once ("Connection refused") though the control plane was back.
    ("grpc.use_local_subchannel_pool", 1),
]


@dataclass(frozen=True, slots=True)
class Backoff:
    """Full-jitter exponential backoff: the n-th consecutive failure waits a uniform
    random time in ``[0, min(cap_s, base_s * 2**n)]``."""

    base_s: float = 0.1
    cap_s: float = 5.0

    def delay(self, failures: int, rng: random.Random) -> float:
        return rng.uniform(0.0, min(self.cap_s, self.base_s * 2 ** min(failures, 30)))


def channel_credentials(settings: ProxySettings) -> grpc.ChannelCredentials | None:
    """TLS credentials when the settings ask for TLS, else ``None`` (plaintext)."""
    if settings.controlplane_tls_ca is not None:
        return grpc.ssl_channel_credentials(settings.controlplane_tls_ca.read_bytes())
    if settings.controlplane_tls:
        return grpc.ssl_channel_credentials()
    return None


class StateClient:
    """Watches the control plane and applies what it streams to ``state``."""

    def __init__(
        self,
        settings: ProxySettings,
        state: FleetState,
        *,
        backoff: Backoff | None = None,
        idle_timeout_s: float = 10.0,
        rng: random.Random | None = None,
        credentials: grpc.ChannelCredentials | None = None,
        on_place: Callable[[int], None] | None = None,
    ) -> None:
        """``on_place``: called with the place the control plane numbers this watch with,
        at every (re)connection that carries one."""
        if not settings.controlplane:
            raise ValueError("StateClient needs --controlplane addresses")
        self.state = state
        self._addresses = list(settings.controlplane)
        self._pools = list(settings.pools)
        self._proxy_id = settings.resolved_proxy_id()
        self._credentials = credentials or channel_credentials(settings)
        self._backoff = backoff or Backoff()
        self._idle_timeout_s = idle_timeout_s
        self._rng = rng or random.Random()
        self._on_place = on_place
        self.place: int | None = None
        self._next = self._rng.randrange(len(self._addresses))
        self._tasks = BackgroundTasks()
        self._applied = asyncio.Condition()
        self._ready = asyncio.Event()
        self.connected_to: str | None = None
        self.reconnects = 0
        self.snapshots = 0
        self.last_error = ""

    async def start(self) -> None:
        """Start watching (returns at once; see :meth:`wait_ready`)."""
        if not self._tasks.running:
            self._tasks.spawn(self._run(), name="state-watch")

    async def aclose(self) -> None:
        await self._tasks.aclose()

    @property
    def ready(self) -> bool:
        """Whether a complete snapshot has been applied since start."""
        return self._ready.is_set()

    async def wait_ready(self) -> None:
        """Wait until a first complete snapshot is applied (wrap in ``asyncio.timeout``)."""
        await self._ready.wait()

    async def wait_until(self, check: Callable[[FleetState], bool]) -> None:
        """Wait until ``check(state)`` holds after an applied update (wrap in
        ``asyncio.timeout``): for tests and start-up checks, never on the request path."""
        async with self._applied:
            await self._applied.wait_for(lambda: check(self.state))

    def status(self) -> dict[str, Any]:
        """What /readyz shows about the state stream."""
        epoch, version = self.state.position()
        return {
            "controlplane": self.connected_to,
            "place": self.place,
            "epoch": epoch,
            "version": version,
            "age_s": round(self.state.replicas.age_s(), 3),
            "reconnects": self.reconnects,
            "snapshots": self.snapshots,
            "refused_chunks": self.state.refused,
            "last_error": self.last_error,
        }

    # -- the watch loop -----------------------------------------------------------

    async def _run(self) -> None:
        failures = 0
        while True:
            address = self._addresses[self._next]
            if await self._watch_address(address):
                failures = 0
            else:
                failures += 1
                self._next = (self._next + 1) % len(self._addresses)
            self.connected_to = None
            self.reconnects += 1
            await asyncio.sleep(self._backoff.delay(failures, self._rng))

    async def _watch_address(self, address: str) -> bool:
        """Watch on one address until the stream breaks; whether anything arrived."""
        received, gaps = False, 0
        async with self._channel(address) as channel:
            watch = channel.unary_stream(
                WATCH_METHOD,
                request_serializer=routing_pb2.WatchRequest.SerializeToString,
                response_deserializer=routing_pb2.StateUpdate.FromString,
            )
            while True:
                try:
                    received |= await self._watch_once(watch, address)
                    return received
                except SnapshotNeeded as exc:  # ask again at once, once; then back off
                    log.warning("routing state needs a new snapshot: %s", exc)
                    self.last_error = f"{address}: {exc}"
                    gaps += 1
                    if gaps > 1:
                        return False
                except (grpc.aio.AioRpcError, TimeoutError) as exc:
                    self.last_error = _describe(exc, address)
                    log.warning("routing state stream lost: %s", self.last_error)
                    return received

    def _channel(self, address: str) -> grpc.aio.Channel:
        if self._credentials is None:
            return grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)
        return grpc.aio.secure_channel(address, self._credentials, options=CHANNEL_OPTIONS)

    async def _watch_once(self, watch: Any, address: str) -> bool:
        epoch, version = self.state.position()
        request = routing_pb2.WatchRequest(
            proxy_id=self._proxy_id,
            pools=self._pools,
            have_epoch=epoch,
            have_version=version,
            residency_columns=True,
        )
        call = watch(request)
        received = False
        try:
            if self._on_place is not None:
                await self._take_place(call, self._on_place)
            while True:
                async with asyncio.timeout(self._idle_timeout_s):
                    update = await call.read()
                if update is grpc.aio.EOF:
                    self.last_error = f"{address} ended the stream"
                    return received
                if not received:
                    received, self.connected_to = True, address
                await self._apply(update)
        finally:
            call.cancel()

    async def _take_place(self, call: Any, on_place: Callable[[int], None]) -> None:
        async with asyncio.timeout(self._idle_timeout_s):
            metadata = await call.initial_metadata()
        place = place_in(metadata)
        if place is not None:
            self.place = place
            on_place(place)

    async def _apply(self, update: routing_pb2.StateUpdate) -> None:
        for _ in self.state.apply_steps(update):
            await asyncio.sleep(0)  # let requests be routed between large steps
        if update.HasField("snapshot") and update.snapshot.last_chunk:
            self.snapshots += 1
            self._ready.set()
        async with self._applied:
            self._applied.notify_all()


def place_in(metadata: Any) -> int | None:
    """The place a watch's initial metadata gives this proxy (``None``: none, or not a
    number 0-65535)."""
    value = None if metadata is None else metadata.get(PROXY_PLACE_METADATA)
    if not isinstance(value, str) or not value.isascii() or not value.isdigit():
        return None
    place = int(value)
    return place if place <= 65535 else None


def _describe(exc: BaseException, address: str) -> str:
    if isinstance(exc, grpc.aio.AioRpcError):
        return f"{address}: {exc.code().name} {exc.details() or ''}".strip()
    return f"{address}: no update for the idle timeout"
