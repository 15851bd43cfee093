"""The whole fleet as processes: kvroute-sim replicas with their sidecars, NATS, etcd, the
control plane and kvroute-proxy, all real, on loopback.

What users notice: requests that share a system prompt land on the replica caching it,
and the cached tokens the engines report equal what the router predicted (within 2%);
killing the control plane changes nothing a client sees.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import pytest

from kvroute.servers import EtcdServer, NatsServer
from tests.e2e.proxyproc import ProxyProcess
from tests.unit.enginesim.simproc import SimProcess

pytestmark = [pytest.mark.e2e, pytest.mark.integration]

BIN = Path(sys.executable).parent
MODEL = "sim-model"
SYSTEM = "You are a careful assistant who answers every question in one short line. " * 60


class ControlPlaneProcess(SimProcess):
    ready_prefix = "kvroute-controlplane ready"
    default_args = (str(BIN / "kvroute-controlplane"), "--admin-port=0", "--grpc-port=0")

    def on_ready(self, fields: dict[str, str]) -> None:
        self.url = fields["admin"]
        self.grpc = fields["grpc"]


def sidecar(stack: ExitStack, sim: SimProcess, nats: str, replica_id: str) -> None:
    args = [
        str(BIN / "kvroute-sidecar"), f"--engine-url={sim.url}", "--engine-kind=vllm",
        f"--nats-url={nats}", f"--replica-id={replica_id}", f"--model={MODEL}", "--port=0",
        "--load-interval-s=0.2", "--announce-interval-s=1",
    ]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVROUTE_")}
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    stack.callback(_stop, proc)


def _stop(proc: subprocess.Popen[bytes]) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def wait_for(check: Callable[[], bool], what: str, deadline_s: float = 30.0) -> None:
    """Poll ``check`` (each call a real request) until it holds, bounded."""
    deadline = time.monotonic() + deadline_s
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


@pytest.fixture(scope="module")
def fleet(
    nats_server: NatsServer, etcd_server: EtcdServer, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[ProxyProcess, ControlPlaneProcess, list[SimProcess]]]:
    with ExitStack() as stack:
        sims = [
            stack.enter_context(SimProcess("--instant", f"--model={MODEL}", "--max-model-len=8192"))
            for _ in range(2)
        ]
        for index, sim in enumerate(sims):
            sidecar(stack, sim, nats_server.url, f"r{index}")
        db = tmp_path_factory.mktemp("cp") / "cp.db"
        cp = stack.enter_context(
            ControlPlaneProcess(
                f"--nats-url={nats_server.url}",
                f"--etcd-endpoints={etcd_server.endpoint}",
                "--etcd-prefix=/proxy-e2e/",
                "--instance-id=cp-e2e",
                f"--database-url=sqlite+aiosqlite:///{db}",
                "--heartbeat-timeout-s=5",
            )
        )
        proxy = stack.enter_context(
            ProxyProcess(f"--controlplane={cp.grpc}", "--debug-headers", "--report-interval-s=1")
        )
        wait_for(lambda: _readiness(proxy).get("replicas") == 2, "both replicas in the proxy")
        yield proxy, cp, sims


def _readiness(proxy: ProxyProcess) -> dict[str, Any]:
    _, _, body = proxy.request("/readyz", method="GET")
    return dict(json.loads(body))


def ask(
    proxy: ProxyProcess, question: str, system: str = SYSTEM
) -> tuple[int, dict[str, str], Any]:
    messages = [{"role": "user", "content": question}]
    if system:
        messages.insert(0, {"role": "system", "content": system})
    body = {"model": MODEL, "messages": messages, "max_tokens": 2}
    status, headers, answer = proxy.request("/v1/chat/completions", body)
    return status, {k.lower(): v for k, v in headers.items()}, json.loads(answer)


def matched_blocks(headers: dict[str, str]) -> int:
    return int(headers["x-kvroute-prefix-blocks"].split("/")[0])


def test_a_shared_system_prompt_lands_where_it_is_cached_as_predicted(fleet: Any) -> None:
    proxy, _, _ = fleet
    status, headers, _ = ask(proxy, "First question?")
    assert status == 200
    owner = headers["x-kvroute-replica"]
    # the engine's events reach the proxy through sidecar, NATS and control plane
    wait_for(lambda: matched_blocks(ask(proxy, "Is it cached yet?")[1]) > 0, "residency")
    predicted = measured = 0
    for i in range(8):
        status, headers, answer = ask(proxy, f"Question number {i}: why?")
        assert status == 200 and headers["x-kvroute-replica"] == owner
        predicted += matched_blocks(headers) * 16
        measured += answer["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert measured > 8 * 600
    assert abs(predicted - measured) <= 0.02 * measured


def test_killing_the_control_plane_changes_nothing_clients_see(fleet: Any) -> None:
    proxy, cp, _ = fleet
    _, before, _ = ask(proxy, "Before the control plane goes?")
    assert cp.proc is not None
    cp.proc.kill()
    cp.proc.wait(timeout=10)
    for i in range(6):
        status, headers, answer = ask(proxy, f"Still there {i}?")
        assert status == 200 and answer["choices"][0]["message"]["content"]
        assert headers["x-kvroute-replica"] == before["x-kvroute-replica"]
