"""deploy/'s endpoint-picker shape read structurally: the InferencePool (Gateway API
Inference Extension v1), the pickers, the ExternalName the pool names them by, the
InferenceObjective example and the Envoy Gateway example, each cross-checked against
kvroute-epp's own ports, health services, flags and body modes. (No package ships these
CRDs' schemas: their fields are checked here as the v1 API defines them.)"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from dataplane.epp.main import load_settings
from dataplane.epp.messages import BUFFERED, FULL_DUPLEX, BodyMode
from dataplane.epp.service import HEALTH_SERVICES
from tests.unit.deploy.manifests import KUBERNETES, containers, find, pod_of, render
from tests.unit.deploy.network_policy import Pod, allowed

OVERLAY = KUBERNETES / "overlays" / "gateway-api"
ENVOY_GATEWAY = KUBERNETES / "gateway" / "envoy-gateway"
# Envoy Gateway's names of the ext_proc body modes
EG_BODY_MODES = {"Buffered": BUFFERED, "FullDuplexStreamed": FULL_DUPLEX,
                 "Streamed": BodyMode.STREAMED}  # fmt: skip


def service_named(docs: tuple[dict[str, Any], ...], name: str, namespace: str) -> dict[str, Any]:
    wanted = {"name": name, "namespace": namespace}
    return next(
        d for d in docs if d["kind"] == "Service" and wanted.items() <= d["metadata"].items()
    )


def epp_args(docs: tuple[dict[str, Any], ...]) -> tuple[dict[str, Any], Any]:
    deployment = find(docs, "Deployment", "kvroute-epp")
    [container] = containers(pod_of(deployment))
    # the mounted CA is test_crosscheck's to check (it makes the file)
    args = [a for a in container["args"] if not a.startswith("--controlplane-tls-ca")]
    return container, load_settings(args)


def test_the_pool_selects_the_engines_and_names_the_picker_fail_open() -> None:
    docs = render(OVERLAY)
    pool = find(docs, "InferencePool", "kvroute-engines")
    assert pool["apiVersion"] == "inference.networking.k8s.io/v1"
    spec = pool["spec"]
    assert set(spec) == {"selector", "targetPorts", "endpointPickerRef"}
    # the engines' label: the one the sidecar webhook injects into and their policy guards
    guarded = find(docs, "NetworkPolicy", "kvroute-engines")["spec"]["podSelector"]
    assert spec["selector"] == guarded == {"matchLabels": {"kvroute.io/inject": "true"}}
    ref = spec["endpointPickerRef"]
    assert ref["failureMode"] == "FailOpen" and ref["kind"] == "Service" and ref["group"] == ""
    [number] = [p["number"] for p in spec["targetPorts"]]
    assert number == 8000  # the engines' HTTP port (vLLM's and the simulator's default)
    # the Service the pool names, in its namespace, leads to the pickers' ext_proc port
    namespace = pool["metadata"]["namespace"]
    alias = service_named(docs, ref["name"], namespace)
    assert alias["spec"]["type"] == "ExternalName"
    target_name, target_namespace = alias["spec"]["externalName"].split(".")[:2]
    target = service_named(docs, target_name, target_namespace)
    container, settings = epp_args(docs)
    [port] = [p for p in target["spec"]["ports"] if p["port"] == ref["port"]["number"]]
    named = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert named[port["targetPort"]] == settings.grpc_port
    pod = pod_of(find(docs, "Deployment", "kvroute-epp"))
    assert target["spec"]["selector"].items() <= pod["metadata"]["labels"].items()


def test_the_pickers_probe_their_health_port_and_are_kept_available() -> None:
    docs = render(OVERLAY)
    container, settings = epp_args(docs)
    for probe, service in (("readinessProbe", "readiness"), ("livenessProbe", "liveness")):
        grpc = container[probe]["grpc"]
        assert grpc == {"port": settings.health_port, "service": service}
        assert service in HEALTH_SERVICES
    assert settings.controlplane == ["kvroute-controlplane:50051"]
    assert find(docs, "Deployment", "kvroute-epp")["spec"]["replicas"] >= 2  # no leader
    budget = find(docs, "PodDisruptionBudget", "kvroute-epp")
    assert budget["spec"]["minAvailable"] == 1


def test_the_objective_example_is_one_the_pickers_shed() -> None:
    docs = render(OVERLAY)
    objective = find(docs, "InferenceObjective", "batch")
    assert objective["spec"]["priority"] < 0
    assert objective["spec"]["poolRef"]["name"] == "kvroute-engines"
    _, settings = epp_args(docs)
    assert objective["metadata"]["name"] in settings.sheddable_objectives


def test_the_gateway_reaches_the_pickers_and_the_engines_and_the_pickers_the_control_plane() -> (
    None
):
    docs = render(OVERLAY)
    policies = [d for d in docs if d["kind"] == "NetworkPolicy"]
    gateway = Pod("envoy-gateway-system", {"app.kubernetes.io/name": "envoy"})
    epp = Pod("kvroute", {"app.kubernetes.io/component": "epp"}, {"grpc": 9002, "metrics": 9090})
    engine = Pod("kvroute-engines", {"kvroute.io/inject": "true"}, {"http": 8000})
    cp = Pod("kvroute", {"app.kubernetes.io/component": "controlplane"}, {"grpc": 50051})
    stranger = Pod("kvroute", {"app": "debug"})
    expected = [
        (gateway, epp, 9002, True),
        (gateway, engine, 8000, True),
        (epp, cp, 50051, True),
        (epp, engine, 8000, True),  # the tokenizer probe
        (stranger, epp, 9002, False),
        (gateway, cp, 50051, False),
        (engine, cp, 50051, False),
    ]
    wrong = [
        (s.labels, d.labels, p) for s, d, p, ok in expected if allowed(policies, s, d, p) is not ok
    ]
    assert wrong == []


def test_the_envoy_gateway_example_asks_the_pickers_in_modes_they_take() -> None:
    docs = render(ENVOY_GATEWAY)
    policy = find(docs, "EnvoyExtensionPolicy", "kvroute-epp")
    route = find(docs, "HTTPRoute", "inference")
    backend = find(docs, "Backend", "kvroute-engines")
    assert backend["spec"] == {"type": "HostOverride"}
    [rule] = route["spec"]["rules"]
    assert [(r["kind"], r["name"]) for r in rule["backendRefs"]] == [("Backend", "kvroute-engines")]
    assert policy["spec"]["targetRefs"] == [
        {"group": "gateway.networking.k8s.io", "kind": "HTTPRoute", "name": "inference"}
    ]
    [ext_proc] = policy["spec"]["extProc"]
    assert ext_proc["failOpen"] is True
    modes = ext_proc["processingMode"]
    # request bodies: a mode the picker routes in; the answer: one it passes back
    assert EG_BODY_MODES[modes["request"]["body"]] in (BUFFERED, FULL_DUPLEX)
    assert modes["response"]["body"] in EG_BODY_MODES
    [ref] = ext_proc["backendRefs"]
    overlay = render(OVERLAY)
    _, settings = epp_args(overlay)
    alias = service_named(overlay, ref["name"], policy["metadata"]["namespace"])
    assert ref["port"] in {p["port"] for p in alias["spec"]["ports"]}
    assert ref["port"] == settings.grpc_port


@pytest.mark.parametrize("path", [OVERLAY, ENVOY_GATEWAY], ids=["overlay", "envoy-gateway"])
def test_the_shape_is_described_in_the_docs(path: Path) -> None:
    text = (KUBERNETES.parents[1] / "docs" / "kubernetes.md").read_text()
    assert str(path.relative_to(KUBERNETES.parents[1])) in text
