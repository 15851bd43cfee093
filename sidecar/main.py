"""Entry point of ``kvroute-sidecar``: flags -> settings -> service, until SIGTERM/SIGINT."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

from aiohttp import web
from pydantic import ValidationError

from kvruntime.flags import flags_given, settings_parser
from kvruntime.lifecycle import main_of, signalled
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
    stop = signalled()
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


class SettingsRefused(Exception):
    """Settings that cannot start a sidecar (exit status 2)."""


def _settings(argv: Sequence[str] | None) -> SidecarSettings:
    try:
        return load_settings(argv)
    except ValidationError as exc:
        raise SettingsRefused(f"invalid settings:\n{exc}") from None


def main(argv: Sequence[str] | None = None) -> int:
    """Exit 2 on bad settings, 1 when the sidecar fails or cannot bind its port."""
    failures = {SidecarError: 1, OSError: 1}
    return main_of("kvroute-sidecar", lambda: _settings(argv), SettingsRefused, serve, failures)


if __name__ == "__main__":  # ``python -m sidecar.main``, as the ``kvroute-sidecar`` script
    sys.exit(main())
