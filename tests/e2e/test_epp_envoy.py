"""kvroute-epp behind a real Envoy (deploy/envoy/envoy-epp.yaml) in front of a real fleet.

Three ``kvroute-sim`` engines, their sidecars and a control plane (``kvroute up``'s, as
tests/e2e/fullstack runs it), ``kvroute-epp`` watching the control plane, and Envoy with
the example config: its ext_proc filter asks the picker, its override-host cluster
follows the pick. What a user of a gateway notices: requests sharing a system prompt
land on the replica holding it, whole and streamed, chat and completions (the engines'
cached tokens are the picker's prediction); a replica that refuses connections is
skipped by Envoy's retry along the picker's fallback list; and with the picker stopped,
Envoy still serves (FailOpen).
"""

from __future__ import annotations

import json
import sys
import urllib.request
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from bench.envoy import EnvoyProcess
from tests.e2e.fullstack import FullStack, wait_for
from tests.e2e.proxyproc import http_request
from tests.unit.enginesim.simproc import SimProcess

pytestmark = [pytest.mark.e2e, pytest.mark.integration]

MODEL = "sim-model"
SIM_ARGS = ("--instant", f"--model={MODEL}", "--max-model-len=8192", "--replay-endpoint=")
EPP = Path(sys.executable).parent / "kvroute-epp"
SYSTEM = " ".join(f"rule{n} of the house is to answer with care" for n in range(60))


class EppProcess(SimProcess):
    """``kvroute-epp`` on free loopback ports, ready once it prints its ready line."""

    ready_prefix = "kvroute-epp ready"
    default_args = (str(EPP), "--host=127.0.0.1", "--grpc-port=0", "--health-port=0",
                    "--metrics-port=0", "--shutdown-grace-s=0")  # fmt: skip

    def on_ready(self, fields: dict[str, str]) -> None:
        self.grpc, self.metrics = fields["grpc"], fields["metrics"]

    def counters(self) -> dict[str, float]:
        """Its ``kvroute_proxy_*_total`` series, summed by name and replica."""
        with urllib.request.urlopen(self.metrics + "/metrics", timeout=5) as resp:
            text = resp.read().decode()
        totals: dict[str, float] = {}
        for line in text.splitlines():
            if line.startswith("kvroute_proxy_") and "_total{" in line:
                name = line.split("{", 1)[0]
                replica = (
                    line.split('replica="', 1)[1].split('"', 1)[0] if 'replica="' in line else ""
                )
                key = f"{name}:{replica}"
                totals[key] = totals.get(key, 0.0) + float(line.rsplit(" ", 1)[1])
        return totals


@dataclass
class Gateway:
    stack: FullStack
    epp: EppProcess
    envoy: EnvoyProcess  # the example's: request bodies buffered
    duplex: EnvoyProcess  # the example with request bodies FULL_DUPLEX_STREAMED

    def send(
        self, path: str, body: dict[str, Any], envoy: EnvoyProcess | None = None
    ) -> tuple[int, dict[str, Any] | None]:
        """One request through Envoy; a stream's usage event (asked for) as its usage."""
        url = (envoy or self.envoy).url
        status, _, answer = http_request(url + path, {"model": MODEL, **body})
        if status != 200:
            return status, None
        if not body.get("stream"):
            return status, json.loads(answer)["usage"]
        events = [e[6:] for e in answer.decode().split("\n\n") if e.startswith("data: ")]
        assert events[-1] == "[DONE]"
        return status, json.loads(events[-2])["usage"]

    def total(self, name: str) -> float:
        return sum(
            v
            for k, v in self.epp.counters().items()
            if k.startswith(f"kvroute_proxy_{name}_total:")
        )


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    with ExitStack() as started:
        sims = [started.enter_context(SimProcess(*SIM_ARGS)) for _ in range(3)]
        env = {"KVROUTE_LOAD_INTERVAL_S": "0.2"}
        stack = started.enter_context(FullStack(sims, tmp_path_factory.mktemp("fleet"), env))
        wait_for(lambda: stack.readyz()["replicas"] == 3, "the replicas in the fleet")
        controlplane = ",".join(stack.fleet.grpc_addresses)
        epp = started.enter_context(EppProcess(f"--controlplane={controlplane}"))
        urls = [sim.url for sim in sims]
        envoy = started.enter_context(EnvoyProcess(epp.grpc, urls))
        duplex = started.enter_context(EnvoyProcess(epp.grpc, urls, "FULL_DUPLEX_STREAMED"))
        yield Gateway(stack, epp, envoy, duplex)


def chat(question: str, stream: bool) -> dict[str, Any]:
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
    body: dict[str, Any] = {"messages": messages, "max_tokens": 4, "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    return body


def completion(question: str, stream: bool) -> dict[str, Any]:
    body: dict[str, Any] = {"prompt": f"{SYSTEM}\n{question}", "max_tokens": 4, "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    return body


@pytest.mark.parametrize("duplex", [False, True], ids=["buffered", "full-duplex"])
@pytest.mark.parametrize(
    ("path", "build"), [("/v1/chat/completions", chat), ("/v1/completions", completion)]
)
def test_requests_sharing_a_system_prompt_land_on_its_holder(
    gateway: Gateway, path: str, build: Any, duplex: bool
) -> None:
    envoy = gateway.duplex if duplex else gateway.envoy
    status, first = gateway.send(path, build(f"who are you? {duplex}", False), envoy)
    assert status == 200 and first is not None
    for index, stream in enumerate([True, False, True, False]):
        status, usage = gateway.send(path, build(f"question {index}", stream), envoy)
        assert status == 200 and usage is not None
        cached = usage["prompt_tokens_details"]["cached_tokens"]
        assert cached >= 0.8 * usage["prompt_tokens"], usage  # the system prompt, cached
    predicted, measured = (
        gateway.total("predicted_cached_tokens"),
        gateway.total("measured_cached_tokens"),
    )
    assert measured > 0 and abs(predicted - measured) <= 0.02 * measured


def test_a_request_without_a_body_goes_to_a_replica_serving_the_model(gateway: Gateway) -> None:
    status, _, answer = http_request(gateway.envoy.url + "/v1/models", method="GET")
    assert status == 200 and [card["id"] for card in json.loads(answer)["data"]] == [MODEL]


def test_a_replica_refusing_connections_is_passed_over_along_the_fallback_list(
    gateway: Gateway,
) -> None:
    body = completion("a question for the failing replica", False)
    before = gateway.epp.counters()
    assert gateway.send("/v1/completions", body)[0] == 200
    after = gateway.epp.counters()
    [holder] = [
        k.split(":")[1]
        for k in after
        if k.startswith("kvroute_proxy_requests_total:") and after[k] > before.get(k, 0)
    ]
    sim = gateway.stack.engines[int(holder.removeprefix("r"))]
    sim.post("/sim/faults", {"crash": True})
    assert sim.proc is not None and sim.proc.wait(timeout=10) == 70
    retries = gateway.envoy.stat("cluster.replicas.upstream_rq_retry")
    status, usage = gateway.send("/v1/completions", body)
    assert status == 200 and usage is not None
    assert gateway.envoy.stat("cluster.replicas.upstream_rq_retry") > retries
    served = gateway.epp.counters()
    moved = [
        k
        for k in served
        if k.startswith("kvroute_proxy_requests_total:") and served[k] > after.get(k, 0)
    ]
    assert moved and all(not k.endswith(f":{holder}") for k in moved)


def test_envoy_serves_with_the_picker_stopped(gateway: Gateway) -> None:
    assert gateway.epp.proc is not None
    gateway.epp.proc.terminate()
    assert gateway.epp.proc.wait(timeout=10) == 0
    for index in range(3):
        status, _, answer = http_request(
            gateway.envoy.url + "/v1/completions",
            {"model": MODEL, **completion(f"fail open {index}", False)},
        )
        assert status == 200, (answer, gateway.envoy.log.read_text()[-3000:])
