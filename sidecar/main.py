"""Entry point of ``kvroute-sidecar``: flags -> settings -> service, until SIGTERM/SIGINT."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
from collections.abc import Sequence

from aiohttp import web
from pydantic import ValidationError

from kvruntime.flags import flags_given, settings_parser
from kvruntime.gc_tuning import tune_gc
from kvruntime.jsonlog import configure_logging
from kvruntime.loop import run
from sidecar.errors import SidecarError
from sidecar.observability import create_app
from sidecar.service import SidecarService
from sidecar.settings import ENV_ONLY, SidecarSettings

log = logging.getLogger("sidecar")


def build_parser() -> argparse.ArgumentParser:
    return settings_parser(
        SidecarSettings,
        prog="kvroute-sidecar",
        description="kvroute sidecar: an engine's KV events and load, in router keys, on NATS.",
        env_only=ENV_ONLY,
    )


def load_settings(argv: Sequence[str] | None) -> SidecarSettings:
    return SidecarSettings(**flags_given(build_parser(), argv))


async def serve(settings: SidecarSettings) -> None:
    service = SidecarService(settings)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    runner = web.AppRunner(create_app(service), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, settings.host, settings.port)
    await site.start()
    log.info(
        "sidecar listening",
        extra={
            "host": settings.host,
            "port": settings.port,
            "replica": settings.replica_id,
            "epoch": service.epoch,
        },
    )
    try:
        await service.run(stop)
    finally:
        await runner.cleanup()


def main(argv: Sequence[str] | None = None) -> int:
    try:
        settings = load_settings(argv)
    except ValidationError as exc:
        print(f"kvroute-sidecar: invalid settings:\n{exc}", file=sys.stderr)
        return 2
    configure_logging(settings.log_level)
    tune_gc()
    try:
        run(serve(settings))
    except SidecarError as exc:
        log.error("sidecar failed", extra={"error": str(exc)})
        return 1
    except OSError as exc:
        log.error("sidecar could not bind", extra={"error": str(exc)})
        return 1
    return 0
