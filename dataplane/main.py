"""Entry point of ``kvroute-proxy``: flags -> settings -> N serving processes.

A bad flag or value is refused before anything binds, with one line on stderr and exit
status 2. ``--workers N`` forks N processes that each bind the same port with
``SO_REUSEPORT`` (the kernel spreads connections over them) and each keep their own
routing state stream; the parent prints one ready line when all of them serve and
stops them on SIGTERM/SIGINT.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any, Literal, NoReturn, get_args, get_origin

from pydantic import ValidationError

from dataplane.settings import LIST_FIELDS, ProxySettings

PROG = "kvroute-proxy"


class SettingsRefused(Exception):
    """A flag or environment value that cannot start a proxy (one line, exit 2)."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise SettingsRefused(message)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog=PROG,
        description="kvroute's OpenAI-compatible data-plane proxy: scores replicas locally "
        "and streams their answers back. Every flag can also be set as KVROUTE_<FLAG>.",
    )
    for name, field in ProxySettings.model_fields.items():
        flag = "--" + name.replace("_", "-")
        help_text = f"{field.description or ''} [env KVROUTE_{name.upper()}]"
        if field.annotation is bool:
            parser.add_argument(
                flag, action=argparse.BooleanOptionalAction, default=None, help=help_text
            )
        elif get_origin(field.annotation) is Literal:
            choices = get_args(field.annotation)
            parser.add_argument(flag, choices=choices, default=None, help=help_text)
        elif name in LIST_FIELDS:
            parser.add_argument(flag, default=None, help=help_text + " (comma-separated)")
        else:
            parser.add_argument(flag, default=None, help=help_text)
    return parser


def load_settings(argv: Sequence[str] | None) -> ProxySettings:
    """Flags over environment over defaults; ``SettingsRefused`` with one clear line."""
    args = build_parser().parse_args(argv)
    given: dict[str, Any] = {k: v for k, v in vars(args).items() if v is not None}
    try:
        return ProxySettings(**given)
    except ValidationError as exc:
        raise SettingsRefused(describe(exc)) from None


def describe(exc: ValidationError) -> str:
    """A validation error as one line: ``--flag: problem (got value)`` per field."""
    parts = []
    for err in exc.errors():
        where = "--" + "-".join(str(p) for p in err["loc"][:1]).replace("_", "-")
        message = err["msg"].removeprefix("Value error, ")
        if where == "--":
            parts.append(message)
        else:
            parts.append(f"{where}: {message} (got {err.get('input')!r})")
    return "; ".join(parts)


def main(argv: Sequence[str] | None = None) -> int:
    try:
        load_settings(argv)
    except SettingsRefused as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        return 2
    print(f"{PROG}: the proxy's HTTP service is not built yet (issue 10)", file=sys.stderr)
    return 1
