"""Entry point of ``kvroute-epp``: flags -> settings -> one picker process.

A bad flag or value is refused before anything binds, with one line on stderr and exit
status 2 (as ``kvroute-proxy``). When the three ports serve, one line says where:
``kvroute-epp ready grpc=HOST:PORT health=HOST:PORT metrics=http://HOST:PORT``. SIGTERM or
SIGINT turns readiness off, lets the streams in progress go on for
``shutdown_grace_s``, then stops.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from pydantic import ValidationError

from dataplane.epp.service import EppService
from dataplane.epp.settings import EppSettings
from dataplane.main import describe
from kvruntime.flags import flags_given, settings_parser
from kvruntime.lifecycle import main_of, serve_until_signalled

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
    await serve_until_signalled(
        service.start,
        lambda: ready_line(settings, service.ports),
        lambda: service.aclose(settings.shutdown_grace_s),
        on_signal=service.stop_serving,
    )


def main(argv: Sequence[str] | None = None) -> int:
    return main_of(PROG, lambda: load_settings(argv), SettingsRefused, serve, {OSError: 2})


if __name__ == "__main__":  # ``python -m dataplane.epp.main``, as the ``kvroute-epp`` script
    sys.exit(main())
