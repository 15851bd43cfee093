"""``--metrics-port``: /metrics on a port of its own, so that a public Service of the API
port does not expose it (issue 46, item 3)."""

from __future__ import annotations

import json

import pytest

from dataplane.main import SettingsRefused, load_settings
from kvroute.servers import free_port
from tests.e2e.proxyproc import ProxyProcess, http_request
from tests.unit.enginesim.simproc import SimProcess

pytestmark = pytest.mark.e2e

MODEL = "sim-model"


def test_metrics_leave_the_api_port_for_their_own_and_count_every_worker() -> None:
    port = free_port()
    with (
        SimProcess("--instant", f"--model={MODEL}", "--replay-endpoint=") as sim,
        ProxyProcess(
            f"--static-replicas={sim.url}", "--workers=2", f"--metrics-port={port}"
        ) as proxy,
    ):
        body = {"model": MODEL, "prompt": "Hello", "max_tokens": 1}
        assert [proxy.request("/v1/completions", body)[0] for _ in range(6)] == [200] * 6
        status, _, answer = proxy.request("/metrics", method="GET")
        assert status == 404 and json.loads(answer)["error"]["type"] == "not_found_error"
        metrics = f"http://127.0.0.1:{port}"
        for _ in range(4):  # each scrape on a connection of its own: either worker answers
            status, _, text = http_request(f"{metrics}/metrics", method="GET")
            assert status == 200 and "kvroute_proxy_requests_total{" in text.decode()
            assert '"} 6.0\n' in text.decode()
        assert http_request(f"{metrics}/healthz", method="GET")[0] == 200
        assert http_request(f"{metrics}/v1/completions", body)[0] == 404  # not the API


def test_a_metrics_port_equal_to_the_api_port_is_refused() -> None:
    with pytest.raises(SettingsRefused, match="--metrics-port must differ from --port"):
        load_settings(
            ["--static-replicas=http://127.0.0.1:1", "--port=8123", "--metrics-port=8123"]
        )
