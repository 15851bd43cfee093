"""The kind overlay without Kubernetes: every kvroute process started with exactly the
arguments and environment the rendered manifests give it, on loopback.

Only what a cluster would resolve is rewritten: Service names become the test's NATS,
etcd, PostgreSQL and control-plane addresses, 0.0.0.0 becomes 127.0.0.1, fixed ports
become free ones, mounted files become the files webhook-certs.sh writes, and the
downward API's pod names and IPs are filled in (and the simulator runs ``--instant``, for
speed; the certificate also names 127.0.0.1, which the proxies dial here instead of the
Service). The control plane then answers the API server's
AdmissionReview for the simulated engine's pod over TLS, the patched pod's sidecar runs
with the environment the webhook gave it, the proxy watches the control plane over TLS,
and a client's request goes through the proxy to the engine. What a platform engineer
notices: the manifests start a working fleet.
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import re
import ssl
import subprocess
import sys
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import aiohttp
import jsonpatch
import pytest

from kvroute.servers import EtcdServer, NatsServer, PostgresServer
from tests.e2e.fullstack import wait_for
from tests.e2e.proxyproc import ControlPlaneProcess, ProxyProcess
from tests.unit.deploy.manifests import KUBERNETES, containers, find, pod_of, render
from tests.unit.enginesim.simproc import SimProcess, cached_tokens

pytestmark = [pytest.mark.e2e, pytest.mark.integration]

BIN = Path(sys.executable).parent
KIND = KUBERNETES / "overlays" / "kind"
SERVICE_NAME = "kvroute-controlplane.kvroute.svc"  # what the API server dials and checks
POD_IP = "127.0.0.1"  # every pod's address here: the other processes reach it on loopback
IN_CLUSTER_ADDRESS = re.compile(r"kvroute-[a-z0-9-]+(\.[a-z0-9.-]+)?:\d+")


class Cluster:
    """What the cluster would resolve, as this machine's addresses."""

    def __init__(self, nats: str, etcd: str, certs: Path) -> None:
        self.replacements = {
            "0.0.0.0": "127.0.0.1",
            "nats://kvroute-nats.kvroute.svc:4222": nats,
            "nats://kvroute-nats:4222": nats,
            "/etc/kvroute/tls/": f"{certs}/",
            "/etc/kvroute/controlplane-ca/": f"{certs}/",
            "--admin-port=8080": "--admin-port=0",
            "--grpc-port=50051": "--grpc-port=0",
            "--port=8000": "--port=0",
            "--metrics-port=9090": "--metrics-port=0",
        }
        etcd_members = ",".join(f"kvroute-etcd-{i}.kvroute-etcd-headless:2379" for i in range(3))
        self.replacements[etcd_members] = etcd

    def resolve(self, value: str) -> str:
        for cluster_name, local in self.replacements.items():
            value = value.replace(cluster_name, local)
        unresolved = IN_CLUSTER_ADDRESS.search(value)
        assert unresolved is None, f"an in-cluster address the test cannot reach: {value}"
        return value


def environment(container: dict[str, Any], pod_name: str, secrets: dict[str, str]) -> dict:
    """The container's env as the kubelet sets it (Secrets from the overlay's own)."""
    env = {}
    for entry in container.get("env", []):
        source = entry.get("valueFrom", {})
        if "value" in entry:
            env[entry["name"]] = str(entry["value"])
        elif source.get("fieldRef", {}).get("fieldPath") == "metadata.name":
            env[entry["name"]] = pod_name
        elif source.get("fieldRef", {}).get("fieldPath") == "status.podIP":
            env[entry["name"]] = POD_IP
        else:
            env[entry["name"]] = secrets[source["secretKeyRef"]["key"]]
    return env


def overlay_secret(docs: tuple[dict[str, Any], ...], prefix: str) -> dict[str, str]:
    (secret,) = [
        d for d in docs if d["kind"] == "Secret" and d["metadata"]["name"].startswith(prefix)
    ]
    return {k: base64.b64decode(v).decode() for k, v in secret["data"].items()}


def admit(url: str, ca: Path, pod: dict[str, Any]) -> dict[str, Any]:
    """POST the pod's AdmissionReview as the API server does: TLS, the Service's name."""
    review = {
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "request": {"uid": "kind-1", "operation": "CREATE", "object": pod},
    }
    context = ssl.create_default_context(cafile=str(ca))

    async def post() -> dict[str, Any]:
        async with (
            aiohttp.ClientSession() as http,
            http.post(
                f"{url}/mutate", json=review, ssl=context, server_hostname=SERVICE_NAME
            ) as answer,
        ):
            assert answer.status == 200
            return dict(await answer.json())

    return asyncio.run(post())


@pytest.fixture(scope="module")
def fleet(
    nats_server: NatsServer,
    etcd_server: EtcdServer,
    postgres_server: PostgresServer,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[ProxyProcess, dict[str, Any]]]:
    docs = render(KIND)
    certs = tmp_path_factory.mktemp("tls")
    made = subprocess.run(
        ["bash", str(KUBERNETES / "webhook-certs.sh"), "--out", str(certs)],
        capture_output=True,
        text=True,
        timeout=60,
        env=os.environ | {"EXTRA_SANS": "IP:127.0.0.1"},  # the proxy dials loopback here
    )
    assert made.returncode == 0, made.stderr
    cluster = Cluster(nats_server.url, etcd_server.endpoint, certs)
    secrets = overlay_secret(docs, "kvroute-controlplane")
    assert secrets["database-url"].startswith("postgresql+asyncpg://")
    secrets["database-url"] = postgres_server.url()
    with ExitStack() as stack:
        control = pod_of(find(docs, "Deployment", "kvroute-controlplane"))
        (cp_container,) = containers(control)
        cp = stack.enter_context(
            ControlPlaneProcess(
                *[cluster.resolve(arg) for arg in cp_container["args"]],
                "--etcd-prefix=/kind-overlay/",
                env=environment(cp_container, "kvroute-controlplane-0", secrets),
            )
        )
        assert cp.url.startswith("https://")
        answer = admit(cp.url, certs / "ca.crt", pod_of(find(docs, "Deployment", "kvroute-sim")))
        patch = json.loads(base64.b64decode(answer["response"]["patch"]))
        pod = jsonpatch.apply_patch(pod_of(find(docs, "Deployment", "kvroute-sim")), patch)
        engine, sidecar = containers(pod)
        sim_args = [cluster.resolve(a) for a in engine["args"]]
        sim_args[sim_args.index("--port") + 1] = "0"
        sim = stack.enter_context(SimProcess(*sim_args, "--instant", "--model=kvroute/sim-model"))
        start_sidecar(stack, sidecar, sim, cluster)
        proxy_pod = pod_of(find(docs, "Deployment", "kvroute-proxy"))
        (proxy_container,) = containers(proxy_pod)
        cluster.replacements["kvroute-controlplane:50051"] = cp.grpc
        proxy = stack.enter_context(
            ProxyProcess(
                *[cluster.resolve(arg) for arg in proxy_container["args"]],
                env=environment(proxy_container, "kvroute-proxy-0", {}),
            )
        )
        wait_for(lambda: readiness(proxy).get("replicas") == 1, "the sim in the proxy")
        yield proxy, pod


def start_sidecar(
    stack: ExitStack, container: dict[str, Any], sim: SimProcess, cluster: Cluster
) -> None:
    """The injected sidecar with the webhook's environment, pointed at this sim."""
    env = environment(container, "kvroute-sim-0", {})
    env = {name: cluster.resolve(value) for name, value in env.items()}
    assert env["KVROUTE_ENGINE_URL"] == "http://127.0.0.1:8100"
    env["KVROUTE_ENGINE_URL"] = sim.url
    env["KVROUTE_KV_EVENTS_ENDPOINT"] = sim.events
    env["KVROUTE_REPLAY_ENDPOINT"] = sim.replay
    env["KVROUTE_PORT"] = "0"
    base = {k: v for k, v in os.environ.items() if not k.startswith("KVROUTE_")}
    proc = subprocess.Popen(
        [str(BIN / "kvroute-sidecar")],
        env=base | env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )

    def stop() -> None:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    stack.callback(stop)


def readiness(proxy: ProxyProcess) -> dict[str, Any]:
    _, _, body = proxy.request("/readyz", method="GET")
    return dict(json.loads(body))


def test_the_manifests_start_a_fleet_that_serves_and_caches(fleet: Any) -> None:
    proxy, pod = fleet
    assert [c["name"] for c in containers(pod)] == ["sim", "kvroute-sidecar"]
    system = "You answer in one line, briefly and politely, every time you are asked. " * 40
    cached = 0
    for i in range(20):
        body = {
            "model": "kvroute/sim-model",
            "messages": [
                {"role": "system", "content": system},
                {"role": "user", "content": f"Question {i}?"},
            ],
            "max_tokens": 2,
        }
        status, _, raw = proxy.request("/v1/chat/completions", body)
        assert status == 200, raw
        answer = json.loads(raw)
        assert answer["choices"][0]["message"]["content"]
        cached = cached_tokens(answer["usage"])
        if cached:
            break
    assert cached > 0  # the engine's cache is used through the proxy
