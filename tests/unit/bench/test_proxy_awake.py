"""``bench.proxy --awake``: the routers' CPU kept from idling in every other latency
round, by busy loops that any router preempts and that never outlive the benchmark."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from bench.cpu_limit import CpuLimitUnavailable, Wakefulness, idle_facts


@contextmanager
def _loops(at_most_s: float) -> Iterator[Wakefulness]:
    try:
        with Wakefulness(frozenset({min(os.sched_getaffinity(0))}), at_most_s=at_most_s) as loops:
            yield loops
    except CpuLimitUnavailable as exc:
        pytest.skip(f"no cgroup can be made on this machine: {exc}")


def _state(pid: int) -> str:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


def test_a_lowest_priority_busy_loop_per_cpu_runs_only_while_kept_awake() -> None:
    with _loops(60) as loops:
        (pid,) = loops.pids
        assert os.sched_getaffinity(pid) == {min(os.sched_getaffinity(0))}
        assert (loops.group.path / "cpu.idle").read_text().strip() == "1"
        assert str(pid) in (loops.group.path / "cgroup.procs").read_text().split()
        assert os.sched_getscheduler(pid) == os.SCHED_IDLE  # any task preempts it
        assert _state(pid) == "T"  # stopped: the CPU may idle
        loops.keep_awake()
        assert _state(pid) == "R"  # running: the CPU does not idle
        loops.let_idle()
        assert _state(pid) == "T"
        loops.keep_awake()
    assert not Path(f"/proc/{pid}").exists()  # killed and reaped
    assert not loops.group.path.exists()  # and its cgroup removed


def test_a_busy_loop_ends_by_itself_when_nobody_stops_it() -> None:
    with _loops(0) as loops:
        (pid,) = loops.pids
        loops.keep_awake()  # (it has ended: nothing to continue, and no wait)
    assert not Path(f"/proc/{pid}").exists()


def test_the_machine_says_how_its_cpus_idle() -> None:
    assert idle_facts().startswith("cpuidle: ")
