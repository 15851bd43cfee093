"""``python -m kvroute.cli`` is the ``kvroute`` command, not a module that imports and ends."""

from __future__ import annotations

import subprocess
import sys


def test_python_m_kvroute_cli_runs_the_command() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "kvroute.cli", "--help"], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("usage: kvroute ")
    assert "up" in done.stdout and "bench" in done.stdout


def test_python_m_kvroute_cli_refuses_an_unknown_command() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "kvroute.cli", "no-such-command"], capture_output=True, text=True
    )
    assert done.returncode == 2
    assert "invalid choice: 'no-such-command'" in done.stderr
