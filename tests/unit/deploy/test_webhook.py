"""The sidecar-injection webhook as deployed: the MutatingWebhookConfiguration points at
the control plane's admin port and never blocks pods, and both ways of getting its
certificate (cert-manager, webhook-certs.sh) produce one the API server will trust for
the control plane's Service name."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path
from typing import Any

import pytest

from tests.unit.deploy.manifests import KUBERNETES, containers, find, overlays, pod_of, render

SCRIPT = KUBERNETES / "webhook-certs.sh"


def webhook(docs: tuple[dict[str, Any], ...]) -> dict[str, Any]:
    (config,) = [d for d in docs if d["kind"] == "MutatingWebhookConfiguration"]
    (hook,) = config["webhooks"]
    return dict(hook, metadata=config["metadata"])


@pytest.mark.parametrize("directory", overlays(), ids=[p.name for p in overlays()])
def test_the_webhook_never_blocks_pods_and_sees_only_labelled_ones(directory: Path) -> None:
    hook = webhook(render(directory))
    assert hook["failurePolicy"] == "Ignore"
    assert hook["sideEffects"] == "None"
    assert hook["admissionReviewVersions"] == ["v1"]
    assert hook["timeoutSeconds"] <= 10
    assert hook["objectSelector"] == {"matchLabels": {"kvroute.io/inject": "true"}}
    (rule,) = hook["rules"]
    assert rule["operations"] == ["CREATE"] and rule["resources"] == ["pods"]
    excluded = hook["namespaceSelector"]["matchExpressions"][0]
    assert excluded["operator"] == "NotIn" and "kube-system" in excluded["values"]


@pytest.mark.parametrize("directory", overlays(), ids=[p.name for p in overlays()])
def test_the_webhook_calls_the_control_planes_admin_port(directory: Path) -> None:
    docs = render(directory)
    target = webhook(docs)["clientConfig"]["service"]
    assert target["path"] == "/mutate"
    service = find(docs, "Service", target["name"])
    assert service["metadata"]["namespace"] == target["namespace"]
    (port,) = [p for p in service["spec"]["ports"] if p["port"] == target["port"]]
    deployment = find(docs, "Deployment", "kvroute-controlplane")
    assert service["spec"]["selector"].items() <= pod_of(deployment)["metadata"]["labels"].items()
    (container,) = containers(pod_of(deployment))
    named = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert named[port["targetPort"]] == 8080


def test_cert_manager_issues_the_certificate_the_webhook_trusts() -> None:
    docs = render(KUBERNETES / "overlays" / "production")
    annotation = webhook(docs)["metadata"]["annotations"]["cert-manager.io/inject-ca-from"]
    namespace, name = annotation.split("/")
    certificate = find(docs, "Certificate", name)
    assert certificate["metadata"]["namespace"] == namespace
    assert certificate["apiVersion"] == "cert-manager.io/v1"
    issuer = find(docs, "Issuer", certificate["spec"]["issuerRef"]["name"])
    assert issuer["metadata"]["namespace"] == namespace
    assert issuer["spec"] == {"selfSigned": {}}
    target = webhook(docs)["clientConfig"]["service"]
    assert f"{target['name']}.{target['namespace']}.svc" in certificate["spec"]["dnsNames"]
    deployment = find(docs, "Deployment", "kvroute-controlplane")
    mounted = {
        v["secret"]["secretName"] for v in pod_of(deployment)["spec"]["volumes"] if "secret" in v
    }
    assert certificate["spec"]["secretName"] in mounted


def script_setting(name: str) -> str:
    match = re.search(rf"^{name}=(\S+)$", SCRIPT.read_text(), re.MULTILINE)
    assert match, f"webhook-certs.sh sets no {name}"
    return match.group(1)


def test_the_script_names_what_the_manifests_name() -> None:
    docs = render(KUBERNETES / "overlays" / "kind")
    target = webhook(docs)["clientConfig"]["service"]
    assert script_setting("namespace") == target["namespace"]
    assert script_setting("service") == target["name"]
    deployment = find(docs, "Deployment", "kvroute-controlplane")
    mounted = {
        v["secret"]["secretName"] for v in pod_of(deployment)["spec"]["volumes"] if "secret" in v
    }
    assert script_setting("secret") in mounted
    config = next(d for d in docs if d["kind"] == "MutatingWebhookConfiguration")
    assert script_setting("webhook") == config["metadata"]["name"]


def test_the_script_makes_a_certificate_for_the_service_signed_by_its_ca(tmp_path: Path) -> None:
    made = subprocess.run(
        ["bash", str(SCRIPT), "--out", str(tmp_path)], capture_output=True, text=True, timeout=60
    )
    assert made.returncode == 0, made.stderr
    verify = subprocess.run(
        ["openssl", "verify", "-CAfile", tmp_path / "ca.crt", tmp_path / "tls.crt"],
        capture_output=True,
        text=True,
    )
    assert verify.returncode == 0, verify.stdout + verify.stderr
    text = subprocess.run(
        ["openssl", "x509", "-in", tmp_path / "tls.crt", "-noout", "-text"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert "DNS:kvroute-controlplane.kvroute.svc," in text
    assert "TLS Web Server Authentication" in text
    assert (tmp_path / "tls.key").read_text().startswith("-----BEGIN PRIVATE KEY-----")
