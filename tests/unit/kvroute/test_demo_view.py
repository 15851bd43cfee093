"""The demo's phase view: a live table on a terminal; plain lines anywhere else (a pipe,
a log file), where a redrawn table would leave every frame behind, run together."""

from __future__ import annotations

import io
from typing import Any

from rich.console import Console

from kvroute.demo import EngineWatch, PhaseResult, PhaseView
from sidecar.load_metrics import EngineLoad

ENGINES = ["http://127.0.0.1:1", "http://127.0.0.1:2"]


def _watch() -> EngineWatch:
    watch = EngineWatch(session=Any, engines=ENGINES)  # type: ignore[arg-type]  # never scrapes
    watch.latest = {
        ENGINES[0]: EngineLoad(
            running=2, waiting=1, prefix_cache_queries=200, prefix_cache_hits=150
        ),
        ENGINES[1]: EngineLoad(running=1),
    }
    return watch


def _run_view(console: Console, shows: int) -> None:
    result = PhaseResult("kv_aware", ttft_s=[0.05, 0.07, 0.2])
    with PhaseView(console, "kv_aware", total=256) as view:
        for _ in range(3):
            view.advance()
        for index in range(shows):
            view.show(result, _watch(), {}, last=index == shows - 1)


def test_without_a_terminal_the_phase_is_plain_lines() -> None:
    out = io.StringIO()
    _run_view(Console(file=out, force_terminal=False, width=80), shows=10)
    lines = out.getvalue().splitlines()
    assert len(lines) == 2  # the first show, then the last: not one line per refresh
    assert (
        lines[0]
        == lines[1]
        == (
            "    kv_aware 3/256 | r0 3 in flight, hit 75%; r1 1 in flight, hit - | "
            "TTFT p50 70 ms, p90 200 ms over 3 requests (client clock)"
        )
    )
    assert "\x1b" not in out.getvalue()  # no cursor movement, no colour


def test_on_a_terminal_the_phase_is_a_live_table() -> None:
    out = io.StringIO()
    _run_view(Console(file=out, force_terminal=True, width=80), shows=3)
    text = out.getvalue()
    assert "\x1b[" in text and "phase: kv_aware" in text and "3/256" in text
