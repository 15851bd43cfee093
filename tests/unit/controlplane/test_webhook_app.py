"""``POST /mutate`` in front of the admin app, called the way uvicorn calls it."""

from __future__ import annotations

import json
from typing import Any

from controlplane.admission.injection import InjectionConfig
from controlplane.admission.webhook import MAX_REVIEW_BYTES, with_webhook
from tests.unit.controlplane.admission import review, vllm_pod

CONFIG = InjectionConfig(sidecar_image="kvroute/sidecar:t", nats_url="nats://n:4222")


async def admin_app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    await send({"type": "http.response.start", "status": 204, "headers": []})
    await send({"type": "http.response.body", "body": b""})


async def call(path: str, method: str = "POST", chunks: list[bytes] | None = None) -> Any:
    pending = list(chunks or [b""])
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        body = pending.pop(0)
        return {"type": "http.request", "body": body, "more_body": bool(pending)}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {"type": "http", "method": method, "path": path, "headers": []}
    await with_webhook(admin_app, CONFIG)(scope, receive, send)
    status = sent[0]["status"]
    body = b"".join(m.get("body", b"") for m in sent[1:])
    return status, json.loads(body) if body else None


async def test_a_review_in_several_chunks_is_answered_with_a_patch() -> None:
    raw = json.dumps(review(vllm_pod())).encode()
    status, body = await call("/mutate", chunks=[raw[:100], raw[100:]])
    assert status == 200
    assert body["response"]["allowed"] is True and "patch" in body["response"]


async def test_a_review_nested_past_the_parsers_depth_is_allowed_unpatched() -> None:
    status, body = await call("/mutate", chunks=[b"[" * 100_000])
    assert status == 200
    assert body["response"]["allowed"] is True and "patch" not in body["response"]
    assert body["response"]["warnings"] == [
        "kvroute: the AdmissionReview is not JSON; not injected"
    ]


async def test_an_oversized_review_is_allowed_unpatched_with_a_warning() -> None:
    status, body = await call("/mutate", chunks=[b"x" * MAX_REVIEW_BYTES, b"xx"])
    assert status == 200
    assert body["response"] == {
        "uid": "",
        "allowed": True,
        "warnings": ["kvroute: the AdmissionReview is not JSON; not injected"],
    }


async def test_other_paths_and_methods() -> None:
    assert await call("/v1/workloads", method="GET") == (204, None)
    status, body = await call("/mutate", method="GET")
    assert status == 405 and "POST" in body["detail"]
