"""AdmissionReview fixtures: engine pods as a Deployment would create them, and the
review the API server wraps them in."""

from __future__ import annotations

from typing import Any


def vllm_pod(**annotations: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "generateName": "llama-",
            "labels": {"app": "llama", "kvroute.io/inject": "true"},
            "annotations": {"kvroute.io/model": "meta-llama/Llama-3.1-8B", **annotations},
        },
        "spec": {
            "containers": [
                {
                    "name": "vllm",
                    "image": "vllm/vllm-openai:v0.11.0",
                    "args": ["--model", "/models/llama", "--port", "8000"],
                    "ports": [{"name": "http", "containerPort": 8000}],
                }
            ]
        },
    }


def sglang_pod() -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "qwen-0", "labels": {"kvroute.io/inject": "true"}},
        "spec": {
            "containers": [
                {
                    "name": "sglang",
                    "image": "lmsysorg/sglang:v0.5.2",
                    "command": ["python3", "-m", "sglang.launch_server"],
                    "args": ["--model-path", "Qwen/Qwen2.5-7B", "--port", "30000"],
                }
            ]
        },
    }


def review(pod: object, uid: str = "uid-1", operation: str = "CREATE") -> dict[str, Any]:
    return {
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "request": {
            "uid": uid,
            "kind": {"group": "", "version": "v1", "kind": "Pod"},
            "resource": {"group": "", "version": "v1", "resource": "pods"},
            "namespace": "engines",
            "operation": operation,
            "object": pod,
        },
    }
