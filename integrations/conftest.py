"""The session's ``kvroute up`` (:mod:`fleet`)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from fleet import MODEL, Fleet, read_until

from kvroute.servers import free_port


@pytest.fixture(scope="session")
def fleet() -> Iterator[Fleet]:
    kvroute = Path(sys.executable).parent / "kvroute"
    port = free_port()
    argv = [str(kvroute), "up", "--port", str(port), "--replicas", "2"]
    proc = subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
        text=True, start_new_session=True,
    )  # fmt: skip
    try:
        banner = read_until(proc, "kvroute is up")
        # keep reading: a full pipe would stall the launcher's writes
        threading.Thread(target=proc.stdout.read, daemon=True).start()  # type: ignore[union-attr]
        folder = re.search(rf"model\s+{MODEL}\s+tokenizer (\S+)", banner)
        assert folder is not None, banner
        yield Fleet(f"http://127.0.0.1:{port}", Path(folder.group(1)))
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()
