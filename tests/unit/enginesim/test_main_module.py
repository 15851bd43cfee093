"""``python -m enginesim.main`` is the ``kvroute-sim`` command, not a module that imports
and ends."""

from __future__ import annotations

import subprocess
import sys


def test_python_m_enginesim_main_runs_the_simulator_command() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "enginesim.main", "--help"], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("usage: kvroute-sim ")
    assert "--kv-transfer-block-ms" in done.stdout
