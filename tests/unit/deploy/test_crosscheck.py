"""Nothing in deploy/ names a flag, environment variable, port, probe path or metric that
kvroute does not have.

Every kvroute container of every rendered kustomization (and every sidecar the webhook
injects into the engine pods there) is started the way its component's ``main`` starts:
its args go through the component's own flag parser and its ``KVROUTE_*`` environment
through its settings class, so an unknown flag, an unknown variable or a bad value fails
here. Its container ports must be ports the settings make it listen on, and its probes
and Prometheus annotations must name routes its HTTP app really serves.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import io
import json
import socket
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast
from urllib.parse import urlsplit

import pytest
from pydantic import BaseModel

from controlplane.admission.injection import InjectionConfig, mutate_review
from controlplane.main import load_settings as load_controlplane_settings
from controlplane.service import ControlPlane
from controlplane.settings import ControlPlaneSettings
from dataplane.epp.main import load_settings as load_epp_settings
from dataplane.epp.service import METRICS_PAGES as EPP_PAGES
from dataplane.epp.settings import EppSettings
from dataplane.main import load_settings as load_proxy_settings
from dataplane.service import ProxyService
from dataplane.settings import ProxySettings
from dataplane.transport.server import HttpServer
from enginesim.http import SimApp
from enginesim.settings import SimSettings, parse_settings
from sidecar.main import load_settings as load_sidecar_settings
from sidecar.observability import create_app as create_sidecar_app
from sidecar.service import SidecarService
from sidecar.settings import SidecarSettings
from tests.unit.deploy.manifests import (
    KUBERNETES,
    containers,
    find,
    image_repository,
    kustomizations,
    name_of,
    overlays,
    pod_of,
    render,
    workloads,
)
from tests.unit.deploy.schemas import problems

SIDECAR_IMAGE = "kvroute/sidecar:0.1.0"
TLS_SECRET_KEYS = {"tls.crt", "tls.key", "ca.crt"}  # kubernetes.io/tls, and cert-manager's
PLACEHOLDERS = tempfile.TemporaryDirectory(prefix="kvroute-deploy-")
INJECTION = InjectionConfig(sidecar_image=SIDECAR_IMAGE, nats_url="nats://kvroute-nats:4222")


@dataclass(frozen=True)
class Component:
    settings_class: type[BaseModel]
    load: Callable[[list[str]], Any]  # the component's own argv -> settings
    serves: Callable[[Any, int, str], bool]  # (settings, port, path) -> an HTTP route there?
    ports: Callable[[Any], set[int]]  # settings -> TCP ports listened on


def sim_serves(settings: SimSettings, port: int, path: str) -> bool:
    return path in SimApp(settings, cast(Any, None), cast(Any, None)).routes


def sidecar_serves(settings: SidecarSettings, port: int, path: str) -> bool:
    app = create_sidecar_app(SidecarService(settings))
    return any(route.resource and route.resource.canonical == path for route in app.router.routes())


def proxy_serves(settings: ProxySettings, port: int, path: str) -> bool:
    """Asks the proxy's app (not started: no upstream, no state) for ``path`` through the
    proxy's own HTTP server on a loopback port (``--metrics-port`` has its own handler)."""
    app = ProxyService(settings).app
    handler = app.serve_metrics if port == settings.metrics_port else app
    return asyncio.run(proxy_get(handler, path)) != 404


async def proxy_get(app: Any, path: str) -> int:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    server = HttpServer(app, max_body_bytes=1024)
    await server.start(sock)
    try:
        reader, writer = await asyncio.open_connection(*sock.getsockname())
        writer.write(f"GET {path} HTTP/1.1\r\nhost: t\r\nconnection: close\r\n\r\n".encode())
        status_line = await reader.readline()
        writer.close()
        await writer.wait_closed()
        return int(status_line.split()[1])
    finally:
        await server.aclose()


def controlplane_serves(settings: ControlPlaneSettings, port: int, path: str) -> bool:
    """Asks the admin app the control plane serves (built, not started) for ``path``."""
    return asgi_get(ControlPlane(settings).admin_app(), path) != 404


def asgi_get(app: Any, path: str) -> int:
    statuses: list[int] = []

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            statuses.append(message["status"])

    scope = {"type": "http", "method": "GET", "path": path, "headers": [], "query_string": b""}
    asyncio.run(app(scope, receive, send))
    return statuses[0]


COMPONENTS: dict[str, Component] = {
    "kvroute/sim": Component(SimSettings, parse_settings, sim_serves, lambda s: {s.port}),
    "kvroute/sidecar": Component(
        SidecarSettings, load_sidecar_settings, sidecar_serves, lambda s: {s.port}
    ),
    "kvroute/controlplane": Component(
        ControlPlaneSettings,
        load_controlplane_settings,
        controlplane_serves,
        lambda s: {s.admin_port, s.grpc_port},
    ),
    "kvroute/epp": Component(
        EppSettings,
        load_epp_settings,
        lambda settings, port, path: port == settings.metrics_port and path in EPP_PAGES,
        lambda s: {s.grpc_port, s.health_port, s.metrics_port},
    ),
    "kvroute/proxy": Component(
        ProxySettings,
        load_proxy_settings,
        proxy_serves,
        lambda s: {s.port} | ({s.metrics_port} if s.metrics_port is not None else set()),
    ),
}


def inject(pod: dict[str, Any]) -> dict[str, Any]:
    """The pod as the API server stores it after the webhook's patch."""
    import jsonpatch

    review = {"request": {"uid": "u", "operation": "CREATE", "object": pod}}
    response = mutate_review(review, INJECTION)["response"]
    if "patch" not in response:
        return pod
    return cast(
        dict[str, Any], jsonpatch.apply_patch(pod, json.loads(base64.b64decode(response["patch"])))
    )


def env_values(container: dict[str, Any], pod_name: str) -> dict[str, str]:
    """The container's environment as the kubelet would set it (secrets as placeholders)."""
    values = {}
    for entry in container.get("env", []):
        if "value" in entry:
            values[entry["name"]] = str(entry["value"])
        elif entry.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath") == "metadata.name":
            values[entry["name"]] = pod_name
        else:
            values[entry["name"]] = "from-a-secret"
    return values


def flags_in(args: list[str]) -> list[str]:
    """Setting names of the ``--flag`` / ``--flag=value`` in ``args``."""
    names = []
    for arg in args:
        if arg.startswith("--"):
            name = arg[2:].split("=", 1)[0].replace("-", "_")
            names.append(name)
    return names


def resolve_port(container: dict[str, Any], port: object) -> int | None:
    for entry in container.get("ports", []):
        if port in (entry.get("name"), entry["containerPort"]):
            return int(entry["containerPort"])
    return None


def mounted(pod: dict[str, Any], container: dict[str, Any], value: str, found: list[str]) -> str:
    """``value`` with a path into one of the container's mounted Secrets or ConfigMaps
    moved to a placeholder file (the kubelet would have put the real one there)."""
    volumes = {v["name"]: v for v in pod["spec"].get("volumes", [])}
    for mount in container.get("volumeMounts", []):
        prefix = mount["mountPath"].rstrip("/") + "/"
        if prefix not in value:
            continue
        source = volumes[mount["name"]]
        if "secret" not in source and "configMap" not in source:
            found.append(f"{value}: {mount['name']} is not a Secret or ConfigMap")
        name = value.split(prefix, 1)[1].split(",")[0]
        tls = source.get("secret", {}).get("secretName", "").endswith("-tls")
        if tls and name not in TLS_SECRET_KEYS:
            found.append(f"{value}: a TLS Secret has no key {name}")
        placeholder = Path(PLACEHOLDERS.name) / mount["name"]
        placeholder.mkdir(exist_ok=True)
        (placeholder / name).write_text("placeholder")
        return value.replace(prefix, str(placeholder) + "/")
    return value


def check_container(
    container: dict[str, Any], pod: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> tuple[list[str], Callable[[int, str], bool]]:
    """Problems with one kvroute container, and what tells whether it serves a path."""
    component = COMPONENTS[image_repository(container)]
    found: list[str] = []
    env = {
        name: mounted(pod, container, value, found)
        for name, value in env_values(container, pod["metadata"]["name"]).items()
    }
    for name in env:
        field = name.removeprefix("KVROUTE_").lower()
        if name.startswith("KVROUTE_") and field not in component.settings_class.model_fields:
            found.append(f"env {name}: no setting {field}")
    args = [mounted(pod, container, arg, found) for arg in container.get("args", [])]
    fields = component.settings_class.model_fields
    for flag in flags_in(args):
        if flag not in fields and flag.removeprefix("no_") not in fields:
            found.append(f"flag --{flag.replace('_', '-')}: no setting {flag}")
    with monkeypatch.context() as patch, contextlib.redirect_stderr(io.StringIO()) as err:
        for name, value in env.items():
            patch.setenv(name, value)
        try:
            settings = component.load(args)
        except (Exception, SystemExit) as exc:
            refused = f"args/env refused by the component: {exc} {err.getvalue()[-300:]}"
            return [*found, refused], lambda port, path: True

    def serves(port: int, path: str) -> bool:
        return component.serves(settings, port, path)

    listening = component.ports(settings)
    for entry in container.get("ports", []):
        if entry["containerPort"] not in listening:
            found.append(f"containerPort {entry['containerPort']} not in {listening}")
    for probe_name in ("startupProbe", "readinessProbe", "livenessProbe"):
        action = container.get(probe_name, {})
        probe = action.get("httpGet") or action.get("tcpSocket")
        if probe is None:
            continue
        port = resolve_port(container, probe["port"])
        if "path" in probe and port is not None and not serves(port, probe["path"].split("?")[0]):
            found.append(f"{probe_name} path {probe['path']} is not a route")
        if port not in listening:
            found.append(f"{probe_name} port {probe['port']} is not listened on")
    return found, serves


def check_pod(pod: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> list[str]:
    found = []
    served: dict[int, Callable[[int, str], bool]] = {}
    for container in containers(pod):
        repository = image_repository(container)
        if repository not in COMPONENTS:
            if repository.startswith("kvroute/"):
                found.append(f"{container['name']}: no kvroute component ships {repository}")
            continue
        own, serves = check_container(container, pod, monkeypatch)
        found += [f"{container['name']}: {problem}" for problem in own]
        for entry in container.get("ports", []):
            served[int(entry["containerPort"])] = serves
    annotations = pod["metadata"].get("annotations", {})
    if annotations.get("prometheus.io/scrape") == "true":
        port = int(annotations["prometheus.io/port"])
        ports = {p["containerPort"] for c in containers(pod) for p in c.get("ports", [])}
        if port not in ports:
            found.append(f"prometheus.io/port {port} is not a container port")
        path = annotations.get("prometheus.io/path", "/metrics")
        if port in served and not served[port](port, path):
            found.append(f"prometheus.io/path {path} is not a route on port {port}")
    return found


def kvroute_pods(directory: Path) -> list[tuple[str, dict[str, Any]]]:
    pods = []
    for workload in workloads(render(directory)):
        pod = inject(pod_of(workload))
        pods.append((name_of(workload), pod))
    return pods


@pytest.mark.parametrize(
    "directory", kustomizations(), ids=[str(p.relative_to(KUBERNETES)) for p in kustomizations()]
)
def test_kvroute_containers_start_with_what_deploy_gives_them(
    directory: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name, pod in kvroute_pods(directory):
        assert check_pod(pod, monkeypatch) == [], name


@pytest.mark.parametrize("engines", ["engines/vllm", "engines/sglang", "engines/sim"])
def test_injected_engine_pods_are_valid_pods_with_a_working_sidecar(
    engines: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name, pod in kvroute_pods(KUBERNETES / engines):
        sidecars = [c for c in containers(pod) if c["name"] == "kvroute-sidecar"]
        assert len(sidecars) == 1, name
        assert sidecars[0]["image"] == SIDECAR_IMAGE
        assert problems(pod, "1.30.0") == [], name
        assert check_pod(pod, monkeypatch) == [], name
        # termination drains: proxies are told, the engine serves meanwhile, the grace covers it
        env = {e["name"]: e.get("value") for e in sidecars[0]["env"]}
        assert env["KVROUTE_DRAIN_S"] == "30", name
        engine = containers(pod)[0]
        assert engine["lifecycle"]["preStop"] == {"exec": {"command": ["sleep", "30"]}}, name
        assert pod["spec"]["terminationGracePeriodSeconds"] >= 60, name


def test_the_crosscheck_catches_what_the_code_does_not_have(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    (_, pod), *_ = kvroute_pods(KUBERNETES / "engines" / "sim")
    sim, sidecar = containers(pod)
    sim["args"] = [*sim["args"], "--no-such-flag", "1"]
    sim["readinessProbe"]["httpGet"]["path"] = "/ready"
    sidecar["env"].append({"name": "KVROUTE_NATS_URLS", "value": "x"})
    sidecar["ports"][0]["containerPort"] = 9101
    pod["metadata"]["annotations"]["prometheus.io/path"] = "/stats"
    found = check_pod(pod, monkeypatch)
    assert any("flag --no-such-flag: no setting" in p for p in found), found
    assert any("sim: args/env refused" in p and "--no-such-flag" in p for p in found), found
    assert any("KVROUTE_NATS_URLS" in p for p in found), found
    assert any("containerPort 9101" in p for p in found), found
    assert any("kvroute-sidecar: livenessProbe port 9100" in p for p in found), found
    pod_ok = kvroute_pods(KUBERNETES / "engines" / "sim")[0][1]
    containers(pod_ok)[0]["readinessProbe"]["httpGet"]["path"] = "/ready"
    pod_ok["metadata"]["annotations"]["prometheus.io/path"] = "/stats"
    found = check_pod(pod_ok, monkeypatch)
    assert any("readinessProbe path /ready" in p for p in found), found
    assert any("prometheus.io/path /stats" in p for p in found), found


@pytest.mark.parametrize("directory", overlays(), ids=[p.name for p in overlays()])
def test_the_webhook_path_is_served_and_injects_what_deploy_ships(
    directory: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    docs = render(directory)
    (config,) = [d for d in docs if d["kind"] == "MutatingWebhookConfiguration"]
    path = config["webhooks"][0]["clientConfig"]["service"]["path"]
    pod = pod_of(find(docs, "Deployment", "kvroute-controlplane"))
    (container,) = containers(pod)
    problems_found, serves = check_container(container, pod, monkeypatch)
    assert problems_found == []
    assert serves(resolve_port(container, "admin") or 0, path)
    args = dict(arg[2:].split("=", 1) for arg in container["args"])
    assert image_repository({"image": args["inject-sidecar-image"]}) == "kvroute/sidecar"
    assert float(args["inject-drain-s"]) == INJECTION.drain_s  # what the test injects
    nats = urlsplit(args["inject-nats-url"])
    service, namespace, *_ = str(nats.hostname).split(".")
    nats_service = find(docs, "Service", service)
    assert nats_service["metadata"]["namespace"] == namespace
    assert nats.port in {p["port"] for p in nats_service["spec"]["ports"]}
