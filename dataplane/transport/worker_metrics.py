"""One ``/metrics`` for a proxy of several workers (``--workers N``).

The workers share one port (``SO_REUSEPORT``), so a scrape reaches whichever worker the
kernel picks, and each keeps its own metrics. Answered from that worker's alone, a
counter would read one worker's count on one scrape and another's on the next: to
Prometheus a reset each time, and ``requests_in_flight`` (the autoscaler's metric) a
fraction of the truth. So the worker that takes a scrape asks its siblings for theirs
and answers with the whole proxy, named and labelled exactly as one worker's would be.

Each worker answers on a Unix socket of its own (``worker-<i>.sock`` in a directory the
parent makes before forking and removes after) with its samples, msgpack-encoded; the
scraped worker merges them with its own:

- counters and histograms (``_total``, ``_bucket``, ``_count``, ``_sum``) add up;
- ``_created`` times take the earliest;
- ``requests_in_flight`` adds up (each worker counts only its own requests); the other
  gauges take the largest (``state_age_seconds``: the stalest worker's state;
  ``circuit_open_replicas`` and ``tokenizer_mismatch``: each worker judges the same
  replicas and models for itself).

A sibling that does not answer within :data:`SCRAPE_TIMEOUT_S` makes the scrape a 503:
a missed scrape is a gap to Prometheus, a partial sum would be a false reset.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import msgspec
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import Metric
from prometheus_client.registry import Collector

from dataplane.http_errors import ServiceUnavailable
from dataplane.metrics import PREFIX

log = logging.getLogger("dataplane")
SCRAPE_TIMEOUT_S = 2.0
SUMMED_GAUGES = frozenset({PREFIX + "requests_in_flight"})

# one family: name, documentation, type, samples (sample name, labels, value)
Sample = tuple[str, dict[str, str], float]
Family = tuple[str, str, str, list[Sample]]


@dataclass(frozen=True)
class WorkerGroup:
    """Where the workers of one proxy find each other, and which one this is."""

    directory: str
    index: int
    count: int

    def socket_path(self, index: int) -> str:
        return os.path.join(self.directory, f"worker-{index}.sock")


def families(registry: CollectorRegistry) -> list[Family]:
    """The registry's samples as plain values (what a sibling sends)."""
    return [
        (f.name, f.documentation, f.type, [(s.name, s.labels, s.value) for s in f.samples])
        for f in registry.collect()
    ]


def merge(workers: Iterable[list[Family]]) -> list[Family]:
    """The workers' families as one proxy's (the rules above); the first worker's order,
    then families and samples only later workers have."""
    merged: dict[str, tuple[str, str, dict[tuple[str, tuple[tuple[str, str], ...]], Sample]]] = {}
    for worker in workers:
        for name, documentation, kind, samples in worker:
            rows = merged.setdefault(name, (documentation, kind, {}))[2]
            for sample_name, labels, value in samples:
                key = (sample_name, tuple(labels.items()))
                known = rows.get(key)
                if known is not None:
                    value = _combine(name, kind, sample_name, known[2], value)
                rows[key] = (sample_name, labels, value)
    return [(name, doc, kind, list(rows.values())) for name, (doc, kind, rows) in merged.items()]


def _combine(family: str, kind: str, sample: str, a: float, b: float) -> float:
    if sample.endswith("_created"):
        return min(a, b)
    if kind == "gauge" and family not in SUMMED_GAUGES:
        return max(a, b)
    return a + b


def render(merged: list[Family]) -> bytes:
    """The exposition text of merged families, as ``generate_latest`` writes one worker's."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Families(merged))
    return generate_latest(registry)


class _Families(Collector):
    def __init__(self, merged: list[Family]) -> None:
        self._merged = merged

    def collect(self) -> Iterator[Metric]:
        for name, documentation, kind, samples in self._merged:
            metric = Metric(name, documentation, kind)
            for sample_name, labels, value in samples:
                metric.add_sample(sample_name, labels, value)
            yield metric


class Siblings:
    """This worker's side of the group: answers its siblings, and gathers theirs."""

    def __init__(self, group: WorkerGroup, registry: CollectorRegistry) -> None:
        self.group = group
        self._registry = registry
        self._server: asyncio.AbstractServer | None = None
        self._decoder = msgspec.msgpack.Decoder(list[tuple[str, str, str, list[Sample]]])

    async def start(self) -> None:
        path = self.group.socket_path(self.group.index)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        self._server = await asyncio.start_unix_server(self._answer, path=path)

    async def aclose(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

    async def _answer(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            writer.write(msgspec.msgpack.encode(families(self._registry)))
            await writer.drain()
        except ConnectionError:
            pass
        finally:
            writer.close()

    async def render(self) -> bytes:
        """The whole proxy's metrics; :class:`ServiceUnavailable` if a sibling is silent."""
        others = [i for i in range(self.group.count) if i != self.group.index]
        answers = await asyncio.gather(*(self._ask(i) for i in others), return_exceptions=True)
        workers = [families(self._registry)]
        for index, answer in zip(others, answers, strict=True):
            if isinstance(answer, BaseException):
                log.warning("worker %d did not give its metrics: %r", index, answer)
                raise ServiceUnavailable(
                    f"worker {index} of {self.group.count} did not give its metrics"
                )
            workers.append(answer)
        return render(merge(workers))

    async def _ask(self, index: int) -> list[Family]:
        async with asyncio.timeout(SCRAPE_TIMEOUT_S):
            reader, writer = await asyncio.open_unix_connection(self.group.socket_path(index))
            try:
                data = await reader.read()
            finally:
                writer.close()
        return self._decoder.decode(data)
