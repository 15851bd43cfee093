"""The running engine: drives the core in wall-clock time and publishes what it does.

``Engine`` owns the core (``scheduler.py``), the event publisher thread, the metrics and
the fault state. One asyncio task runs steps back to back while there is work: it
computes a step, sleeps for the step's modelled duration (``timing.py``; no sleep with
``--instant``), then delivers the step's tokens to the waiting HTTP handlers and
publishes the step's KV events as one batch (as vLLM's scheduler does per step).
HTTP handlers only ``submit`` requests and await their ``RequestHandle``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from enginesim.blockpool import VllmKVCacheManager
from enginesim.errors import EngineRestarted
from enginesim.faults import FaultInjector, FaultUpdate
from enginesim.kv_manager import KVCacheManager
from enginesim.lora import WarmAdapters
from enginesim.metrics import (
    CacheConfig,
    EngineMetrics,
    LoadSnapshot,
    RequestTiming,
    make_metrics,
)
from enginesim.pd import KvTransfers, RemotePrefill
from enginesim.publisher import EventPublisher, PublisherConfig
from enginesim.radix_cache import SglangRadixCache
from enginesim.request import LoadedKV, LoraTag, SimRequest
from enginesim.scheduler import CoreLimits, EngineCore, StepOutput
from enginesim.settings import SimSettings
from enginesim.wire import make_format
from kvruntime.tasks import BackgroundTasks

log = logging.getLogger(__name__)
THREAD_HASH_TOKENS = 4096
MAX_CATCH_UP_S = 0.05
LEASE_CHECK_S = 1.0
_HASH_ALGO = {"vllm": "sha256_cbor", "vllm-0.23": "sha256_cbor", "sglang": "sha256"}
# each event format's KV cache manager, built from (num_blocks, block_size)
_KV_MANAGERS: dict[str, Callable[[int, int], KVCacheManager]] = {
    "vllm": VllmKVCacheManager,
    "vllm-0.23": VllmKVCacheManager,
    "sglang": SglangRadixCache,
}


@dataclass(eq=False)
class RequestHandle:
    """What an HTTP handler awaits: progress of one request."""

    req: SimRequest
    stream: bool
    arrival: float
    error: str | None = None
    progress: asyncio.Event = field(default_factory=asyncio.Event)  # may be shared
    timing: RequestTiming | None = None  # its queueing and prefill, once admitted

    @property
    def done(self) -> bool:
        return self.req.finished or self.error is not None

    def notify(self) -> None:
        self.progress.set()

    async def wait(self) -> None:
        """Until there is something new (tokens when streaming, else the end)."""
        await self.progress.wait()
        self.progress.clear()
        if self.error is not None:
            raise EngineRestarted(self.error)


class Engine:
    def __init__(self, settings: SimSettings, filler: list[int]) -> None:
        self.settings = settings
        self.format = make_format(settings.event_format, settings.block_size)
        limits = CoreLimits(
            settings.block_size,
            settings.num_blocks,
            settings.max_num_seqs,
            settings.model_len,
            settings.max_loras if settings.enable_lora else 0,
        )
        kv: KVCacheManager = (
            SglangRadixCache(settings.num_blocks, settings.block_size, disable=True)
            if settings.disable_radix_cache
            else _KV_MANAGERS[settings.event_format](settings.num_blocks, settings.block_size)
        )
        self.core = EngineCore(limits, self.format.hasher, settings.timing(), kv, filler)
        if settings.enable_lora and settings.event_format != "sglang":
            self.core.warm = WarmAdapters(settings.max_cpu_loras or settings.max_loras)
            self.core.lora_load_s = settings.lora_load_ms / 1000
        self.publisher = EventPublisher(
            PublisherConfig(
                endpoint=settings.kv_events_endpoint,
                replay_endpoint=settings.replay_endpoint or None,
                topic=settings.topic,
                buffer_steps=settings.replay_buffer_steps,
            )
        )
        self._cache_config = CacheConfig(
            settings.model,
            settings.block_size,
            settings.num_blocks,
            _HASH_ALGO[settings.event_format],
            settings.model_len,
        )
        self.metrics: EngineMetrics = make_metrics(
            settings.event_format,
            self._cache_config,
        )
        self.faults = FaultInjector()
        scale = 0.0 if settings.instant else settings.time_scale
        self.transfers = KvTransfers(
            settings.kv_lease_s, settings.kv_transfer_block_ms / 1000 * scale
        )
        self._handles: dict[SimRequest, RequestHandle] = {}
        self._wake = asyncio.Event()
        self._released = asyncio.Event()  # clear while the hold_steps fault holds the steps
        self._released.set()
        self._tasks = BackgroundTasks()

    async def start(self) -> None:
        self.publisher.start()
        self._tasks.spawn(self._run(), name="enginesim-steps")
        self._tasks.spawn(self._expire_transfers(), name="enginesim-kv-leases")

    async def aclose(self) -> None:
        await self._tasks.aclose()
        await self.transfers.aclose()
        self.publisher.close()

    # -- requests ------------------------------------------------------------------

    def check(self, prompt_len: int, max_tokens: int) -> None:
        """Raise ``RequestRejected`` for a request this engine can never serve."""
        self.core.check(prompt_len, max_tokens)

    async def submit(self, req: SimRequest, *, stream: bool) -> RequestHandle:
        """Queue ``req``; raises ``RequestRejected`` if it can never run. A long prompt's
        block hashes are computed in a thread so that the loop keeps serving."""
        arrival = time.perf_counter()
        self.core.check(len(req.prompt), req.max_tokens)
        digests = req.digests or None  # a P/D decode's, hashed for its read
        if digests is None and len(req.prompt) > THREAD_HASH_TOKENS:
            digests = await self._digests(req)
        handle = RequestHandle(req, stream, arrival)
        self.core.add(req, digests)
        self._handles[req] = handle
        self._wake.set()
        return handle

    async def _digests(self, req: SimRequest) -> list[bytes]:
        """``req``'s prompt block hashes; a long prompt's in a thread."""
        if len(req.prompt) > THREAD_HASH_TOKENS:
            return await asyncio.to_thread(self.core.prompt_digests, req)
        return self.core.prompt_digests(req)

    async def submit_all(self, reqs: list[SimRequest], *, stream: bool) -> list[RequestHandle]:
        """Queue ``reqs`` back to back, so that they are admitted in this order; all or
        none: raises ``RequestRejected`` before queueing any if one can never run.

        The handles share one progress event, so one consumer awaits them together.
        Requests that share a prompt list (the ``n`` samples of one prompt) hash it once,
        in a thread if it is long."""
        if len(reqs) == 1:  # the common case, kept as cheap as ``submit``
            return [await self.submit(reqs[0], stream=stream)]
        arrival = time.perf_counter()
        for req in reqs:
            self.core.check(len(req.prompt), req.max_tokens)
        hashed: dict[tuple[int, str | None, LoraTag | None], list[bytes]] = {}
        for req in reqs:
            key = (id(req.prompt), req.salt, req.lora)
            if key not in hashed:
                hashed[key] = req.digests or await self._digests(req)
        progress = asyncio.Event()
        handles = []
        for req in reqs:
            handle = RequestHandle(req, stream, arrival, progress=progress)
            self.core.add(req, list(hashed[id(req.prompt), req.salt, req.lora]))  # its own copy
            self._handles[req] = handle
            handles.append(handle)
        self._wake.set()
        return handles

    def abort(self, handle: RequestHandle) -> None:
        self.core.abort(handle.req)
        self._handles.pop(handle.req, None)
        self._flush_events()

    # -- KV transfer (pd.py) ------------------------------------------------------------

    async def release_transfer(self, body: dict[str, Any]) -> SimRequest | None:
        """A decode engine reads held blocks: free them; the prefill request they were
        held for, ``None`` when the read is refused. An SGLang read names a bootstrap
        room, and waits for its prefill to finish."""
        room = body.get("bootstrap_room")
        if isinstance(room, int):
            req = await self.transfers.read_room(room)
        else:
            req = self.transfers.release(body)
        if req is None:
            return None
        self.core.release(req)
        self._flush_events()
        return req

    async def read_prefill(self, remote: RemotePrefill, req: SimRequest) -> LoadedKV:
        """A vLLM decode's read of ``req``'s prompt (``pd.py``), as the NIXL connector
        does it: the tokens beyond the leading blocks this engine's cache holds
        (``get_num_new_matched_tokens``), read into the blocks it allocates for them
        (``update_state_after_alloc``: its unhashed ones, the prefill's last as many);
        ``KvLoadFailed`` when the prefill engine refuses."""
        kv, bs = self.core.kv, self.settings.block_size
        assert isinstance(kv, VllmKVCacheManager)  # the vLLM formats' manager
        if not req.digests:  # kept for ``submit``
            req.digests = await self._digests(req)
        held = kv.cached_prefix_tokens(req)
        await self.transfers.pull(remote, -(-len(req.prompt) // bs) - held // bs)
        return LoadedKV(len(req.prompt) - held, last_recomputed=True)

    async def _expire_transfers(self) -> None:
        """Frees the blocks of held prefills whose lease ran out, checked once a second
        (vLLM's connector checks at every step; the lease is 30 s)."""
        while True:
            await asyncio.sleep(LEASE_CHECK_S)
            for req in self.transfers.expire():
                self.core.release(req)
            self._flush_events()

    def load(self) -> LoadSnapshot:
        core, kv = self.core, self.core.kv
        used_blocks = kv.capacity_blocks - kv.num_free
        return LoadSnapshot(
            running=len(core.running),
            waiting=len(core.waiting),
            kv_usage=kv.usage,
            used_tokens=used_blocks * kv.block_size,
        )

    # -- admin -----------------------------------------------------------------------

    def reset_prefix_cache(self) -> bool:
        done = self.core.kv.clear()
        self._flush_events()
        return done

    def apply_faults(self, update: FaultUpdate) -> None:
        self.faults.state.apply(update)
        if update.hold_steps is not None:
            (self._released.clear if update.hold_steps else self._released.set)()
        if update.pause_events is not None:
            self.publisher.command("pause" if update.pause_events else "resume")
        if update.drop_replay:
            self.publisher.command("drop_replay")
        if update.restart:
            self._restart()

    def _restart(self) -> None:
        self.transfers.clear()
        for req in self.core.restart():
            handle = self._handles.pop(req, None)
            if handle is not None:
                handle.error = "engine restarted"
                handle.notify()
        self.publisher.command("restart")
        # A restarted engine is a new process: its Prometheus counters start again at zero.
        self.metrics = make_metrics(self.settings.event_format, self._cache_config)

    # -- the step loop -----------------------------------------------------------------

    async def _run(self) -> None:
        """Steps back to back on a deadline clock: the time spent computing a step and
        delivering its tokens counts against the step's modelled duration, and up to
        ``MAX_CATCH_UP_S`` of lag (a busy loop) is made up by shorter sleeps."""
        loop = asyncio.get_running_loop()
        deadline = loop.time()
        while True:
            if not self.core.has_work:
                self._wake.clear()
                await self._wake.wait()
                deadline = loop.time()
                continue
            if not self._released.is_set():
                await self._released.wait()
                deadline = loop.time()
            started = time.perf_counter()  # the step's SCHEDULED time
            out = self.core.step()
            deadline = max(deadline, loop.time() - MAX_CATCH_UP_S)
            deadline += self._wall_seconds(out.duration)
            await asyncio.sleep(max(0.0, deadline - loop.time()))
            self._deliver(out, started)
            self._flush_events()

    def _wall_seconds(self, modelled: float) -> float:
        state = self.faults.state
        scale = 0.0 if self.settings.instant else self.settings.time_scale
        return modelled * scale * state.slowdown + state.delay_ms / 1000

    def _deliver(self, out: StepOutput, started: float) -> None:
        """The tokens of a step that started at ``started`` and ends now: a first admission
        queued from its arrival to ``started`` and prefilled from ``started`` to now, as
        every request of the step did (``metrics.RequestTiming``)."""
        now = time.perf_counter()
        metrics = self.metrics
        handles = self._handles
        for req in out.admitted:
            read = 0 if req.loaded is None else req.loaded.tokens
            metrics.on_admitted(len(req.prompt), req.hit_tokens, read, req.num_cached_tokens)
            handle = handles.get(req)
            if handle is not None:
                computed = max(len(req.prompt) - req.num_cached_tokens, 0)
                handle.timing = RequestTiming(
                    max(started - handle.arrival, 0.0), now - started, computed
                )
                metrics.on_first_token(now - handle.arrival, handle.timing)
        for req in out.sampled:
            handle = handles.get(req)
            if handle is not None and handle.stream:
                handle.notify()
        for req in out.finished:
            if req.hold_kv:
                self._hold(req)
            handle = handles.pop(req, None)
            if handle is not None:
                metrics.on_finished(now - handle.arrival, len(req.output), handle.timing)
                handle.notify()

    def _hold(self, req: SimRequest) -> None:
        kv = self.core.kv
        blocks = kv.block_ids(req) if isinstance(kv, VllmKVCacheManager) else []
        self.transfers.hold(req, blocks)

    def _flush_events(self) -> None:
        events = self.core.kv.take_events()
        if events:
            self.publisher.publish(self.format.encode_batch(time.time(), events))
