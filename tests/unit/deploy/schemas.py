"""The Kubernetes JSON schemas that ``kubernetes-validate`` ships, with one validator
built per (version, kind) instead of one per object: the same check as
``kubernetes_validate.validate(doc, version, strict=True)``, fast enough to run on every
rendered object of every kustomization."""

from __future__ import annotations

import functools
import json
import re
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
from referencing import Registry, Resource

SCHEMAS = Path(kubernetes_validate.__file__).parent / "kubernetes-json-schema"


@functools.cache
def _load(path: Path) -> Any:
    return json.loads(path.read_text())


@functools.cache
def _validator(version: str, kind: str, api_version: str) -> jsonschema.Validator:
    folder = SCHEMAS / f"v{version}-local-strict"
    group = re.sub(r"^([^./]*)(?:\.[^/]*)?/", r"\1-", api_version)
    schema_file = folder / f"{kind.lower()}-{group}.json"
    assert schema_file.exists(), f"no schema for {kind} {api_version} in Kubernetes {version}"
    schema = _load(schema_file)
    registry: Registry[Any] = Resource.from_contents(schema) @ Registry()
    registry = Resource.from_contents(_load(folder / "_definitions.json")) @ registry
    return jsonschema.Draft202012Validator(schema, registry=registry)


def problems(doc: dict[str, Any], version: str) -> list[str]:
    """Every way ``doc`` breaks the strict schema of its kind (empty when valid)."""
    validator = _validator(version, doc["kind"], doc["apiVersion"])
    return [
        f"{'/'.join(str(p) for p in error.absolute_path)}: {error.message}"
        for error in validator.iter_errors(doc)
    ]
