"""This proxy's fidelity counters, sent to the control plane over ``RoutingState.Report``.

The control plane rolls measured hit rates and alerts up from what proxies report (they
hold no NATS credentials), so every proxy counts, per workload and replica: requests,
prompt tokens, the cached tokens the router predicted, the cached tokens the engine
reported (and how many responses reported them), and errors. Every interval the
counters become one :class:`~kvcore.pb.routing_pb2.ProxyReport` (with the models'
health, such as ``tokenizer_mismatch``, and the prefill rates it has learned per replica,
for ``/v1/replicas``) queued for sending.

Routing must never wait on this: :meth:`Reporter.record` only adds to a dict, and
sending runs in its own task. Reports not yet acknowledged stay queued; the queue is
bounded (``max_pending``) by merging its two oldest reports, so when the control plane
is away for long the counters are all kept, at a coarser time resolution. A report's hot
prefixes (warm-up, :mod:`dataplane.hot_prefixes`) also go, alone, to the other
``--controlplane`` addresses: the leader warms replicas, whichever instance it is. Each flush is
one short client stream (write the queued reports, close, read the ``ReportAck``), so a
report counts as delivered only once the control plane says it read it; a failure moves
to the next ``--controlplane`` address for the next flush.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections import deque
from collections.abc import Callable, Iterable
from typing import Any

import grpc

from dataplane.settings import ProxySettings
from dataplane.state_client import CHANNEL_OPTIONS, channel_credentials
from kvcore.pb import routing_pb2
from kvruntime.tasks import BackgroundTasks

log = logging.getLogger("dataplane.report")

REPORT_METHOD = "/kvroute.v1.RoutingState/Report"
RowKey = tuple[str, str, str]  # workload, pool, replica id
# requests, prompt tokens, predicted cached, measured cached, measured requests, errors
COUNTERS = (
    "requests",
    "prompt_tokens",
    "predicted_cached_tokens",
    "measured_cached_tokens",
    "measured_requests",
    "errors",
)
HealthSource = Callable[[], Iterable[routing_pb2.ModelHealth]]
HotSource = Callable[[], Iterable[routing_pb2.HotPrefix]]
RatesSource = Callable[[], Iterable[routing_pb2.LearnedRate]]


class Reporter:
    """Counts per (workload, pool, replica) and reports every ``report_interval_s``."""

    def __init__(
        self,
        settings: ProxySettings,
        *,
        health: HealthSource = lambda: (),
        hot: HotSource = lambda: (),
        rates: RatesSource = lambda: (),
        max_pending: int = 60,
        send_timeout_s: float = 5.0,
        rng: random.Random | None = None,
        credentials: grpc.ChannelCredentials | None = None,
    ) -> None:
        if not settings.controlplane:
            raise ValueError("Reporter needs --controlplane addresses")
        self._addresses = list(settings.controlplane)
        self._next = (rng or random.Random()).randrange(len(self._addresses))
        self._proxy_id = settings.resolved_proxy_id()
        self._interval_s = settings.report_interval_s
        self._credentials = credentials or channel_credentials(settings)
        self._health = health
        self._hot = hot
        self._rates = rates
        self._max_pending = max(2, max_pending)
        self._send_timeout_s = send_timeout_s
        self._counters: dict[RowKey, list[int]] = {}
        self._since = time.time()
        self.pending: deque[routing_pb2.ProxyReport] = deque()
        self.sent = 0
        self.failures = 0
        self.last_error = ""
        self._tasks = BackgroundTasks()

    def record(
        self,
        workload: str,
        pool: str,
        replica_id: str,
        prompt_tokens: int,
        predicted_cached: int,
        measured_cached: int | None,
        error: bool,
    ) -> None:
        """Count one finished request (``measured_cached``: ``None`` when the response
        did not report cached tokens; an ``error`` carries no tokens)."""
        row = self._counters.get((workload, pool, replica_id))
        if row is None:
            row = self._counters[(workload, pool, replica_id)] = [0, 0, 0, 0, 0, 0]
        row[0] += 1
        row[1] += prompt_tokens
        row[2] += predicted_cached
        if measured_cached is not None:
            row[3] += measured_cached
            row[4] += 1
        if error:
            row[5] += 1

    # -- lifecycle ------------------------------------------------------------------

    async def start(self) -> None:
        if not self._tasks.running:
            self._tasks.spawn(self._run(), name="proxy-report")

    async def aclose(self) -> None:
        """Stop, after one last attempt (bounded by the send timeout) to deliver."""
        await self._tasks.aclose()
        self.close_interval()
        await self.flush()

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self._interval_s)  # the report period, not a readiness wait
            self.close_interval()
            await self.flush()

    # -- building and sending reports ---------------------------------------------------

    def close_interval(self, now: float | None = None) -> None:
        """Turn the counters since the last interval into a queued report."""
        now = time.time() if now is None else now
        counters, self._counters = self._counters, {}
        models = list(self._health())
        hot = list(self._hot())
        rates = list(self._rates())
        interval, self._since = now - self._since, now
        if not counters and not models and not hot and not rates:
            return
        report = routing_pb2.ProxyReport(
            proxy_id=self._proxy_id, ts=now, interval_s=interval, models=models, hot_prefixes=hot
        )
        report.learned_rates.extend(rates)
        report.rows.extend(_row(key, values) for key, values in counters.items())
        self.pending.append(report)
        while len(self.pending) > self._max_pending:
            oldest = self.pending.popleft()
            self.pending[0] = merge_reports(oldest, self.pending[0])

    async def flush(self) -> None:
        """Send the queued reports in one stream; keep whatever was not acknowledged."""
        if not self.pending:
            return
        address = self._addresses[self._next]
        batch = list(self.pending)
        try:
            async with asyncio.timeout(self._send_timeout_s):
                acked = await self._send(address, batch)
        except (grpc.aio.AioRpcError, TimeoutError) as exc:
            self._failed(address, exc)
            return
        for _ in range(min(acked, len(batch))):
            self.pending.popleft()
        self.sent += min(acked, len(batch))
        await self._share_hot(address, batch)

    async def _share_hot(self, sent_to: str, batch: list[routing_pb2.ProxyReport]) -> None:
        """The latest hot prefixes to the other control planes too (best effort: one try
        each, within the send timeout): only the leader warms replicas, and this proxy's
        reports reach one instance at a time."""
        hot = next((r.hot_prefixes for r in reversed(batch) if r.hot_prefixes), None)
        if hot is None or len(self._addresses) < 2:
            return
        copy = routing_pb2.ProxyReport(proxy_id=self._proxy_id, ts=batch[-1].ts, hot_prefixes=hot)
        for address in self._addresses:
            if address != sent_to:
                with contextlib.suppress(grpc.aio.AioRpcError, TimeoutError):
                    async with asyncio.timeout(self._send_timeout_s):
                        await self._send(address, [copy])

    async def _send(self, address: str, batch: list[routing_pb2.ProxyReport]) -> int:
        async with self._channel(address) as channel:
            report = channel.stream_unary(
                REPORT_METHOD,
                request_serializer=routing_pb2.ProxyReport.SerializeToString,
                response_deserializer=routing_pb2.ReportAck.FromString,
            )
            ack: routing_pb2.ReportAck = await report(iter(batch))
            return int(ack.reports)

    def _channel(self, address: str) -> grpc.aio.Channel:
        if self._credentials is None:
            return grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)
        return grpc.aio.secure_channel(address, self._credentials, options=CHANNEL_OPTIONS)

    def _failed(self, address: str, exc: BaseException) -> None:
        self.failures += 1
        self._next = (self._next + 1) % len(self._addresses)
        if isinstance(exc, grpc.aio.AioRpcError):
            self.last_error = f"{address}: {exc.code().name} {exc.details() or ''}".strip()
        else:
            self.last_error = f"{address}: no acknowledgement within {self._send_timeout_s} s"
        log.warning(
            "proxy report not delivered (%d queued): %s", len(self.pending), self.last_error
        )

    def status(self) -> dict[str, Any]:
        return {"queued": len(self.pending), "sent": self.sent, "last_error": self.last_error}


def _row(key: RowKey, values: list[int]) -> routing_pb2.ReportRow:
    workload, pool, replica_id = key
    counters = routing_pb2.UsageCounters(**dict(zip(COUNTERS, values, strict=True)))
    return routing_pb2.ReportRow(
        workload=workload, pool=pool, replica_id=replica_id, counters=counters
    )


def merge_reports(
    older: routing_pb2.ProxyReport, newer: routing_pb2.ProxyReport
) -> routing_pb2.ProxyReport:
    """One report covering both intervals: counters summed per row, the newer health,
    hot prefixes and learned rates."""
    sums: dict[RowKey, list[int]] = {}
    for row in (*older.rows, *newer.rows):
        values = sums.setdefault((row.workload, row.pool, row.replica_id), [0] * len(COUNTERS))
        for i, name in enumerate(COUNTERS):
            values[i] += getattr(row.counters, name)
    merged = routing_pb2.ProxyReport(
        proxy_id=newer.proxy_id,
        ts=newer.ts,
        interval_s=older.interval_s + newer.interval_s,
        models=list(newer.models),
        hot_prefixes=list(newer.hot_prefixes),
    )
    merged.learned_rates.extend(newer.learned_rates)
    merged.rows.extend(_row(key, values) for key, values in sums.items())
    return merged
