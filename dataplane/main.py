"""Entry point of ``kvroute-proxy``: flags -> settings -> N serving processes.

A bad flag or value is refused before anything binds, with one line on stderr and exit
status 2. ``--workers N`` forks N processes that each bind the same port with
``SO_REUSEPORT`` (the kernel spreads connections over them) and each keep their own
routing state stream; the parent prints one ready line when all of them serve and
stops them on SIGTERM/SIGINT.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import socket
import sys
from collections.abc import Callable, Sequence
from typing import Any

from pydantic import ValidationError

from dataplane import native
from dataplane.service import ProxyService
from dataplane.settings import ProxySettings
from dataplane.transport.server import HttpServer
from dataplane.transport.worker_metrics import WorkerGroup
from dataplane.transport.workers import supervise
from kvruntime.flags import flag_name, flags_given, settings_parser
from kvruntime.gc_tuning import tune_gc
from kvruntime.jsonlog import configure_logging
from kvruntime.lifecycle import signalled
from kvruntime.loop import run
from kvruntime.sockets import bind_tcp, url_of

log = logging.getLogger("dataplane")
READY_PREFIX = "kvroute-proxy ready"

PROG = "kvroute-proxy"


class SettingsRefused(Exception):
    """A flag or environment value that cannot start a proxy (one line, exit 2)."""


def build_parser() -> argparse.ArgumentParser:
    return settings_parser(
        ProxySettings,
        prog=PROG,
        description="kvroute's OpenAI-compatible data-plane proxy: scores replicas locally "
        "and streams their answers back.",
        refuse=SettingsRefused,
    )


def load_settings(argv: Sequence[str] | None) -> ProxySettings:
    """Flags over environment over defaults; ``SettingsRefused`` with one clear line."""
    given = flags_given(build_parser(), argv)
    try:
        return ProxySettings(**given)
    except ValidationError as exc:
        raise SettingsRefused(describe(exc)) from None


def describe(exc: ValidationError) -> str:
    """A validation error as one line: ``--flag: problem (got value)`` per field."""
    parts = []
    for err in exc.errors():
        message = err["msg"].removeprefix("Value error, ")
        if err["loc"]:
            message = f"{flag_name(str(err['loc'][0]))}: {message} (got {err.get('input')!r})"
        parts.append(message)
    return "; ".join(parts)


def bind(host: str, port: int, *, reuse_port: bool) -> socket.socket:
    """A listening-ready TCP socket (``SO_REUSEPORT`` for workers sharing a port)."""
    try:
        return bind_tcp(host, port, reuse_port=reuse_port)
    except OSError as exc:
        raise SettingsRefused(f"cannot bind {host}:{port}: {exc.strerror}") from None


def ready_line(sock: socket.socket) -> str:
    """The line that says the proxy serves: its URL, and how many of its request-path
    modules run compiled (:mod:`dataplane.native`; ``compiled=0/N``: all from source)."""
    compiled = f"{len(native.compiled())}/{len(native.MODULES)}"
    return f"{READY_PREFIX} http={url_of(sock)} compiled={compiled}"


async def serve(
    settings: ProxySettings, sock: socket.socket, on_ready: Any, group: WorkerGroup | None = None
) -> None:
    """One worker (of ``group``, if several): build the service, serve ``sock`` until
    SIGTERM/SIGINT."""
    service = ProxyService(settings, group=group)
    await service.start()
    sock.listen(4096)
    server = HttpServer(
        service.app,
        max_body_bytes=settings.max_body_bytes,
        keep_alive_s=settings.keep_alive_s,
        header_timeout_s=settings.header_timeout_s,
        max_connections=settings.max_connections,
        single_headers=service.app.single_headers,
    )
    metrics = HttpServer(
        service.app.serve_metrics, max_body_bytes=4096, header_timeout_s=settings.header_timeout_s
    )
    stop = signalled()
    try:
        await server.start(sock)
        if settings.metrics_port is not None:  # every worker on it: any answers for all
            metrics_sock = bind(settings.host, settings.metrics_port, reuse_port=True)
            metrics_sock.listen(64)
            await metrics.start(metrics_sock)
        on_ready()
        await stop.wait()
    finally:
        await metrics.aclose(0)
        await server.aclose(settings.shutdown_grace_s)
        await service.aclose()
        sock.close()


def run_worker(
    settings: ProxySettings, sock: socket.socket, on_ready: Any, group: WorkerGroup | None = None
) -> None:
    tune_gc()  # fewer young collections on the hot path
    run(serve(settings, sock, on_ready, group))


def run_workers(settings: ProxySettings) -> int:
    """``settings.workers`` processes on one port (:func:`transport.workers.supervise`);
    the port is held bound until they all serve, so a port of 0 is chosen once."""
    placeholder = bind(settings.host, settings.port, reuse_port=True)
    port = placeholder.getsockname()[1]

    def worker(group: WorkerGroup, on_ready: Callable[[], object]) -> None:
        sock = bind(settings.host, port, reuse_port=True)
        run_worker(settings.for_worker(group.index), sock, on_ready, group)

    return supervise(settings.workers, worker, placeholder, ready_line(placeholder))


def main(argv: Sequence[str] | None = None) -> int:
    try:
        settings = load_settings(argv)
        configure_logging(settings.log_level)
        if settings.workers > 1:
            return run_workers(settings)
        sock = bind(settings.host, settings.port, reuse_port=False)
    except SettingsRefused as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        return 2
    line = ready_line(sock)
    with contextlib.suppress(KeyboardInterrupt):
        run_worker(settings, sock, lambda: print(line, flush=True))
    return 0


if __name__ == "__main__":  # ``python -m dataplane.main``, as the ``kvroute-proxy`` script
    sys.exit(main())
