"""``python -m`` on each server's module is that server's command, not a module that
imports and ends (as ``python -m kvroute.cli`` and ``python -m enginesim.main`` are)."""

from __future__ import annotations

import subprocess
import sys

import pytest


@pytest.mark.parametrize(
    ("module", "prog"),
    [
        ("controlplane.main", "kvroute-controlplane"),
        ("sidecar.main", "kvroute-sidecar"),
        ("dataplane.main", "kvroute-proxy"),
        ("dataplane.epp.main", "kvroute-epp"),
    ],
)
def test_python_m_runs_the_servers_command(module: str, prog: str) -> None:
    done = subprocess.run(
        [sys.executable, "-m", module, "--help"], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"usage: {prog} "), done.stdout[:200]
    refused = subprocess.run(
        [sys.executable, "-m", module, "--no-such-flag"], capture_output=True, text=True, timeout=60
    )
    assert refused.returncode == 2, refused.stderr
    assert "--no-such-flag" in refused.stderr
