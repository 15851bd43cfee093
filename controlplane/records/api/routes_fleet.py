"""Routes of the fleet as the fleet half sees it: replicas, drain, residency, explain."""

from __future__ import annotations

from dataclasses import asdict
from typing import Annotated, Any

from fastapi import APIRouter, Path, Query, Request
from pydantic import BaseModel, Field

from controlplane.contracts import ReplicaInfo
from controlplane.records.api.auth import Admin, Reader
from controlplane.records.api.deps import Context, Session
from controlplane.records.services.drain import DrainService

router = APIRouter(prefix="/v1")
ReplicaId = Annotated[str, Path(pattern=r"^[A-Za-z0-9_-]{1,128}$", description="Replica id.")]
PoolQuery = Annotated[str | None, Query(pattern=r"^[A-Za-z0-9_-]{1,64}$")]


class ExplainRequest(BaseModel):
    """An OpenAI request and what a proxy would know about it."""

    request: dict[str, Any] = Field(
        description="The body a client would POST (chat: 'messages'; completions: 'prompt').",
        # what the explainer requires of it (422 otherwise), said in the schema
        json_schema_extra={
            "required": ["model"],
            "properties": {"model": {"type": "string", "minLength": 1}},
        },
    )
    path: str = Field(
        "/v1/chat/completions", max_length=256, description="The path it would be POSTed to."
    )
    workload: str | None = Field(
        None, pattern=r"^[A-Za-z0-9_-]{1,64}$", description="As the x-kvroute-workload header."
    )
    tenant: str | None = Field(
        None,
        pattern=r"^[A-Za-z0-9_-]{1,64}$",
        description="The client key's tenant (without --auth, the proxy's tenant header): "
        "the request is keyed in its namespace, as the proxy keys it.",
    )
    headers: dict[str, str] = Field(
        default_factory=dict, max_length=64, description="Other request headers."
    )


def replica_json(info: ReplicaInfo) -> dict[str, Any]:
    data = asdict(info)
    data["served_names"] = list(info.served_names)
    data["hit_rate"] = info.hit_rate
    return data


@router.get(
    "/replicas",
    tags=["fleet"],
    summary="Membership, status, load, residency",
    description="Every replica as this instance knows it, and `state`: the `epoch` and "
    "`version` of this instance's routing-state stream that carry all of it. A proxy "
    "watching this instance has it once its `/readyz` `state` shows that epoch and at "
    "least that version.",
)
async def list_replicas(context: Context, _: Reader, pool: PoolQuery = None) -> dict[str, Any]:
    replicas = [replica_json(info) for info in context.fleet.replicas(pool)]
    epoch, version = context.fleet.state_position()
    return {"replicas": replicas, "state": {"epoch": epoch, "version": version}}


async def _set_draining(
    context: Context, session: Session, actor: str, replica_id: str, draining: bool
) -> dict[str, Any]:
    service = DrainService(context.fleet, session, actor)
    return replica_json(await service.set_draining(replica_id, draining))


@router.post("/replicas/{replica_id}/drain", tags=["fleet"], summary="Take no new requests")
async def drain(
    replica_id: ReplicaId, context: Context, session: Session, principal: Admin
) -> dict[str, Any]:
    return await _set_draining(context, session, principal.actor, replica_id, True)


@router.post("/replicas/{replica_id}/undrain", tags=["fleet"], summary="Take requests again")
async def undrain(
    replica_id: ReplicaId, context: Context, session: Session, principal: Admin
) -> dict[str, Any]:
    return await _set_draining(context, session, principal.actor, replica_id, False)


@router.get("/residency", tags=["fleet"], summary="Resident keys and the most shared prefixes")
async def residency(
    context: Context, _: Reader, top: Annotated[int, Query(ge=0, le=1000)] = 20
) -> dict[str, Any]:
    summary = await context.fleet.residency_summary(top)
    return {
        "total_keys": summary.total_keys,
        "per_replica": summary.per_replica,
        "most_shared": [
            {"key": f"{shared.key:016x}", "holders": list(shared.holders)}
            for shared in summary.most_shared
        ],
    }


@router.post("/route/explain", tags=["fleet"], summary="How a proxy would route a request, and why")
async def explain(body: ExplainRequest, request: Request, _: Reader) -> dict[str, Any]:
    explainer = request.app.state.explainer
    result: dict[str, Any] = await explainer.explain(
        body.request,
        path=body.path,
        workload=body.workload,
        tenant=body.tenant,
        headers={name.lower(): value for name, value in body.headers.items()},
    )
    return result
