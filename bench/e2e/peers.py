"""The peer routers: installed from PyPI into their own virtual environments, run on loopback.

``sglang-router``, ``vllm-router`` and ``smg`` (the SGLang Model Gateway, sglang-router's
successor) are Rust binaries shipped in wheels; each goes
into its own venv under the cache folder (``~/.cache/kvroute/peers`` unless
``KVROUTE_PEERS_DIR`` says otherwise) the first time the benchmark needs it, so kvroute's
own environment never sees their dependencies. A peer that cannot be installed is
reported as such (:class:`PeerUnavailable`), never silently left out of a report.

Each is told to listen on 127.0.0.1 only (their defaults are 0.0.0.0) and to keep its
Prometheus endpoint on loopback too. ``smg`` would load the workers' model's tokenizer by
name (a download); it is given the simulated model's tokenizer on disk instead. Several
``smg`` instances can share their routing state over its mesh (``--enable-mesh``), bound
to loopback and each told every other one's address.
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from enginesim.sim_model import SIM_MODEL_DIR

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
    subcommand: str = ""  # "launch" for the SGLang routers
    extra: tuple[str, ...] = ()  # what it needs besides the common flags
    has_mesh: bool = False  # instances can share routing state (``mesh_argv``)

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
        if self.subcommand:
            argv.append(self.subcommand)
        argv += [
            "--host", "127.0.0.1",
            "--port", str(port),
            "--worker-urls", *workers,
            "--policy", policy,
            "--prometheus-host", "127.0.0.1",
            "--prometheus-port", str(metrics_port),
            "--log-level", self.log_level,
            *self.extra,
        ]  # fmt: skip
        return argv


def mesh_argv(name: str, port: int, peer_ports: list[int]) -> list[str]:
    """An ``smg`` instance's mesh flags: listen on loopback ``port``, join the others."""
    argv = ["--enable-mesh", "--mesh-server-name", name, "--mesh-host", "127.0.0.1"]
    argv += ["--mesh-advertise-host", "127.0.0.1", "--mesh-port", str(port)]
    return [*argv, "--mesh-peer-urls", *(f"127.0.0.1:{p}" for p in peer_ports)]


SGLANG_ROUTER = Peer(
    "sglang-router", "sglang-router", "0.3.2", "sglang-router", "warn", subcommand="launch"
)
VLLM_ROUTER = Peer("vllm-router", "vllm-router", "0.1.17", "vllm-router", "warning")
SMG = Peer(
    "smg", "smg", "1.13.0", "smg", "warn", subcommand="launch",
    extra=("--tokenizer-path", str(SIM_MODEL_DIR)), has_mesh=True,
)  # fmt: skip
PEERS = {peer.name: peer for peer in (SGLANG_ROUTER, VLLM_ROUTER, SMG)}
