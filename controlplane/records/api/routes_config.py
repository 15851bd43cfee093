"""Routes of the live config: workloads (with ETags, revisions, rollback), models, rules.

Handlers are thin: parse, call :class:`ConfigWriter`, shape the answer. A workload's or
model's ETag is its etcd mod revision; ``If-Match`` on a write must name the current one.
"""

from __future__ import annotations

import json
from typing import Annotated, Any

from fastapi import APIRouter, Body, Header, Query, Response
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field

from controlplane.records.api.auth import Admin, Reader
from controlplane.records.api.deps import Context, Name, Session
from controlplane.records.config_store import DEFAULT_WORKLOAD, Kind, RulesDocument, Stored
from controlplane.records.db.repositories import RevisionRepository
from controlplane.records.errors import InvalidInput, NotFound
from controlplane.records.services.config import (
    STRATEGY_MODELS,
    ConfigWriter,
    check_deletable,
    etag,
    merge_workload,
    validated_json,
)
from kvcore.workload import ModelSpec, Workload

router = APIRouter(prefix="/v1")
DROPPED_HEADER = "x-kvroute-dropped-fields"
IfMatch = Annotated[
    str | None,
    Header(description="The ETag last read; the write is refused (412) if it changed."),
]


CREATED: dict[int | str, dict[str, Any]] = {201: {"description": "Created (200: replaced)."}}


class ModelBody(ModelSpec):
    """A model entry; its name is the one in the path."""

    name: str | None = Field(None, description="Must equal the name in the path if given.")  # type: ignore[assignment]


class Rollback(BaseModel):
    revision: int = Field(ge=1, le=2**62, description="Id of the revision to go back to.")


def _decoded(value: str | None) -> Any:
    """A stored JSON value; a value written by hand that is not JSON is shown as text."""
    if value is None:
        return None
    try:
        return json.loads(value)
    except ValueError:
        return value


def _entry(name: str, stored: Stored) -> dict[str, Any]:
    return {"name": name, "etag": etag(stored.mod_revision), "spec": _decoded(stored.value)}


def _document(value: str | None, revision: int, status: int = 200) -> Response:
    if value is None:
        return Response(status_code=204, headers={"ETag": etag(revision)})
    return JSONResponse(_decoded(value), status_code=status, headers={"ETag": etag(revision)})


def _named(document: dict[str, Any], name: str, explicit: bool) -> dict[str, Any]:
    if explicit and document.get("name") != name:
        raise InvalidInput("body.name", f"must be {name!r}, the name in the path (or left out)")
    return {**document, "name": name}


async def _read(context: Context, kind: Kind, name: str) -> Stored:
    stored = await context.store.read(kind, name)
    if stored is None:
        raise NotFound(f"no {kind} {name!r}")
    return stored


# --- workloads ---------------------------------------------------------------------------


@router.get("/workloads", tags=["workloads"], summary="Every workload")
async def list_workloads(context: Context, _: Reader) -> dict[str, Any]:
    found = await context.store.read_all(Kind.WORKLOAD)
    return {"workloads": [_entry(n, s) for n, s in sorted(found.items())]}


@router.get("/workloads/{name}", tags=["workloads"], summary="One workload, with its ETag")
async def get_workload(name: Name, context: Context, _: Reader) -> Response:
    stored = await _read(context, Kind.WORKLOAD, name)
    return _document(stored.value, stored.mod_revision)


@router.put(
    "/workloads/{name}",
    tags=["workloads"],
    summary="Create or replace a workload",
    responses=CREATED,
)
async def put_workload(
    name: Name,
    workload: Annotated[Workload, Body()],
    context: Context,
    session: Session,
    principal: Admin,
    if_match: IfMatch = None,
) -> Response:
    document = _named(workload.model_dump(mode="json"), name, "name" in workload.model_fields_set)
    value = validated_json(Kind.WORKLOAD, document)
    writer = ConfigWriter(context.store, session, principal.actor)
    written = await writer.write(Kind.WORKLOAD, name, value, if_match=if_match, action="put")
    return _document(written.value, written.mod_revision, 201 if written.created else 200)


@router.patch(
    "/workloads/{name}",
    tags=["workloads"],
    summary="Change some fields (merge patch)",
    description="A patch that changes `strategy` keeps the settings the new strategy has "
    "too (those at the old strategy's default take the new one's) and drops the others: "
    f"`{DROPPED_HEADER}` names the dropped settings, and the audit entry says their values.",
)
async def patch_workload(
    name: Name,
    patch: Annotated[dict[str, Any], Body()],
    context: Context,
    session: Session,
    principal: Admin,
    if_match: IfMatch = None,
) -> Response:
    stored = await _read(context, Kind.WORKLOAD, name)
    patched = merge_workload(_decoded(stored.value), patch)
    value = _validated_patch(_named(patched.document, name, "name" in patch), patch)
    writer = ConfigWriter(context.store, session, principal.actor)
    guard = if_match if if_match is not None else etag(stored.mod_revision)
    written = await writer.write(
        Kind.WORKLOAD, name, value, if_match=guard, action="patch", detail=patched.detail()
    )
    response = _document(written.value, written.mod_revision)
    if patched.dropped:
        response.headers[DROPPED_HEADER] = ", ".join(sorted(patched.dropped))
    return response


def _validated_patch(document: dict[str, Any], patch: dict[str, Any]) -> str:
    """The patched workload validated; refused, the message names the new strategy's
    settings when the patch changed it (the fix is to send only those)."""
    try:
        return validated_json(Kind.WORKLOAD, document)
    except InvalidInput as exc:
        model = STRATEGY_MODELS.get(patch.get("strategy"))
        if model is None:
            raise
        settings = ", ".join(f for f in model.model_fields if f not in ("name", "strategy"))
        strategy = patch["strategy"]
        raise InvalidInput(
            exc.field, f"{exc.message} (a {strategy} workload takes: {settings})"
        ) from None


@router.delete(
    "/workloads/{name}", tags=["workloads"], status_code=204, summary="Delete a workload"
)
async def delete_workload(
    name: Name, context: Context, session: Session, principal: Admin, if_match: IfMatch = None
) -> Response:
    await check_deletable(context.store, name)
    writer = ConfigWriter(context.store, session, principal.actor)
    written = await writer.write(Kind.WORKLOAD, name, None, if_match=if_match, action="delete")
    return _document(None, written.mod_revision)


@router.get("/workloads/{name}/revisions", tags=["workloads"], summary="Accepted changes")
async def workload_revisions(
    name: Name,
    session: Session,
    _: Reader,
    limit: Annotated[int, Query(ge=1, le=500)] = 50,
    offset: Annotated[int, Query(ge=0, le=10**9)] = 0,
) -> dict[str, Any]:
    rows = await RevisionRepository(session).page(
        str(Kind.WORKLOAD), name, limit=limit, offset=offset
    )
    return {
        "revisions": [
            {
                "revision": row.id,
                "action": row.action,
                "etcd_revision": row.etcd_revision,
                "actor": row.actor,
                "at": row.at,
                "before": _decoded(row.before),
                "after": _decoded(row.after),
            }
            for row in rows
        ]
    }


@router.post(
    "/workloads/{name}/rollback",
    tags=["workloads"],
    summary="Back to a revision",
    responses={204: {"description": "Rolled back to a deletion: the workload is gone."}},
)
async def rollback_workload(
    name: Name,
    rollback: Rollback,
    context: Context,
    session: Session,
    principal: Admin,
    if_match: IfMatch = None,
) -> Response:
    row = await RevisionRepository(session).get(str(Kind.WORKLOAD), name, rollback.revision)
    if row is None:
        raise NotFound(f"workload {name!r} has no revision {rollback.revision}")
    if row.after is None:
        await check_deletable(context.store, name)
    value = None if row.after is None else validated_json(Kind.WORKLOAD, _decoded(row.after))
    writer = ConfigWriter(context.store, session, principal.actor)
    written = await writer.write(Kind.WORKLOAD, name, value, if_match=if_match, action="rollback")
    return _document(written.value, written.mod_revision)


# --- models ------------------------------------------------------------------------------


@router.get("/models", tags=["models"], summary="Every model entry")
async def list_models(context: Context, _: Reader) -> dict[str, Any]:
    found = await context.store.read_all(Kind.MODEL)
    return {"models": [_entry(n, s) for n, s in sorted(found.items())]}


@router.get("/models/{name}", tags=["models"], summary="One model entry, with its ETag")
async def get_model(name: Name, context: Context, _: Reader) -> Response:
    stored = await _read(context, Kind.MODEL, name)
    return _document(stored.value, stored.mod_revision)


@router.put(
    "/models/{name}", tags=["models"], summary="Create or replace a model entry", responses=CREATED
)
async def put_model(
    name: Name,
    model: Annotated[ModelBody, Body()],
    context: Context,
    session: Session,
    principal: Admin,
    if_match: IfMatch = None,
) -> Response:
    document = _named(model.model_dump(mode="json"), name, model.name is not None)
    value = validated_json(Kind.MODEL, document)
    writer = ConfigWriter(context.store, session, principal.actor)
    written = await writer.write(Kind.MODEL, name, value, if_match=if_match, action="put")
    return _document(written.value, written.mod_revision, 201 if written.created else 200)


@router.delete("/models/{name}", tags=["models"], status_code=204, summary="Delete a model entry")
async def delete_model(
    name: Name, context: Context, session: Session, principal: Admin, if_match: IfMatch = None
) -> Response:
    writer = ConfigWriter(context.store, session, principal.actor)
    written = await writer.write(Kind.MODEL, name, None, if_match=if_match, action="delete")
    return _document(None, written.mod_revision)


# --- classification rules -------------------------------------------------------------------


@router.get("/rules", tags=["rules"], summary="Classification rules and the default workload")
async def get_rules(context: Context, _: Reader) -> Response:
    stored = await context.store.read(Kind.RULES)
    if stored is None:
        return JSONResponse(RulesDocument.model_validate({}).model_dump(mode="json"))
    return _document(stored.value, stored.mod_revision)


@router.put("/rules", tags=["rules"], summary="Replace the classification rules")
async def put_rules(
    rules: RulesDocument,
    context: Context,
    session: Session,
    principal: Admin,
    if_match: IfMatch = None,
) -> Response:
    known = set(await context.store.read_all(Kind.WORKLOAD)) | {DEFAULT_WORKLOAD}
    for index, rule in enumerate(rules.rules):
        if rule.workload not in known:
            raise InvalidInput(f"body.rules.{index}.workload", f"no workload {rule.workload!r}")
    if rules.default_workload not in known:
        raise InvalidInput("body.default_workload", f"no workload {rules.default_workload!r}")
    value = validated_json(Kind.RULES, rules.model_dump(mode="json"))
    writer = ConfigWriter(context.store, session, principal.actor)
    written = await writer.write(Kind.RULES, "", value, if_match=if_match, action="put")
    return _document(written.value, written.mod_revision)
