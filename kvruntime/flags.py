"""Command lines built from settings classes, so every component's flags read alike.

Each field of a component's settings class (pydantic-settings, ``env_prefix="KVROUTE_"``)
is a flag, ``--block-size`` for ``block_size``, and an environment variable,
``KVROUTE_BLOCK_SIZE``, which pydantic-settings reads. Only the flags given are passed
to the class, so a flag wins over the environment and an absent one leaves it be. A
flag's value goes to the class as text, as the environment's does, so both accept the
same values (a list: comma-separated) and the class alone validates them. A boolean is
``--x`` / ``--no-x`` (a field named ``no_...`` only ``--no-...``); a ``Literal`` lists
its choices; a secret named in ``env_only`` has no flag at all. Each flag's help is its
field's description, its default and its variable; abbreviations are refused, so a
flag added later never changes what an existing command line means.
"""

from __future__ import annotations

import argparse
from collections.abc import Collection, Sequence
from typing import Any, Literal, NoReturn, get_args, get_origin

from pydantic import SecretStr
from pydantic.fields import FieldInfo
from pydantic_settings import BaseSettings


def settings_parser(
    settings: type[BaseSettings],
    *,
    prog: str,
    description: str,
    env_only: Collection[str] = (),
    refuse: type[Exception] | None = None,
) -> argparse.ArgumentParser:
    """A parser with one flag per field of ``settings`` but those in ``env_only``.

    With ``refuse``, a flag argparse rejects (unknown, or a value not among its choices)
    raises ``refuse(message)``; without, argparse prints its usage and exits with 2.
    """
    prefix = str(settings.model_config.get("env_prefix", ""))
    epilog = (
        f"Every flag is also the environment variable {prefix}<FLAG> (upper case, dashes "
        "as underscores); a flag given wins over the environment."
    )
    if env_only:
        names = ", ".join(prefix + name.upper() for name in sorted(env_only))
        epilog += f" Only from the environment: {names}."
    parser = _RefusingParser(
        refuse, prog=prog, description=description, epilog=epilog, allow_abbrev=False
    )
    for name, field in settings.model_fields.items():
        if name not in env_only:
            _add_flag(parser, name, field, prefix + name.upper())
    return parser


def flags_given(parser: argparse.ArgumentParser, argv: Sequence[str] | None) -> dict[str, Any]:
    """The fields the command line sets, by name (their values as given)."""
    return {
        name: value for name, value in vars(parser.parse_args(argv)).items() if value is not None
    }


def flag_name(field: str) -> str:
    """``block_size`` -> ``--block-size``."""
    return "--" + field.replace("_", "-")


class _RefusingParser(argparse.ArgumentParser):
    def __init__(self, refuse: type[Exception] | None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._refuse = refuse

    def error(self, message: str) -> NoReturn:
        if self._refuse is None:
            super().error(message)
        raise self._refuse(message)


def _add_flag(parser: argparse.ArgumentParser, name: str, field: FieldInfo, env: str) -> None:
    flag = flag_name(name)
    help_text = f"{_help(field)} [env {env}]".replace("%", "%%")
    if field.annotation is bool:
        action = "store_true" if name.startswith("no_") else argparse.BooleanOptionalAction
        parser.add_argument(flag, action=action, default=None, help=help_text)
    elif get_origin(field.annotation) is Literal:
        choices = get_args(field.annotation)
        parser.add_argument(flag, choices=choices, default=None, help=help_text)
    else:
        parser.add_argument(flag, default=None, help=help_text)


def _help(field: FieldInfo) -> str:
    text = (field.description or "").strip()
    if _is_list(field) and "comma-separated" not in text:
        text += " (comma-separated)"
    if field.is_required():
        return text + " (required)"
    shown = _default(field)
    return f"{text} (default: {shown})" if shown else text


def _default(field: FieldInfo) -> str:
    """The default as a command line would give it; '' where there is none worth showing
    (none at all, a secret, a switch, an empty value)."""
    value = field.get_default(call_default_factory=True, validated_data={})
    if value is None or isinstance(value, bool | SecretStr):
        return ""
    if isinstance(value, list | tuple):
        return ",".join(str(item) for item in value)
    return str(value)


def _is_list(field: FieldInfo) -> bool:
    return get_origin(field.annotation) in (list, tuple)


def comma_list(value: object) -> object:
    """A list setting given as one string (a flag or an environment variable): its
    comma-separated items, blanks dropped; anything else as it came, for pydantic."""
    if isinstance(value, str):
        return [item.strip() for item in value.split(",") if item.strip()]
    return value
