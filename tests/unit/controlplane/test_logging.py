"""The control plane's log lines: JSON, and a logged exception keeps its traceback."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator

import pytest

from kvruntime.jsonlog import configure_logging


@pytest.fixture
def root_logging() -> Iterator[None]:
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


@pytest.mark.usefixtures("root_logging")
def test_log_exception_writes_the_traceback(capsys: pytest.CaptureFixture[str]) -> None:
    configure_logging("INFO")
    log = logging.getLogger("controlplane.records.service")
    try:
        raise ConnectionError("database went away")
    except ConnectionError:
        log.exception("leader job %s failed; retrying next period", "rollup")
    line = json.loads(capsys.readouterr().err.strip().splitlines()[-1])
    assert (line["level"], line["logger"]) == ("ERROR", "controlplane.records.service")
    assert line["msg"] == "leader job rollup failed; retrying next period"
    assert "Traceback" in line["exc"]
    assert "ConnectionError: database went away" in line["exc"]
