"""The admin API application: routes, error translation, body limit, tracing.

Errors: a :class:`~controlplane.records.errors.RecordsError` becomes its status with
``{"detail": ...}``; :class:`~controlplane.records.errors.InvalidInput` becomes 422 in
FastAPI's own shape (``detail[].loc`` names the field), like every other validation
error; etcd or database failures become 503.
"""

from __future__ import annotations

from typing import Any

import aetcd
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from sqlalchemy.exc import SQLAlchemyError

from controlplane.records.api import routes_config, routes_fleet, routes_records
from controlplane.records.api.context import AdminContext
from controlplane.records.api.middleware import BodyLimit, JsonBodies, Observe
from controlplane.records.api.openapi import document_responses
from controlplane.records.errors import InvalidInput, RecordsError
from controlplane.records.services.explain import Explainer


def create_app(context: AdminContext, *, tracer_provider: Any | None = None) -> FastAPI:
    app = FastAPI(
        title="kvroute control plane",
        description="Routing config, fleet, records and alerts of a kvroute fleet. Every "
        "route but /healthz and /readyz needs a bearer token; writes need the admin scope.",
        version="1",
    )
    app.state.context = context
    app.state.explainer = Explainer(context.store, context.fleet)
    _health_routes(app, context)
    for module in (routes_config, routes_fleet, routes_records):
        document_responses(module.router)
        app.include_router(module.router)
    _error_handlers(app)
    app.add_middleware(JsonBodies)
    app.add_middleware(Observe, metrics=context.metrics, tracer_provider=tracer_provider)
    app.add_middleware(BodyLimit)
    return app


def _health_routes(app: FastAPI, context: AdminContext) -> None:
    @app.get("/healthz", tags=["health"], summary="The process answers")
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.get(
        "/readyz",
        tags=["health"],
        summary="Config loaded from etcd; the database answers",
        responses={503: {"description": "Not ready: etcd or the database does not answer."}},
    )
    async def readyz() -> JSONResponse:
        ready = await context.ready()
        return JSONResponse({"ready": ready}, status_code=200 if ready else 503)

    @app.get("/metrics", tags=["health"], summary="Prometheus metrics")
    async def metrics() -> Response:
        return Response(generate_latest(context.registry), media_type=CONTENT_TYPE_LATEST)


def _error_handlers(app: FastAPI) -> None:
    @app.exception_handler(InvalidInput)
    async def invalid(request: Request, exc: InvalidInput) -> JSONResponse:
        detail = [{"loc": exc.field.split("."), "msg": exc.message, "type": "value_error"}]
        return JSONResponse({"detail": detail}, status_code=422)

    @app.exception_handler(RecordsError)
    async def records_error(request: Request, exc: RecordsError) -> JSONResponse:
        return JSONResponse({"detail": str(exc)}, status_code=exc.status)

    @app.exception_handler(SQLAlchemyError)
    async def database_down(request: Request, exc: SQLAlchemyError) -> JSONResponse:
        return JSONResponse({"detail": "the database is unavailable"}, status_code=503)

    @app.exception_handler(aetcd.ClientError)
    async def etcd_down(request: Request, exc: aetcd.ClientError) -> JSONResponse:
        return JSONResponse({"detail": "etcd is unavailable"}, status_code=503)
