"""How a kvroute server process lives: settings in, logging and the collector set up, a
service started, one ready line printed, SIGTERM or SIGINT awaited, the service closed.

:func:`serve_until_signalled` is the body of a component's ``serve`` and
:func:`main_of` its ``main`` (``kvroute-controlplane``, ``kvroute-epp``);
:func:`signalled` is the one event every server stops on (the proxy's workers use it
alone; the sidecar, whose service waits on it itself, with :func:`main_of`).
"""

from __future__ import annotations

import asyncio
import signal
import sys
from collections.abc import Awaitable, Callable, Coroutine, Mapping
from typing import Any, Protocol, TypeVar

from kvruntime.gc_tuning import tune_gc
from kvruntime.jsonlog import configure_logging
from kvruntime.loop import run


class Logged(Protocol):
    @property
    def log_level(self) -> str: ...


S = TypeVar("S", bound=Logged)


def signalled() -> asyncio.Event:
    """An event SIGTERM or SIGINT sets (handlers on the running loop)."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    return stop


async def serve_until_signalled(
    start: Callable[[], Awaitable[object]],
    ready_line: Callable[[], str],
    aclose: Callable[[], Awaitable[object]],
    on_signal: Callable[[], Awaitable[object]] | None = None,
) -> None:
    """``start``, print the ready line, wait for SIGTERM or SIGINT (then ``on_signal``:
    what must happen before closing, such as readiness off), ``aclose``: also when
    starting failed."""
    stop = signalled()
    try:
        await start()
        print(ready_line(), flush=True)
        await stop.wait()
        if on_signal is not None:
            await on_signal()
    finally:
        await aclose()


def main_of(
    prog: str,
    load_settings: Callable[[], S],
    refused: type[Exception],
    serve: Callable[[S], Coroutine[Any, Any, None]],
    failures: Mapping[type[Exception], int],
) -> int:
    """A server's ``main``: its settings (``refused``: one line on stderr, exit 2), JSON
    logs at their level, the collector tuned, ``serve`` run until it returns (exit 0; an
    interrupt too); one of ``failures`` ends it with one line and that status."""
    try:
        settings = load_settings()
    except refused as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        return 2
    configure_logging(settings.log_level)
    tune_gc()
    try:
        run(serve(settings))
    except KeyboardInterrupt:
        return 0
    except tuple(failures) as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        return next(status for kind, status in failures.items() if isinstance(exc, kind))
    return 0
