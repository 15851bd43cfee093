"""Replicas served over HTTPS (vLLM's and SGLang's ``--ssl-keyfile``/``--ssl-certfile``):
the proxy speaks TLS to an ``https://`` replica, checking its certificate against
``--replica-tls-ca`` (else the system's roots), and never falls back to plain HTTP."""

from __future__ import annotations

import json
import ssl
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.e2e.proxyproc import ProxyProcess
from tests.integration.controlplane_harness import server_certificate
from tests.unit.enginesim.simproc import SimProcess

MODEL = "tls-model"


@pytest.fixture(scope="module")
def tls_sim(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[SimProcess, Path]]:
    directory = tmp_path_factory.mktemp("tls")
    ca, cert, key = server_certificate(directory, "127.0.0.1", "localhost")
    ca_path = directory / "ca.pem"
    ca.cert_pem.write_to_path(str(ca_path))
    args = ["--instant", f"--model={MODEL}", f"--ssl-keyfile={key}", f"--ssl-certfile={cert}"]
    with SimProcess(*args) as sim:
        yield sim, ca_path


def over_tls(sim: SimProcess, ca_path: Path, path: str, body: Any = None) -> bytes:
    """The replica's own answer, over TLS trusting the test CA."""
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(
        sim.url + path, data=data, headers={"content-type": "application/json"}
    )
    context = ssl.create_default_context(cafile=str(ca_path))
    with urllib.request.urlopen(request, timeout=30, context=context) as answer:
        return bytes(answer.read())


def answered(sim: SimProcess, ca_path: Path) -> float:
    """Requests the replica answered (its own counter)."""
    text = over_tls(sim, ca_path, "/metrics").decode()
    lines = [line for line in text.splitlines() if line.startswith("vllm:request_success_total")]
    return sum(float(line.rsplit(" ", 1)[1]) for line in lines)


def test_an_https_replica_is_served_over_tls(tls_sim: tuple[SimProcess, Path]) -> None:
    sim, ca_path = tls_sim
    assert sim.url.startswith("https://127.0.0.1:")
    with ProxyProcess(f"--static-replicas={sim.url}", f"--replica-tls-ca={ca_path}") as proxy:
        client = openai.OpenAI(base_url=f"{proxy.url}/v1", api_key="none", max_retries=0)
        try:
            assert [model.id for model in client.models.list()] == [MODEL]  # asked over TLS
            body = {"model": MODEL, "prompt": "Over TLS", "max_tokens": 6, "temperature": 0}
            answer = client.completions.create(**body)
            mine = json.loads(over_tls(sim, ca_path, "/v1/completions", body))
            assert answer.choices[0].text == mine["choices"][0]["text"]
            stream = client.completions.create(**body, stream=True)
            text = "".join(chunk.choices[0].text for chunk in stream if chunk.choices)
            assert text == answer.choices[0].text
        finally:
            client.close()


def test_a_replica_whose_certificate_is_not_trusted_is_not_served(
    tls_sim: tuple[SimProcess, Path],
) -> None:
    """Without the CA the certificate is refused: no answer, and no request in clear."""
    sim, ca_path = tls_sim
    served = answered(sim, ca_path)
    with ProxyProcess(f"--static-replicas={sim.url}") as proxy:
        body = {"model": MODEL, "prompt": "Untrusted", "max_tokens": 2}
        status, _, answer = proxy.request("/v1/completions", body)
    assert status == 503, answer
    assert json.loads(answer)["error"]["code"] == "no_replica"
    assert answered(sim, ca_path) == served
