"""deploy/kubernetes without a cluster: every kustomization renders, every object is
valid against the Kubernetes schemas (strict: an unknown field is an error), and the
overlays hold what a platform engineer relies on (HA counts, volumes, budgets, probes,
resources, pod security, no API access, who may reach whom)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import pytest
import yaml

from dataplane.main import build_parser as build_proxy_parser
from tests.unit.deploy.manifests import (
    KUBERNETES,
    containers,
    find,
    kustomizations,
    name_of,
    overlays,
    pod_of,
    render,
    workloads,
)
from tests.unit.deploy.network_policy import OUTSIDE, Pod, allowed
from tests.unit.deploy.schemas import problems

OLDEST_KUBERNETES = "1.30.0"
NEWEST_KUBERNETES = "1.37.0"
CRD_KINDS = {"Certificate", "Issuer"}  # cert-manager's, checked in test_webhook
# Gateway API's, its Inference Extension's and Envoy Gateway's: test_endpoint_picker
CRD_KINDS |= {"InferencePool", "InferenceObjective", "Gateway", "HTTPRoute", "Backend",
              "EnvoyExtensionPolicy"}  # fmt: skip
ENGINE = {"http": 8000, "kvroute-sidecar": 9100}  # an engine pod's named ports


def ids(paths: list[Path]) -> list[str]:
    return [str(p.relative_to(KUBERNETES)) for p in paths]


def validate(doc: dict[str, Any], version: str) -> None:
    found = problems(doc, version)
    assert not found, f"{name_of(doc)} is not a valid {doc['kind']}: {found}"


@pytest.mark.parametrize("directory", kustomizations(), ids=ids(kustomizations()))
def test_every_kustomization_renders_valid_objects(directory: Path) -> None:
    docs = render(directory)
    assert docs
    names = [name_of(d) for d in docs]
    assert len(names) == len(set(names)), "an object is rendered twice"
    for doc in docs:
        if doc["kind"] not in CRD_KINDS:
            validate(doc, OLDEST_KUBERNETES)


@pytest.mark.parametrize("directory", overlays(), ids=ids(overlays()))
def test_overlays_are_valid_on_the_newest_kubernetes(directory: Path) -> None:
    for doc in render(directory):
        if doc["kind"] not in CRD_KINDS:
            validate(doc, NEWEST_KUBERNETES)


@pytest.mark.parametrize("directory", overlays(), ids=ids(overlays()))
def test_nats_and_etcd_are_three_node_clusters(directory: Path) -> None:
    docs = render(directory)
    for name in ("kvroute-nats", "kvroute-etcd"):
        sts = find(docs, "StatefulSet", name)
        assert sts["spec"]["replicas"] == 3
        headless = find(docs, "Service", sts["spec"]["serviceName"])
        assert headless["spec"]["clusterIP"] == "None"
        assert find(docs, "PodDisruptionBudget", name)
    etcd = find(docs, "StatefulSet", "kvroute-etcd")
    (claim,) = etcd["spec"]["volumeClaimTemplates"]
    mounts = containers(pod_of(etcd))[0]["volumeMounts"]
    assert {"name": claim["metadata"]["name"], "mountPath": "/var/lib/etcd"} in mounts
    routes = find(docs, "ConfigMap", "kvroute-nats")["data"]["nats.conf"]
    for node in range(3):
        assert f"kvroute-nats-{node}.kvroute-nats-headless:6222" in routes
    members = {e["name"]: e.get("value") for e in containers(pod_of(etcd))[0]["env"]}
    for node in range(3):
        assert f"kvroute-etcd-{node}=http://kvroute-etcd-{node}." in members["ETCD_INITIAL_CLUSTER"]


@pytest.mark.parametrize("directory", overlays(), ids=ids(overlays()))
def test_every_container_has_resources_and_probes(directory: Path) -> None:
    for workload in workloads(render(directory)):
        for container in containers(pod_of(workload)):
            where = f"{name_of(workload)} {container['name']}"
            resources = container.get("resources", {})
            assert {"cpu", "memory"} <= set(resources.get("requests", {})), where
            assert "memory" in resources.get("limits", {}), where
            assert "readinessProbe" in container, where
            assert "livenessProbe" in container, where


@pytest.mark.parametrize("directory", overlays(), ids=ids(overlays()))
def test_kvroute_namespace_pods_meet_the_restricted_pod_security_standard(
    directory: Path,
) -> None:
    docs = render(directory)
    namespace = find(docs, "Namespace", "kvroute")
    assert namespace["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "restricted"
    for workload in workloads(docs):
        if workload["metadata"]["namespace"] != "kvroute":
            continue
        spec = pod_of(workload)["spec"]
        assert spec["securityContext"]["runAsNonRoot"] is True
        assert spec["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
        for container in spec["containers"]:
            context = container["securityContext"]
            assert context["allowPrivilegeEscalation"] is False
            assert context["capabilities"] == {"drop": ["ALL"]}
            assert context["readOnlyRootFilesystem"] is True


@pytest.mark.parametrize("directory", overlays(), ids=ids(overlays()))
def test_no_workload_can_use_the_kubernetes_api(directory: Path) -> None:
    """kvroute needs no Kubernetes API access: least privilege is no token at all."""
    docs = render(directory)
    accounts = {
        (d["metadata"]["namespace"], d["metadata"]["name"])
        for d in docs
        if d["kind"] == "ServiceAccount"
    }
    for doc in docs:
        assert doc["kind"] not in {"Role", "ClusterRole", "RoleBinding", "ClusterRoleBinding"}
        if doc["kind"] == "ServiceAccount":
            assert doc["automountServiceAccountToken"] is False
    for workload in workloads(docs):
        spec = pod_of(workload)["spec"]
        assert (workload["metadata"]["namespace"], spec["serviceAccountName"]) in accounts
        assert spec["automountServiceAccountToken"] is False


def _pods(docs: tuple[dict[str, Any], ...]) -> dict[str, Pod]:
    found = {}
    for workload in workloads(docs):
        pod = pod_of(workload)
        ports = {
            p["name"]: p["containerPort"]
            for c in containers(pod)
            for p in c.get("ports", [])
            if "name" in p
        }
        labels = pod["metadata"].get("labels", {})
        if labels.get("kvroute.io/inject") == "true":
            ports["kvroute-sidecar"] = 9100  # added by the webhook
        role = labels.get("app.kubernetes.io/component") or "engine"
        found[role] = Pod(pod["metadata"]["namespace"], labels, ports)
    return found


@pytest.mark.parametrize("directory", overlays(), ids=ids(overlays()))
def test_network_policies_let_only_the_right_pods_through(directory: Path) -> None:
    docs = render(directory)
    policies = [d for d in docs if d["kind"] == "NetworkPolicy"]
    pods = _pods(docs)
    monitoring = Pod("monitoring", {"app": "prometheus"})
    stranger = Pod("kvroute", {"app": "debug"})
    etcd, nats, cp, proxy = pods["etcd"], pods["nats"], pods["controlplane"], pods["proxy"]
    engine = pods.get("engine", Pod("kvroute-engines", {"kvroute.io/inject": "true"}, ENGINE))
    expected = [
        # only control planes reach etcd (members reach each other)
        (cp, etcd, 2379, True),
        (etcd, etcd, 2380, True),
        (proxy, etcd, 2379, False),
        (nats, etcd, 2379, False),
        (engine, etcd, 2379, False),
        (stranger, etcd, 2379, False),
        # only sidecars (in engine pods) and control planes reach NATS
        (engine, nats, 4222, True),
        (cp, nats, 4222, True),
        (proxy, nats, 4222, False),
        (stranger, nats, 4222, False),
        (nats, nats, 6222, True),
        (monitoring, nats, 8222, True),
        (monitoring, nats, 4222, False),
        # only proxies reach engines' HTTP port; nobody reaches their ZMQ sockets
        (proxy, engine, engine.ports["http"], True),
        (cp, engine, engine.ports["http"], False),
        (stranger, engine, engine.ports["http"], False),
        (monitoring, engine, 9100, True),
        (OUTSIDE, engine, 5557, False),
        # proxies: reached by anyone, reach only the control planes' gRPC and engines
        (OUTSIDE, proxy, 8000, True),
        (monitoring, proxy, 9090, True),  # /metrics: inside the cluster only
        (OUTSIDE, proxy, 9090, False),
        (proxy, cp, 50051, True),
        (engine, cp, 50051, False),
        (stranger, cp, 50051, False),
        (OUTSIDE, cp, 8080, True),  # the API server calls the webhook
        # only control planes reach the database
        (cp, OUTSIDE, 5432, True),
        (proxy, OUTSIDE, 5432, False),
        (nats, OUTSIDE, 5432, False),
        (etcd, OUTSIDE, 5432, False),
    ]
    if "postgres" in pods:
        postgres = pods["postgres"]
        expected += [(cp, postgres, 5432, True), (proxy, postgres, 5432, False)]
        expected += [(engine, postgres, 5432, False), (stranger, postgres, 5432, False)]
    wrong = [
        f"{src.labels} -> {dst.labels}:{port} should be {'open' if ok else 'closed'}"
        for src, dst, port, ok in expected
        if allowed(policies, src, dst, port) is not ok
    ]
    assert wrong == []


def test_the_schema_check_refuses_unknown_fields_and_wrong_types() -> None:
    sts = find(render(KUBERNETES / "base" / "etcd"), "StatefulSet", "kvroute-etcd")
    broken = {**sts, "spec": {**sts["spec"], "replicas": "3", "replicaz": 3}}
    found = problems(broken, OLDEST_KUBERNETES)
    assert any("replicaz" in p for p in found)
    assert any(p.startswith("spec/replicas") for p in found)


@pytest.mark.parametrize("directory", overlays(), ids=ids(overlays()))
def test_every_service_reaches_a_port_its_pods_open(directory: Path) -> None:
    docs = render(directory)
    pods = [pod_of(w) for w in workloads(docs)]
    for service in (d for d in docs if d["kind"] == "Service"):
        if service["spec"].get("type") == "ExternalName":
            continue  # a name for another Service (test_endpoint_picker)
        selector = service["spec"]["selector"]
        namespace = service["metadata"]["namespace"]
        selected = [
            p
            for p in pods
            if p["metadata"]["namespace"] == namespace
            and selector.items() <= p["metadata"].get("labels", {}).items()
        ]
        assert selected, f"{name_of(service)} selects no pod"
        for port in service["spec"]["ports"]:
            target = port.get("targetPort", port["port"])
            for pod in selected:
                opened = {
                    value
                    for c in containers(pod)
                    for p in c.get("ports", [])
                    for value in (p["containerPort"], p.get("name"))
                }
                assert target in opened, f"{name_of(service)} port {target}"


@pytest.mark.parametrize("directory", overlays(), ids=ids(overlays()))
def test_the_proxies_sit_behind_an_l4_service_without_session_affinity(directory: Path) -> None:
    service = find(render(directory), "Service", "kvroute-proxy")
    assert service["spec"]["sessionAffinity"] == "None"
    expected = "NodePort" if directory.name == "kind" else "LoadBalancer"
    assert service["spec"]["type"] == expected
    for kind in ("Deployment", "PodDisruptionBudget", "HorizontalPodAutoscaler"):
        assert find(render(directory), kind, "kvroute-proxy")
    control = find(render(directory), "Deployment", "kvroute-controlplane")
    assert control["spec"]["replicas"] == 2
    assert find(render(directory), "PodDisruptionBudget", "kvroute-controlplane")["spec"] == {
        "minAvailable": 1,
        "selector": {"matchLabels": {"app.kubernetes.io/component": "controlplane"}},
    }


@pytest.mark.parametrize("directory", overlays(), ids=ids(overlays()))
def test_a_proxy_pod_stopping_lets_its_streams_finish_before_kubernetes_kills_it(
    directory: Path,
) -> None:
    """The pod's grace covers the preStop sleep (leaving the load balancer) plus the
    proxy's own ``--shutdown-grace-s``: otherwise SIGKILL cuts streams the proxy meant to
    let finish."""
    pod = pod_of(find(render(directory), "Deployment", "kvroute-proxy"))
    (proxy,) = [c for c in containers(pod) if c["name"] == "proxy"]
    args = dict(a[2:].split("=", 1) for a in proxy["args"] if a.startswith("--") and "=" in a)
    pre_stop = proxy["lifecycle"]["preStop"]["sleep"]["seconds"]
    grace = float(args.get("shutdown-grace-s", 30.0))
    assert pod["spec"]["terminationGracePeriodSeconds"] > pre_stop + grace


def secrets_named(pod: dict[str, Any]) -> set[tuple[str, bool]]:
    """(Secret name, optional) of every Secret a pod reads."""
    named = set()
    for container in containers(pod):
        for entry in container.get("env", []):
            ref = entry.get("valueFrom", {}).get("secretKeyRef")
            if ref:
                named.add((ref["name"], bool(ref.get("optional"))))
    for volume in pod["spec"].get("volumes", []):
        if "secret" in volume:
            named.add((volume["secret"]["secretName"], bool(volume["secret"].get("optional"))))
    return named


@pytest.mark.parametrize("directory", overlays(), ids=ids(overlays()))
def test_every_secret_a_pod_needs_is_made_by_the_overlay_or_the_documented_steps(
    directory: Path,
) -> None:
    docs = render(directory)
    made = {d["metadata"]["name"] for d in docs if d["kind"] == "Secret"}
    made |= {d["spec"]["secretName"] for d in docs if d["kind"] == "Certificate"}
    steps = (KUBERNETES.parents[1] / "docs" / "kubernetes.md").read_text()
    documented = (
        {"kvroute-controlplane"} if "secret generic kvroute-controlplane" in steps else set()
    )
    if "deploy/kubernetes/webhook-certs.sh" in steps:
        documented.add("kvroute-controlplane-tls")
    for workload in workloads(docs):
        for name, optional in secrets_named(pod_of(workload)):
            assert optional or name in made | documented, f"{name_of(workload)} needs {name}"


def proxy_flags(directory: Path) -> argparse.Namespace:
    """The rendered proxy container's args as the proxy's own parser reads them (the
    last of --auth / --no-auth wins; the whole settings check is test_crosscheck's)."""
    (container,) = containers(pod_of(find(render(directory), "Deployment", "kvroute-proxy")))
    return build_proxy_parser().parse_args(container["args"])


def test_production_proxies_require_keys_and_keep_metrics_off_the_public_service() -> None:
    production = KUBERNETES / "overlays" / "production"
    flags = proxy_flags(production)
    assert flags.auth is True
    service = find(render(production), "Service", "kvroute-proxy")
    assert [p["targetPort"] for p in service["spec"]["ports"]] == ["http"]
    pod = pod_of(find(render(production), "Deployment", "kvroute-proxy"))
    (container,) = containers(pod)
    http = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert int(flags.metrics_port) == http["metrics"] != http["http"] == int(flags.port)
    assert pod["metadata"]["annotations"]["prometheus.io/port"] == flags.metrics_port


def test_only_the_trusted_component_serves_without_keys() -> None:
    """The kind overlay opts out through components/trusted-no-auth, and says so."""
    kind = KUBERNETES / "overlays" / "kind"
    assert proxy_flags(kind).auth is False
    components = yaml.safe_load((kind / "kustomization.yaml").read_text())["components"]
    assert "../../components/trusted-no-auth" in components
    steps = (KUBERNETES.parents[1] / "docs" / "kubernetes.md").read_text()
    assert "components/trusted-no-auth" in steps  # the opt-out is documented
    assert proxy_flags(KUBERNETES / "base").auth is True
