"""A property-based fuzz of the admin API's OpenAPI schema (schemathesis): valid and
invalid requests to every operation, with and without a token; none gets a 500.

Cases are generated first (hypothesis, in a thread) and then sent over real HTTP from
the event loop that serves the API, so that generating and serving do not compete for
the interpreter request by request.
"""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import hypothesis.strategies as st
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode

from tests.integration.controlplane.records.conftest import (
    ADMIN_TOKEN,
    InTestFleet,
    RecordsFactory,
    replica_info,
    serve,
)

pytestmark = pytest.mark.integration
EXAMPLES = 150  # a few seconds; every operation gets several valid and invalid cases
PLACEHOLDER = "http://placeholder.invalid"


def generate_requests(app_schema: dict[str, Any]) -> list[dict[str, Any]]:
    schema = schemathesis.openapi.from_dict(app_schema)
    cases = st.one_of(
        schema.as_strategy(GenerationMode.POSITIVE),
        schema.as_strategy(GenerationMode.NEGATIVE),
    )
    tokens = st.sampled_from([ADMIN_TOKEN, ADMIN_TOKEN, ADMIN_TOKEN, "not-a-token", None])
    requests: list[dict[str, Any]] = []

    @settings(
        max_examples=EXAMPLES, deadline=None, database=None, suppress_health_check=list(HealthCheck)
    )
    @given(case=cases, token=tokens)
    def collect(case: schemathesis.Case, token: str | None) -> None:
        headers = {} if token is None else {"Authorization": f"Bearer {token}"}
        requests.append(case.as_transport_kwargs(base_url=PLACEHOLDER, headers=headers))

    collect()
    return requests


async def send(http: aiohttp.ClientSession, base_url: str, request: dict[str, Any]) -> str | None:
    """The request as a line if it got a server error, else ``None``."""
    url = request["url"].replace(PLACEHOLDER, base_url, 1)
    params = {k: v if isinstance(v, str) else str(v) for k, v in request["params"].items()}
    body = {k: request[k] for k in ("json", "data") if k in request}
    headers = {k: str(v) for k, v in request["headers"].items() if k.lower() != "content-length"}
    async with http.request(
        request["method"], url, params=params, headers=headers, **body
    ) as response:
        text = await response.text()
        if response.status < 500:
            return None
        return f"{request['method']} {url} {params} {body!r:.300} -> {response.status} {text:.300}"


@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
async def test_no_request_from_the_schema_gets_a_server_error(
    make_records: RecordsFactory,
) -> None:
    fleet = InTestFleet([replica_info("r0"), replica_info("r1")])
    fleet.hold("r0", [1, 2, 3])
    records = await make_records(fleet)
    requests = await asyncio.to_thread(generate_requests, records.app.openapi())
    operations = {(r["method"], "/".join(r["url"].split("/")[3:5])) for r in requests}
    assert len(operations) >= 8  # every group of routes was exercised

    async with serve(records.app) as base_url, aiohttp.ClientSession() as http:
        failures = [line for r in requests if (line := await send(http, base_url, r))]
    assert failures == []
