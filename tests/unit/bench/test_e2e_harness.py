"""``bench.e2e.harness``: the contenders a run has, and the pinned reference's placement."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

from rich.console import Console

from bench.e2e.__main__ import QUICK
from bench.e2e.harness import PINNED, E2EBench, E2EConfig


def test_the_full_run_starts_with_the_pinned_reference_and_ci_leaves_it_out() -> None:
    assert E2EConfig().contenders()[0].router == PINNED
    assert all(c.router == "kvroute" for c in QUICK.contenders())


def test_the_pinned_reference_keeps_each_group_on_one_engine_and_spreads_them(
    tmp_path: Path,
) -> None:
    bench = E2EBench(E2EConfig(), tmp_path, Console())
    bench.engines = [f"http://127.0.0.1:{8000 + i}" for i in range(4)]
    url_of = bench._pinned()
    groups = E2EConfig().workload.request_groups()
    engines_of: dict[int, set[str]] = defaultdict(set)
    for index, group in enumerate(groups):
        engines_of[group].add(url_of(index))
    assert all(len(engines) == 1 for engines in engines_of.values())
    per_engine = defaultdict(int)
    for engines in engines_of.values():
        per_engine[engines.pop()] += 1
    assert sorted(per_engine.values()) == [4, 4, 4, 4]
