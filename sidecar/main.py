"""Entry point of ``kvroute-sidecar``: flags -> settings -> service, until SIGTERM/SIGINT."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
from collections.abc import Coroutine, Sequence
from typing import Any, Literal, get_args, get_origin

from aiohttp import web
from pydantic import ValidationError

from kvruntime.gc_tuning import tune_gc
from kvruntime.jsonlog import configure_logging
from sidecar.errors import SidecarError
from sidecar.observability import create_app
from sidecar.service import SidecarService
from sidecar.settings import SidecarSettings

log = logging.getLogger("sidecar")
_ENV_ONLY = {"nats_token", "nats_user", "nats_password"}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvroute-sidecar",
        description="kvroute sidecar: an engine's KV events and load, in router keys, on NATS."
        " Every flag can also be set as KVROUTE_<FLAG> (NATS credentials only that way).",
    )
    for name, field in SidecarSettings.model_fields.items():
        if name in _ENV_ONLY:
            continue
        flag = "--" + name.replace("_", "-")
        help_text = f"{field.description or ''} [env KVROUTE_{name.upper()}]"
        if field.annotation is bool:
            parser.add_argument(
                flag, action=argparse.BooleanOptionalAction, default=None, help=help_text
            )
        elif name == "served_names":
            parser.add_argument(
                flag,
                type=lambda v: [n for n in v.split(",") if n],
                default=None,
                help=help_text + " (comma-separated)",
            )
        elif get_origin(field.annotation) is Literal:
            parser.add_argument(
                flag, choices=get_args(field.annotation), default=None, help=help_text
            )
        else:
            parser.add_argument(flag, default=None, help=help_text)
    return parser


def load_settings(argv: Sequence[str] | None) -> SidecarSettings:
    args = build_parser().parse_args(argv)
    given: dict[str, Any] = {k: v for k, v in vars(args).items() if v is not None}
    return SidecarSettings(**given)


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


def run_loop(main_coroutine: Coroutine[Any, Any, None]) -> None:
    """Run on uvloop where available: a shorter, steadier path from ZMQ to NATS."""
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency off Windows
        asyncio.run(main_coroutine)
        return
    uvloop.run(main_coroutine)


def main(argv: Sequence[str] | None = None) -> int:
    try:
        settings = load_settings(argv)
    except ValidationError as exc:
        print(f"kvroute-sidecar: invalid settings:\n{exc}", file=sys.stderr)
        return 2
    configure_logging(settings.log_level)
    tune_gc()
    try:
        run_loop(serve(settings))
    except SidecarError as exc:
        log.error("sidecar failed", extra={"error": str(exc)})
        return 1
    except OSError as exc:
        log.error("sidecar could not bind", extra={"error": str(exc)})
        return 1
    return 0
