"""A server's main (kvruntime.lifecycle.main_of): what a user sees of each way it ends."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from kvruntime import lifecycle
from kvruntime.lifecycle import main_of


@dataclass(frozen=True)
class Settings:
    log_level: str = "WARNING"


class Refused(Exception):
    pass


class CannotConnect(Exception):
    pass


@pytest.fixture(autouse=True)
def process_wide(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The log set-up and the collector's thresholds, recorded instead of changed for
    the whole test process."""
    levels: list[str] = []
    monkeypatch.setattr(lifecycle, "configure_logging", levels.append)
    monkeypatch.setattr(lifecycle, "tune_gc", lambda: None)
    return levels


def settings() -> Settings:
    return Settings()


def refuse() -> Settings:
    raise Refused("--port: must be at most 65535 (got 70000)")


async def serves(_: Settings) -> None:
    return None


async def fails(_: Settings) -> None:
    raise CannotConnect("etcd at 127.0.0.1:2379 does not answer")


async def cannot_bind(_: Settings) -> None:
    raise OSError("[Errno 98] address already in use")


def test_refused_settings_end_with_status_2_and_one_line(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main_of("kvroute-x", refuse, Refused, serves, {}) == 2
    assert capsys.readouterr().err == "kvroute-x: --port: must be at most 65535 (got 70000)\n"


def test_a_failure_ends_with_its_status_and_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    failures = {CannotConnect: 1, OSError: 2}
    assert main_of("kvroute-x", settings, Refused, fails, failures) == 1
    assert capsys.readouterr().err == "kvroute-x: etcd at 127.0.0.1:2379 does not answer\n"
    assert main_of("kvroute-x", settings, Refused, cannot_bind, failures) == 2
    assert "address already in use" in capsys.readouterr().err


def test_serving_to_its_end_is_status_0_with_logs_at_the_settings_level(
    process_wide: list[str],
) -> None:
    assert main_of("kvroute-x", settings, Refused, serves, {OSError: 2}) == 0
    assert process_wide == ["WARNING"]
