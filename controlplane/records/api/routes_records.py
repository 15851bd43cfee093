"""Routes of what happened: stats, alerts, the audit log, API tokens."""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Path, Query, Response
from pydantic import BaseModel, Field

from controlplane.records.api.auth import Admin, Reader
from controlplane.records.api.deps import Context, Name, Session
from controlplane.records.db.models import ApiToken
from controlplane.records.db.repositories import (
    AlertRepository,
    AuditRepository,
    StatsRepository,
    TokenRepository,
    Totals,
)
from controlplane.records.services.alerts import alert_json
from controlplane.records.services.tokens import Scope, TokenService

router = APIRouter(prefix="/v1")
ID = r"^[A-Za-z0-9_-]{1,64}$"


class NewToken(BaseModel):
    name: str = Field(min_length=1, max_length=100, description="What the token is for.")
    scopes: list[Scope] = Field(min_length=1, max_length=3)
    tenant: str | None = Field(None, pattern=ID, description="Inference tokens: the tenant.")
    default_workload: str | None = Field(
        None, pattern=r"^[a-z0-9-]{1,63}$", description="Inference tokens: their workload."
    )


def _totals(totals: Totals) -> dict[str, Any]:
    return {
        "requests": totals.requests,
        "prompt_tokens": totals.prompt_tokens,
        "predicted_cached_tokens": totals.predicted_cached_tokens,
        "measured_cached_tokens": totals.measured_cached_tokens,
        "measured_requests": totals.measured_requests,
        "errors": totals.errors,
        "predicted_hit_rate": totals.predicted_hit_rate,
        "measured_hit_rate": totals.measured_hit_rate,
    }


@router.get("/workloads/{name}/stats", tags=["records"], summary="Per-minute counters")
async def workload_stats(
    name: Name,
    session: Session,
    _: Reader,
    minutes: Annotated[int, Query(ge=1, le=10080)] = 60,
) -> dict[str, Any]:
    since = int((time.time() - minutes * 60) // 60 * 60)
    rows = await StatsRepository(session).per_minute(name, since)
    overall = Totals.of(totals for _, totals in rows)
    return {
        "workload": name,
        "minutes": minutes,
        "per_minute": [{"minute": minute, **_totals(totals)} for minute, totals in rows],
        "total": _totals(overall),
    }


@router.get("/alerts", tags=["records"], summary="Open and recent alerts")
async def alerts(
    session: Session,
    _: Reader,
    state: Literal["open", "closed", "all"] = "all",
    limit: Annotated[int, Query(ge=1, le=500)] = 100,
) -> dict[str, Any]:
    rows = await AlertRepository(session).recent(
        state=None if state == "all" else state, limit=limit
    )
    return {"alerts": [alert_json(alert) for alert in rows]}


@router.get("/audit", tags=["records"], summary="Who did what, newest first")
async def audit(
    session: Session,
    _: Reader,
    limit: Annotated[int, Query(ge=1, le=500)] = 100,
    offset: Annotated[int, Query(ge=0, le=10**9)] = 0,
) -> dict[str, Any]:
    rows, total = await AuditRepository(session).page(limit=limit, offset=offset)
    return {
        "total": total,
        "offset": offset,
        "entries": [
            {
                "id": row.id,
                "at": row.at,
                "actor": row.actor,
                "action": row.action,
                "target": row.target,
                "result": row.result,
                "before": row.before,
                "after": row.after,
                "detail": row.detail,
            }
            for row in rows
        ],
    }


def _token(token: ApiToken) -> dict[str, Any]:
    return {
        "id": token.id,
        "name": token.name,
        "scopes": token.scopes.split(","),
        "tenant": token.tenant,
        "default_workload": token.default_workload,
        "created_by": token.created_by,
        "created_at": token.created_at,
    }


@router.post("/tokens", tags=["tokens"], status_code=201, summary="Create a token")
async def create_token(
    body: NewToken, context: Context, session: Session, principal: Admin
) -> dict[str, Any]:
    service = TokenService(context.store, session, principal.actor)
    token, secret = await service.create(
        name=body.name,
        scopes=body.scopes,
        tenant=body.tenant,
        default_workload=body.default_workload,
    )
    return {**_token(token), "token": secret}


@router.get("/tokens", tags=["tokens"], summary="Every token (never the secrets)")
async def list_tokens(session: Session, _: Admin) -> dict[str, Any]:
    return {"tokens": [_token(token) for token in await TokenRepository(session).all()]}


@router.delete("/tokens/{token_id}", tags=["tokens"], status_code=204, summary="Revoke")
async def delete_token(
    token_id: Annotated[str, Path(pattern=r"^[0-9a-f]{16}$")],
    context: Context,
    session: Session,
    principal: Admin,
) -> Response:
    await TokenService(context.store, session, principal.actor).delete(token_id)
    return Response(status_code=204)
