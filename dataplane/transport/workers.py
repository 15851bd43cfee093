"""Worker supervision: N forked processes serving one port, one ready line for all.

Each worker binds the port itself with ``SO_REUSEPORT`` (the kernel spreads connections
over them) and writes one byte on a pipe once it serves (another if it ends before);
the parent prints the ready line when every worker serves, forwards SIGTERM/SIGINT to
them, and reaps them. A worker that fails (ends other than by a signal the parent
sent) stops the rest and the parent exits 1, so the process supervisor restarts the
whole proxy rather than run it short; one that fails before it serves ends the wait
for the ready line too.
The workers find each other (for one ``/metrics``, :mod:`.worker_metrics`) in a
directory the parent makes and removes after them.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import tempfile
from collections.abc import Callable

from dataplane.transport.worker_metrics import WorkerGroup

log = logging.getLogger("dataplane")

# runs one worker of the group until it is stopped, calling the second argument once it
# serves
Worker = Callable[[WorkerGroup, Callable[[], object]], None]

# a worker stopped by SIGTERM/SIGINT ends with status 0 (or by the signal, if it came
# before the worker's handlers were installed)
_STOPPED = frozenset({0, -signal.SIGTERM, -signal.SIGINT})


def supervise(count: int, worker: Worker, placeholder: socket.socket, ready_line: str) -> int:
    """Fork ``count`` workers, close ``placeholder`` (the socket that held the port until
    they bind it) and print ``ready_line`` once all serve, wait for them all; 0 when they
    were stopped, 1 when one failed."""
    read_end, write_end = os.pipe()
    with tempfile.TemporaryDirectory(prefix="kvroute-proxy-") as directory:
        groups = [WorkerGroup(directory, i, count) for i in range(count)]
        children = [_fork(worker, group, write_end, read_end) for group in groups]
        os.close(write_end)
        stop = _forward_signals(children)
        ready = b""
        while len(ready) < count:
            piece = os.read(read_end, count)
            if not piece:
                break
            ready += piece
        os.close(read_end)
        placeholder.close()
        if ready == b"1" * count and not stop:
            print(ready_line, flush=True)
        return _wait(children)


def _fork(worker: Worker, group: WorkerGroup, write_end: int, read_end: int) -> int:
    """The worker in a child process; it writes ``1`` on the pipe once it serves, or
    ``0`` if it ends before, so the parent never waits for a worker that is gone."""
    pid = os.fork()
    if pid:
        return pid
    os.close(read_end)
    ready: list[bool] = []

    def on_ready() -> None:
        ready.append(True)
        os.write(write_end, b"1")

    status = 0
    try:
        worker(group, on_ready)
    except BaseException as exc:
        if not isinstance(exc, KeyboardInterrupt | SystemExit):
            log.exception("worker failed")
            status = 1
    if not ready:
        os.write(write_end, b"0")
    os._exit(status)


def _forward_signals(children: list[int]) -> list[int]:
    stopped: list[int] = []

    def forward(signum: int, frame: object) -> None:
        stopped.append(signum)
        for pid in children:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    return stopped


def _wait(children: list[int]) -> int:
    """Reap the workers; one that fails (not stopped by a signal we sent) stops the rest."""
    status = 0
    remaining = set(children)
    while remaining:
        try:
            pid, code = os.wait()
        except ChildProcessError:
            break
        remaining.discard(pid)
        if os.waitstatus_to_exitcode(code) in _STOPPED:
            continue
        status = 1  # a worker died: stop the rest, let the supervisor restart us
        for other in remaining:
            with contextlib.suppress(ProcessLookupError):
                os.kill(other, signal.SIGTERM)
    return status
