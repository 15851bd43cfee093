"""The one JSON log-line format every kvroute process writes."""

from __future__ import annotations

import json
import logging
import sys

from kvruntime.jsonlog import JsonFormatter


def test_json_logs_carry_extra_fields() -> None:
    record = logging.makeLogRecord(
        {"msg": "hello %s", "args": ("world",), "levelname": "INFO", "name": "sidecar", "epoch": 42}
    )
    line = json.loads(JsonFormatter().format(record))
    assert (line["msg"], line["level"], line["epoch"]) == ("hello world", "INFO", 42)
    assert "exc" not in line


def test_a_logged_exception_carries_its_traceback() -> None:
    try:
        raise KeyError("replica-7")
    except KeyError:
        record = logging.getLogger("x").makeRecord(
            "x", logging.ERROR, __file__, 1, "lost %s", ("it",), sys.exc_info()
        )
    line = json.loads(JsonFormatter().format(record))
    assert line["msg"] == "lost it"
    assert line["exc"].startswith("Traceback") and "KeyError: 'replica-7'" in line["exc"]
