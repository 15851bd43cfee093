"""What each admin route can answer, written into its OpenAPI operation, so that clients
generated from the document expect every status the API gives (the fuzz test,
``tests/integration/controlplane/records/test_fuzz.py``, fails on any other).

The statuses follow from what a route is, not from a list kept by hand per route:

| status | when | which routes |
|---|---|---|
| 400 | the body is not UTF-8, or JSON that cannot be carried (``JsonBodies``) | writes |
| 401 | no bearer token, or an unknown one | every ``/v1`` route |
| 403 | the token lacks the scope | every ``/v1`` route |
| 404 | no such workload, model, token, replica or revision | a path parameter |
| 409 | changed concurrently, or still in use | an ``If-Match`` header |
| 412 | ``If-Match`` names a version that is no longer current | an ``If-Match`` header |
| 413 | the body is over the limit (``middleware.BodyLimit``) | writes |
| 415 | the body is not sent as JSON | writes |
| 422 | a parameter or a field is refused | a parameter or a body |
| 503 | etcd or the database does not answer | every ``/v1`` route |
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from fastapi.routing import APIRoute

WRITES = frozenset({"POST", "PUT", "PATCH"})
_PROBLEM = {
    "application/json": {
        "schema": {
            "type": "object",
            "properties": {"detail": {"description": "What is wrong, in words."}},
            "required": ["detail"],
        }
    }
}


def _problem(description: str) -> dict[str, Any]:
    return {"description": description, "content": _PROBLEM}


AUTHENTICATED = {
    401: _problem("No bearer token, or an unknown one."),
    403: _problem("The token lacks the scope this route needs."),
    503: _problem("etcd or the database does not answer."),
}
NAMED = {404: _problem("No such workload, model, token, replica or revision.")}
GUARDED = {
    409: _problem("Changed concurrently, or still in use (named by the rules, the default)."),
    412: _problem("If-Match names a version that is no longer current."),
}
BODIES = {
    400: _problem("The body is not UTF-8, or holds what JSON cannot carry."),
    413: _problem("The body is over the size limit."),
    415: _problem("The body is not sent as JSON (content-type: application/json)."),
    422: _problem("A parameter or a field is refused; detail[].loc names it."),
}


def document_responses(router: APIRouter) -> None:
    """Add to every route's responses the statuses it can answer (see the module's
    docstring); a route's own declarations stay."""
    for route in router.routes:
        if isinstance(route, APIRoute) and route.path.startswith("/v1/"):
            for status, response in _statuses(route).items():
                route.responses.setdefault(status, response)


def _statuses(route: APIRoute) -> dict[int, dict[str, Any]]:
    statuses = dict(AUTHENTICATED)
    dependant = route.dependant
    if dependant.path_params:
        statuses |= NAMED
    if any(param.alias.lower() == "if-match" for param in dependant.header_params):
        statuses |= GUARDED
    if (route.methods or set()) & WRITES:
        statuses |= BODIES
    return statuses
