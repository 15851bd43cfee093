"""``kvroute bench proxy``'s routing-decision figures: which carry the issue's targets."""

from __future__ import annotations

import pytest

from bench.proxy import (
    DECISION_P50_MS,
    DECISION_P99_MS,
    HF_OVER_TAIL_MS,
    _decision_figures,
    _tail_figures,
    decision,
)
from kvcore.tokenize import BuiltinTokenizer


def test_builtin_decisions_are_held_to_the_absolute_targets() -> None:
    figures = decision(BuiltinTokenizer(), "builtin", "builtin", count=4)
    assert [f.target for f in figures] == [DECISION_P50_MS, None, DECISION_P99_MS, None]
    assert "(p99 of 4)" in figures[2].name
    assert all(f.value > 0 for f in figures)


def test_hf_decisions_are_held_to_their_tail_encode_only() -> None:
    walls, cpus = [1.0, 1.2, 1.4], [0.9, 1.1, 1.3]
    own = _decision_figures("HF BPE", 8000, walls, cpus)
    assert [f.target for f in own] == [None, None, None, None]
    assert all("no target of its own" in f.name for f in (own[0], own[2]))
    before = [(0.8, 0.7), (0.9, 0.85), (1.0, 0.95)]
    after = [(0.7, 0.7), (0.8, 0.8), (0.9, 0.9)]
    tight = [0.6, 0.7, 0.75]
    tail, over, over_cpu, warm, other, above = _tail_figures(
        "HF BPE", (1.2, 1.1), before, after, tight
    )
    assert (tail.value, tail.target) == (0.9, None)
    assert over.value == pytest.approx(0.3) and over.target == HF_OVER_TAIL_MS
    assert over.verdict == "ok"
    assert over_cpu.value == pytest.approx(1.1 - 0.85) and over_cpu.target is None
    assert (warm.value, warm.target) == (0.8, None)
    assert (other.value, other.target) == (0.7, None)
    assert above.value == pytest.approx(0.5) and above.target is None
