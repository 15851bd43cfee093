"""Run a real ``kvroute-proxy`` or ``kvroute-controlplane`` process for tests, the way
``SimProcess`` runs a simulator."""

from __future__ import annotations

import json
import sys
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from tests.unit.enginesim.simproc import SimProcess

PROXY = Path(sys.executable).parent / "kvroute-proxy"
CONTROLPLANE = Path(sys.executable).parent / "kvroute-controlplane"


def http_request(
    url: str,
    body: Any = None,
    *,
    raw: bytes | None = None,
    method: str = "POST",
    headers: dict[str, str] | None = None,
) -> tuple[int, dict[str, str], bytes]:
    """``(status, headers, body)`` of one request to ``url``, errors included."""
    data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
    request = urllib.request.Request(url, data=data, method=method)
    request.add_header("content-type", "application/json")
    for name, value in (headers or {}).items():
        request.add_header(name, value)
    try:
        with urllib.request.urlopen(request, timeout=30) as resp:
            return resp.status, dict(resp.headers.items()), resp.read()
    except urllib.error.HTTPError as err:
        return err.code, dict(err.headers.items()), err.read()


class ProxyProcess(SimProcess):
    """``kvroute-proxy --port 0 ARGS``, ready once it prints its ready line."""

    ready_prefix = "kvroute-proxy ready"
    default_args = (str(PROXY), "--port=0")

    def on_ready(self, fields: dict[str, str]) -> None:
        self.url = fields["http"]

    def request(
        self,
        path: str,
        body: Any = None,
        *,
        raw: bytes | None = None,
        method: str = "POST",
        headers: dict[str, str] | None = None,
    ) -> tuple[int, dict[str, str], bytes]:
        """``(status, headers, body)`` of one request, errors included."""
        return http_request(self.url + path, body, raw=raw, method=method, headers=headers)


class ControlPlaneProcess(SimProcess):
    """``kvroute-controlplane`` on free admin and gRPC ports, ready once it says so."""

    ready_prefix = "kvroute-controlplane ready"
    default_args = (str(CONTROLPLANE), "--admin-port=0", "--grpc-port=0")

    def on_ready(self, fields: dict[str, str]) -> None:
        self.url = fields["admin"]
        self.grpc = fields["grpc"]
