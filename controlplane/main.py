"""Entry point of ``kvroute-controlplane``: flags -> settings -> service, until SIGTERM/SIGINT.

A bad flag or setting ends the process with exit status 2 and one line on stderr
naming the flag and what is wrong (never echoing a secret); a failure to connect or
bind ends it with status 1.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from typing import get_args

from pydantic import SecretStr, ValidationError
from sqlalchemy.engine import make_url
from sqlalchemy.exc import ArgumentError

from controlplane.records import Records
from controlplane.service import ControlPlane, ServiceError
from controlplane.settings import ENV_ONLY, ControlPlaneSettings
from kvruntime.flags import flag_name, flags_given, settings_parser
from kvruntime.lifecycle import main_of, serve_until_signalled

PROG = "kvroute-controlplane"
log = logging.getLogger("controlplane")


class SettingsError(ValueError):
    """A flag or environment setting that cannot be used (exit status 2)."""


def build_parser() -> argparse.ArgumentParser:
    return settings_parser(
        ControlPlaneSettings,
        prog=PROG,
        description="kvroute control plane: residency map, membership, routing config, "
        "admin API and the gRPC routing-state stream. Secrets only from the environment "
        "or through a *-file flag.",
        env_only=ENV_ONLY,
        refuse=SettingsError,
    )


def load_settings(argv: Sequence[str] | None) -> ControlPlaneSettings:
    """Parse flags over the environment; raise :class:`SettingsError` with one line."""
    given = flags_given(build_parser(), argv)
    if "database_url" in given:
        _refuse_password_in_flag(given["database_url"])
    try:
        return ControlPlaneSettings(**given)
    except ValidationError as exc:
        raise SettingsError(describe(exc)) from None


def _refuse_password_in_flag(url: str) -> None:
    try:
        password = make_url(url).password
    except ArgumentError:
        raise SettingsError(f"--database-url: {url!r} is not a database URL") from None
    if password is not None:
        raise SettingsError(
            "--database-url: a URL with a password goes in KVROUTE_DATABASE_URL or "
            "--database-url-file, never a flag"
        )


def describe(exc: ValidationError) -> str:
    """One line naming each bad setting, its problem and (unless secret) its value."""
    fields = ControlPlaneSettings.model_fields
    problems = []
    for error in exc.errors():
        name = str(error["loc"][0]) if error["loc"] else ""
        message = error["msg"].removeprefix("Value error, ")
        field = fields.get(name)
        secret = field is not None and SecretStr in (field.annotation, *get_args(field.annotation))
        where = f"{_names(name)}: " if name else ""
        shown = "" if secret or not name else f" (got {error['input']!r})"
        problems.append(f"{where}{message}{shown}")
    return "; ".join(problems)


def _names(field: str) -> str:
    env = f"KVROUTE_{field.upper()}"
    return env if field in ENV_ONLY else f"{flag_name(field)} / {env}"


async def serve(settings: ControlPlaneSettings) -> None:
    """Run until SIGTERM/SIGINT; print the ready line once everything listens."""
    service = ControlPlane(settings, records=Records)
    await serve_until_signalled(service.start, lambda: service.ready_line, service.aclose)


def main(argv: Sequence[str] | None = None) -> int:
    return main_of(PROG, lambda: load_settings(argv), SettingsError, serve, {ServiceError: 1})


if __name__ == "__main__":  # ``python -m controlplane.main``: kvroute-controlplane
    sys.exit(main())
