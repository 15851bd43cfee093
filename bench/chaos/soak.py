"""The soak: the fleet under a steady load for a long while, its processes watched.

Every ``sample_s`` each child of the fleet (with whatever it started: a proxy's workers
share its process group) is read from ``/proc``: resident memory (``VmRSS``, summed
over the group) and open file descriptors. Every few samples the residency is checked
key for key against the engines (:mod:`bench.chaos.residency`).

Targets (issue 42): every process's RSS flat within 10% (the median of the last three
samples against the median of the first three after the warm-up), the residency never
above the engines' caches (no *extra* key in any check), no file-descriptor growth (the
last three samples' fewest no higher than the first three's). Fewest, not most: an
engine's or a proxy's count goes up and down by the connections open at the instant
(the checker's own reads of each engine every third sample, the load's requests: 29 to
36 and back to 29 on an engine), so the peaks of two windows differ by chance; what
leaks raises the floor.
"""

from __future__ import annotations

import asyncio
import os
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

RSS_TARGET = 0.10
EDGE = 3  # samples at each end compared


@dataclass(frozen=True)
class ProcessSample:
    rss_kib: int
    fds: int


def group_sample(pgid: int, proc: Path = Path("/proc")) -> ProcessSample:
    """RSS (KiB) and open fds summed over the processes of process group ``pgid``."""
    rss = fds = 0
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            if int(stat.rsplit(")", 1)[1].split()[2]) != pgid:  # field 5: pgrp
                continue
            rss += _vm_rss_kib((entry / "status").read_text())
            fds += len(os.listdir(entry / "fd"))
        except (OSError, ValueError, IndexError):
            continue  # gone meanwhile, or not ours to read
    return ProcessSample(rss, fds)


def _vm_rss_kib(status: str) -> int:
    for line in status.splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


@dataclass
class ProcessTrend:
    name: str
    samples: list[tuple[float, ProcessSample]] = field(default_factory=list)

    def _edges(self, attr: str) -> tuple[list[int], list[int]]:
        values = [getattr(s, attr) for _, s in self.samples]
        return values[:EDGE], values[-EDGE:]

    @property
    def rss_change(self) -> float | None:
        first, last = self._edges("rss_kib")
        if not first or statistics.median(first) == 0:
            return None
        return statistics.median(last) / statistics.median(first) - 1.0

    @property
    def fd_growth(self) -> int:
        """Open files gained: the floor of the last samples over the first's."""
        first, last = self._edges("fds")
        return min(last) - min(first) if first else 0

    def summary(self) -> dict[str, Any]:
        change = self.rss_change
        first, last = self._edges("rss_kib")
        return {
            "process": self.name,
            "rss_first_mib": round(statistics.median(first) / 1024, 1) if first else None,
            "rss_last_mib": round(statistics.median(last) / 1024, 1) if last else None,
            "rss_change": None if change is None else round(change, 4),
            "fd_growth": self.fd_growth,
            "fds_last": max(self._edges("fds")[1], default=0),
            "met": change is not None and abs(change) <= RSS_TARGET and self.fd_growth <= 0,
        }


def sample_children(children: dict[str, int], trends: dict[str, ProcessTrend], at: float) -> None:
    """One sample of each child (name -> its process group id)."""
    for name, pgid in children.items():
        trends.setdefault(name, ProcessTrend(name)).samples.append((at, group_sample(pgid)))


async def sample_children_async(
    children: dict[str, int], trends: dict[str, ProcessTrend], at: float
) -> None:
    """:func:`sample_children` in a thread: reading /proc is file I/O."""
    await asyncio.to_thread(sample_children, children, trends, at)


def now() -> float:
    return time.perf_counter()
