"""The proxy's fidelity counters through real processes: prompt tokens, predicted and
measured cached tokens count the same requests, those a replica answered.

What a user notices otherwise: a burst of context-length errors (or any refused request)
adds its prompt and the router's predicted hit but no measured hit, so the predicted
hit rate rises, the measured one falls, and ``KvroutePredictedMeasuredDrift`` fires and
blames a tokenizer mismatch that is not there. Each way a request can end without an
answer gets its test: the engine's 400, 413 and 500, a 503 before the first byte (the
request is retried elsewhere), and a client that goes away before or during the answer.
Predictions need the control plane's state (a static proxy predicts none): those paths
run on the whole fleet (:mod:`tests.e2e.fullstack`); the 413 and 503 come from a stand-in
engine behind a static proxy, whose prompt tokens would move.
"""

from __future__ import annotations

import http.client
import http.server
import json
import threading
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from typing import Any
from urllib.parse import urlsplit

import pytest

from tests.e2e.fullstack import FullStack, wait_for
from tests.e2e.proxyproc import ProxyProcess, http_request
from tests.unit.enginesim.simproc import SimProcess

pytestmark = [pytest.mark.e2e, pytest.mark.integration]

MODEL = "sim-model"
SIM_ARGS = ("--instant", f"--model={MODEL}", "--max-model-len=512", "--replay-endpoint=")
FIDELITY = ("prompt_tokens", "predicted_cached_tokens", "measured_cached_tokens",
            "measured_requests")  # fmt: skip


def counters(proxy: str, replica: str) -> dict[str, float]:
    """``replica``'s fidelity counters at the proxy at URL ``proxy``, summed over
    workloads."""
    status, _, text = http_request(proxy + "/metrics", method="GET")
    assert status == 200
    totals = dict.fromkeys(FIDELITY, 0.0)
    for line in text.decode().splitlines():
        for name in FIDELITY:
            if line.startswith(f"kvroute_proxy_{name}_total{{") and f'replica="{replica}"' in line:
                totals[name] += float(line.rsplit(" ", 1)[1])
    return totals


def outcomes(proxy: str, outcome: str) -> float:
    """Requests the proxy at URL ``proxy`` counted as ending in ``outcome``."""
    _, _, text = http_request(proxy + "/metrics", method="GET")
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.decode().splitlines()
        if line.startswith("kvroute_proxy_requests_total{") and f'outcome="{outcome}"' in line
    )


def replica_id(url: str) -> str:
    """The id a static replica's requests are counted under: its host and port."""
    return urlsplit(url).netloc


def prompt(start: int, length: int) -> list[int]:
    return list(range(start, start + length))


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FullStack]:
    """The whole fleet in front of one simulator (replica ``r0``)."""
    with ExitStack() as started:
        sim = started.enter_context(SimProcess(*SIM_ARGS))
        env = {"KVROUTE_LOAD_INTERVAL_S": "0.2"}
        fleet = started.enter_context(FullStack([sim], tmp_path_factory.mktemp("fleet"), env))
        wait_for(lambda: fleet.readyz()["replicas"] == 1, "the replica in the proxy")
        yield fleet


def completion(stack: FullStack, body: dict[str, Any]) -> tuple[int, Any]:
    status, _, answer = stack.request("/v1/completions", {"model": MODEL, **body})
    return status, json.loads(answer)


def test_a_prompt_over_the_context_length_counts_nothing(stack: FullStack) -> None:
    """A 300-token prompt after a 208-token one it begins with: the router predicts 192
    cached (whole blocks), the engine answers 400 (300 + 300 to generate is over
    ``max_model_len`` 512): none of it is counted, and the replica's predicted and
    measured cached tokens stay equal."""
    served = {"prompt": prompt(5_000, 208), "max_tokens": 1}
    assert completion(stack, served)[0] == 200
    assert completion(stack, served)[0] == 200  # predicted and measured: a hit
    before = counters(stack.proxy_url, "r0")
    assert before["predicted_cached_tokens"] == before["measured_cached_tokens"] == 192
    errors = outcomes(stack.proxy_url, "client_error")
    status, answer = completion(stack, {"prompt": prompt(5_000, 300), "max_tokens": 300})
    assert status == 400 and "context length" in answer["error"]["message"]
    assert counters(stack.proxy_url, "r0") == before
    assert outcomes(stack.proxy_url, "client_error") == errors + 1


def test_an_engine_failure_counts_nothing(stack: FullStack) -> None:
    """An engine's 500 (a fault the simulator injects) where a hit was predicted; the
    same request answered next is counted whole."""
    body = {"prompt": prompt(6_000, 160), "max_tokens": 1}
    assert completion(stack, body)[0] == 200
    before = counters(stack.proxy_url, "r0")
    stack.engines[0].post("/sim/faults", {"fail_requests": 1})
    assert completion(stack, body)[0] == 500
    assert counters(stack.proxy_url, "r0") == before
    assert completion(stack, body)[0] == 200
    after = counters(stack.proxy_url, "r0")
    gained = {name: after[name] - before[name] for name in FIDELITY}
    assert gained == {"prompt_tokens": 160, "predicted_cached_tokens": 144,
                      "measured_cached_tokens": 144, "measured_requests": 1}  # fmt: skip


@pytest.mark.parametrize("stream", [False, True])
def test_a_client_that_goes_away_counts_nothing(stack: FullStack, stream: bool) -> None:
    """The client hangs up while the engine runs its request, before any answer (whole)
    or after the first event (stream), where a hit was predicted."""
    sim = stack.engines[0]
    body = {"prompt": prompt(9_000 + 200 * stream, 96), "max_tokens": 1}
    assert completion(stack, body)[0] == 200
    before = counters(stack.proxy_url, "r0")
    cancelled = outcomes(stack.proxy_url, "cancelled")
    sim.post("/sim/faults", {"delay_ms": 20})
    try:
        _hang_up(
            stack.proxy_url, {"model": MODEL, **body, "max_tokens": 400, "stream": stream}, sim
        )
        wait_for(lambda: outcomes(stack.proxy_url, "cancelled") > cancelled, "the hang-up counted")
    finally:
        sim.post("/sim/faults", {"delay_ms": 0})
    assert outcomes(stack.proxy_url, "cancelled") == cancelled + 1
    assert counters(stack.proxy_url, "r0") == before


class _Refusing(http.server.BaseHTTPRequestHandler):
    """An engine that lists the model and answers every request with ``status`` (an
    engine behind a front server that limits bodies: 413; one not ready: 503)."""

    status = 503

    def do_GET(self) -> None:
        self._send(200, {"object": "list", "data": [{"id": MODEL, "object": "model",
                                                     "owned_by": "vllm"}]})  # fmt: skip

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers["content-length"]))
        error = {"message": "refused", "type": "Refused", "param": None, "code": self.status}
        self._send(self.status, {"error": error})

    def _send(self, status: int, answer: Any) -> None:
        body = json.dumps(answer).encode()
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        pass


@contextmanager
def refusing_replica(status: int) -> Iterator[str]:
    handler = type("Refusing", (_Refusing,), {"status": status})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def test_an_engines_413_counts_nothing() -> None:
    with (
        refusing_replica(413) as refusing,
        ProxyProcess(f"--static-replicas={refusing}") as proxy,
    ):
        replica = replica_id(refusing)
        before = counters(proxy.url, replica)
        body = {"model": MODEL, "prompt": prompt(7_000, 120), "max_tokens": 1}
        for _ in range(2):  # the second one predicted cached (the first was sent there)
            assert proxy.request("/v1/completions", body)[0] == 413
        assert counters(proxy.url, replica) == before
        assert outcomes(proxy.url, "client_error") == 2


def test_a_503_before_the_first_byte_counts_only_where_the_retry_was_answered() -> None:
    """Requests the 503 replica refuses are retried on the simulator, whose counters hold
    all four requests, and the 503 replica's none."""
    with (
        refusing_replica(503) as refusing,
        SimProcess(*SIM_ARGS) as sim,
        ProxyProcess(
            f"--static-replicas={refusing},{sim.url}", "--static-strategy=round_robin"
        ) as proxy,
    ):
        unavailable, serving = replica_id(refusing), replica_id(sim.url)
        body = {"model": MODEL, "prompt": prompt(8_000, 100), "max_tokens": 1}
        for _ in range(4):
            assert proxy.request("/v1/completions", body)[0] == 200
        _, _, text = proxy.request("/metrics", method="GET")
        name = 'kvroute_proxy_retries_total{reason="status_503"}'
        retried = [line for line in text.decode().splitlines() if line.startswith(name)]
        assert retried and float(retried[0].rsplit(" ", 1)[1]) >= 1
        assert counters(proxy.url, unavailable) == dict.fromkeys(FIDELITY, 0.0)
        assert counters(proxy.url, serving)["prompt_tokens"] == 400


def _hang_up(url: str, body: dict[str, Any], sim: SimProcess) -> None:
    """Send ``body``; close the connection once the engine runs it (a stream: after its
    first event)."""
    address = urlsplit(url)
    connection = http.client.HTTPConnection(address.hostname or "", address.port, timeout=30)
    with ExitStack() as stack:
        stack.callback(connection.close)
        connection.request("POST", "/v1/completions", json.dumps(body),
                           {"content-type": "application/json"})  # fmt: skip
        if body["stream"]:
            assert connection.getresponse().readline().startswith(b"data: ")
        wait_for(lambda: sim.metric("vllm:num_requests_running") == 1, "the engine running it")
