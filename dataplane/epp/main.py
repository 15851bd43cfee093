"""Entry point of ``kvroute-epp``: flags -> settings -> one picker process.

A bad flag or value is refused before anything binds, with one line on stderr and exit
status 2 (as ``kvroute-proxy``). When the three ports serve, one line says where:
``kvroute-epp ready grpc=HOST:PORT health=HOST:PORT metrics=http://HOST:PORT``. SIGTERM or
SIGINT turns readiness off, lets the streams in progress go on for
``shutdown_grace_s``, then stops.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal
import sys
from collections.abc import Sequence

from pydantic import ValidationError

from dataplane.epp.service import EppService
from dataplane.epp.settings import EppSettings
from dataplane.main import describe
from kvruntime.flags import flags_given, settings_parser
from kvruntime.gc_tuning import tune_gc
from kvruntime.jsonlog import configure_logging
from kvruntime.loop import run

PROG = "kvroute-epp"
READY_PREFIX = "kvroute-epp ready"


class SettingsRefused(Exception):
    """A flag or environment value that cannot start a picker (one line, exit 2)."""


def build_parser() -> argparse.ArgumentParser:
    return settings_parser(
        EppSettings,
        prog=PROG,
        description="kvroute as a Gateway API Inference Extension endpoint picker: an Envoy "
        "ext_proc server that picks each request's replica on kvroute's routing state.",
        refuse=SettingsRefused,
    )


def load_settings(argv: Sequence[str] | None) -> EppSettings:
    """Flags over environment over defaults; ``SettingsRefused`` with one clear line."""
    given = flags_given(build_parser(), argv)
    try:
        return EppSettings(**given)
    except ValidationError as exc:
        raise SettingsRefused(describe(exc)) from None


def ready_line(settings: EppSettings, ports: dict[str, int]) -> str:
    host = settings.host if settings.host not in ("0.0.0.0", "::") else "127.0.0.1"
    return (
        f"{READY_PREFIX} grpc={host}:{ports['grpc']} health={host}:{ports['health']} "
        f"metrics=http://{host}:{ports['metrics']}"
    )


async def serve(settings: EppSettings) -> None:
    service = EppService(settings)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    try:
        await service.start()
        print(ready_line(settings, service.ports), flush=True)
        await stop.wait()
        await service.stop_serving()
    finally:
        await service.aclose(settings.shutdown_grace_s)


def main(argv: Sequence[str] | None = None) -> int:
    try:
        settings = load_settings(argv)
    except SettingsRefused as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        return 2
    configure_logging(settings.log_level)
    tune_gc()
    try:
        with contextlib.suppress(KeyboardInterrupt):
            run(serve(settings))
    except OSError as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        return 2
    return 0
