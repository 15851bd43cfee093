"""Figures measured by the micro benchmarks, and how they are printed against targets.

Times are wall-clock medians on one thread (HF ``tokenizers`` may use its own threads
inside a call). On a machine shared with other work they are noisy: run twice.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Figure:
    """One measured figure; ``target`` is an upper bound (``None``: reported only)."""

    name: str
    value: float
    unit: str
    target: float | None = None

    @property
    def verdict(self) -> str:
        if self.target is None:
            return ""
        return "ok" if self.value <= self.target else "MISSED"


def median_us(run: Callable[[], object], *, repeat: int, rounds: int = 5, warmup: int = 3) -> float:
    """Median wall time of ``run()`` in microseconds over ``repeat`` calls; the lowest
    such median of ``rounds`` rounds, so that a burst of other work does not count."""
    for _ in range(warmup):
        run()
    medians = []
    for _ in range(rounds):
        samples = []
        for _ in range(repeat):
            start = time.perf_counter_ns()
            run()
            samples.append((time.perf_counter_ns() - start) / 1000)
        medians.append(statistics.median(samples))
    return min(medians)


def median_us_each(runs: Iterable[Callable[[], object]]) -> float:
    """Median wall time in microseconds of calling each of ``runs`` once."""
    samples = []
    for run in runs:
        start = time.perf_counter_ns()
        run()
        samples.append((time.perf_counter_ns() - start) / 1000)
    return statistics.median(samples)


def render(figures: Iterable[Figure]) -> str:
    """A plain-text table: figure, value, target, verdict."""
    rows = [("figure", "value", "target", "")]
    for f in figures:
        target = "" if f.target is None else f"<= {f.target:g} {f.unit}"
        rows.append((f.name, f"{f.value:.4g} {f.unit}", target, f.verdict))
    widths = [max(len(row[i]) for row in rows) for i in range(4)]
    return "\n".join(
        "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) for row in rows
    )
