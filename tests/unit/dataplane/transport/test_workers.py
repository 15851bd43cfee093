"""Worker supervision with real forked processes: one ready line once all serve, and a
worker that fails stops the others and makes the proxy exit 1 (so it is restarted)."""

from __future__ import annotations

import os
import signal
import socket
from collections.abc import Callable, Iterator

import pytest

from dataplane.transport.worker_metrics import WorkerGroup
from dataplane.transport.workers import supervise


@pytest.fixture(autouse=True)
def own_signal_handlers() -> Iterator[None]:
    """``supervise`` installs the parent's SIGTERM/SIGINT forwarding: give pytest its own back."""
    before = {
        signum: signal.getsignal(signum)
        for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGALRM)
    }
    yield
    for signum, handler in before.items():
        signal.signal(signum, handler)


def placeholder() -> socket.socket:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    return sock


def serves_until_stopped(group: WorkerGroup, on_ready: Callable[[], object]) -> None:
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    on_ready()
    # stopped by the parent's SIGTERM, as a worker is (bounded: a broken parent never sends)
    signal.sigtimedwait({signal.SIGTERM}, 10)


def test_every_worker_ready_prints_the_line_once(capfd: pytest.CaptureFixture[str]) -> None:
    def ready_and_done(group: WorkerGroup, on_ready: Callable[[], object]) -> None:
        on_ready()

    held = placeholder()
    assert supervise(3, ready_and_done, held, "kvroute-proxy ready") == 0
    assert capfd.readouterr().out == "kvroute-proxy ready\n"
    assert held.fileno() == -1  # the port is left to the workers


def test_a_failed_worker_stops_the_others_and_the_exit_is_1(
    capfd: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    def first_fails(group: WorkerGroup, on_ready: Callable[[], object]) -> None:
        if group.index == 0:
            raise RuntimeError("cannot bind")
        serves_until_stopped(group, on_ready)

    def took_too_long(signum: int, frame: object) -> None:
        raise TimeoutError("the parent still waits for a worker that failed")

    forked: list[int] = []
    real_fork = os.fork

    def recording_fork() -> int:
        pid = real_fork()
        if pid:
            forked.append(pid)
        return pid

    monkeypatch.setattr(os, "fork", recording_fork)
    signal.signal(signal.SIGALRM, took_too_long)
    signal.alarm(5)
    try:
        assert supervise(2, first_fails, placeholder(), "kvroute-proxy ready") == 1
    finally:
        signal.alarm(0)
    assert "kvroute-proxy ready" not in capfd.readouterr().out
    assert len(forked) == 2
    for pid in forked:  # every worker reaped (not os.wait(): the suite's servers are children too)
        with pytest.raises(ChildProcessError):
            os.waitpid(pid, os.WNOHANG)
