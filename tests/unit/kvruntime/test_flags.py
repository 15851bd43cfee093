"""Command lines built from settings classes: flags, their environment variables, --help."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Annotated, Literal

import pytest
from pydantic import Field, SecretStr, field_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from controlplane.main import build_parser as controlplane_parser
from dataplane.main import build_parser as proxy_parser
from enginesim.settings import build_parser as sim_parser
from kvruntime.flags import flags_given, settings_parser
from sidecar.main import build_parser as sidecar_parser


class Demo(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="KVROUTE_", extra="forbid")

    block_size: int = Field(16, ge=1, description="Tokens per block.")
    kind: Literal["vllm", "sglang"] = Field("vllm", description="Engine family.")
    bind: bool = Field(False, description="Bind instead of connecting.")
    no_cache_report: bool = Field(False, description="Report no cached tokens.")
    pools: Annotated[list[str], NoDecode] = Field(default_factory=list, description="Pools.")
    token: SecretStr | None = Field(None, description="A secret.")
    replica_id: str = Field(..., description="This replica.")

    @field_validator("pools", mode="before")
    @classmethod
    def _comma_list(cls, value: object) -> object:
        return value.split(",") if isinstance(value, str) else value


class Refused(Exception):
    pass


def parser() -> argparse.ArgumentParser:
    return settings_parser(
        Demo, prog="demo", description="A demo.", env_only={"token"}, refuse=Refused
    )


def load(argv: list[str]) -> Demo:
    return Demo(**flags_given(parser(), argv))


def test_a_flag_wins_over_its_environment_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVROUTE_BLOCK_SIZE", "32")
    monkeypatch.setenv("KVROUTE_KIND", "sglang")
    settings = load(["--replica-id", "r", "--block-size", "64"])
    assert (settings.block_size, settings.kind) == (64, "sglang")


def test_switches_lists_and_choices() -> None:
    settings = load(["--replica-id", "r", "--bind", "--no-cache-report", "--pools", "a,b"])
    assert (settings.bind, settings.no_cache_report, settings.pools) == (True, True, ["a", "b"])
    assert load(["--replica-id", "r", "--no-bind"]).bind is False
    with pytest.raises(Refused, match="invalid choice: 'tgi'"):
        load(["--replica-id", "r", "--kind", "tgi"])


@pytest.mark.parametrize(
    "argv", [["--token", "s3cret"], ["--block", "3"], ["--no-no-cache-report"]]
)
def test_secrets_abbreviations_and_double_negatives_are_no_flags(argv: list[str]) -> None:
    with pytest.raises(Refused, match="unrecognized arguments"):
        load(["--replica-id", "r", *argv])


def test_help_names_each_default_and_variable() -> None:
    text = " ".join(parser().format_help().split())
    assert "Tokens per block. (default: 16) [env KVROUTE_BLOCK_SIZE]" in text
    assert "Pools. (comma-separated) [env KVROUTE_POOLS]" in text
    assert "This replica. (required) [env KVROUTE_REPLICA_ID]" in text
    assert "Only from the environment: KVROUTE_TOKEN." in text


def test_without_refuse_a_bad_flag_is_argparses_usage_error(
    capsys: pytest.CaptureFixture[str],
) -> None:
    bare = settings_parser(Demo, prog="demo", description="A demo.")
    with pytest.raises(SystemExit) as exit_info:
        bare.parse_args(["--kind", "tgi"])
    assert exit_info.value.code == 2
    assert "{vllm,sglang}" in capsys.readouterr().err


@pytest.mark.parametrize(
    "build",
    [controlplane_parser, sidecar_parser, proxy_parser, sim_parser],
    ids=lambda b: b.__module__,
)
def test_every_component_help_has_one_shape(build: Callable[[], argparse.ArgumentParser]) -> None:
    built = build()
    for action in built._actions:
        if action.dest == "help":
            continue
        assert action.option_strings[0] == "--" + action.dest.replace("_", "-")
        assert action.help is not None
        assert action.help.endswith(f"[env KVROUTE_{action.dest.upper()}]"), action.dest
    assert "Every flag is also the environment variable KVROUTE_<FLAG>" in built.format_help()
