"""A property-based fuzz of the admin API's OpenAPI schema (schemathesis): valid and
invalid requests to every operation, with and without a token; none gets a 500, and every
answer's status is one the schema documents for its operation (so generated clients know
it). Then raw bytes, which schemathesis' typed generation never sends, to every write.

Cases are generated first (hypothesis, in a thread) and then sent over real HTTP from
the event loop that serves the API, so that generating and serving do not compete for
the interpreter request by request.
"""

from __future__ import annotations

import asyncio
import itertools
import json
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
        request = case.as_transport_kwargs(base_url=PLACEHOLDER, headers=headers)
        documented = app_schema["paths"][case.operation.path][case.method.lower()]["responses"]
        requests.append({**request, "documented": set(documented)})

    collect()
    return requests


async def send(http: aiohttp.ClientSession, base_url: str, request: dict[str, Any]) -> str | None:
    """The request as a line if it got a server error or a status its operation does not
    document, else ``None``."""
    url = request["url"].replace(PLACEHOLDER, base_url, 1)
    params = {k: v if isinstance(v, str) else str(v) for k, v in request["params"].items()}
    body = {k: request[k] for k in ("json", "data") if k in request}
    headers = {k: str(v) for k, v in request["headers"].items() if k.lower() != "content-length"}
    async with http.request(
        request["method"], url, params=params, headers=headers, **body
    ) as response:
        text = await response.text()
        if response.status < 500 and str(response.status) in request["documented"]:
            return None
        return f"{request['method']} {url} {params} {body!r:.300} -> {response.status} {text:.300}"


@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
async def test_no_request_from_the_schema_gets_a_server_error_or_an_undocumented_status(
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
    assert failures == [], "\n".join(failures)


# -- raw bytes, which schemathesis' typed generation never sends (issue 42 item 2) -------

WRITES = [
    ("PUT", "/v1/workloads/default"),
    ("PATCH", "/v1/workloads/default"),
    ("POST", "/v1/workloads/default/rollback"),
    ("PUT", "/v1/rules"),
    ("PUT", "/v1/models/sim-model"),
    ("POST", "/v1/tokens"),
    ("POST", "/v1/replicas/r0/drain"),
    ("POST", "/v1/replicas/r0/undrain"),
    ("POST", "/v1/route/explain"),
]
NAMED = {  # what the answer to such a body (sent as JSON) says is wrong with it
    b"\xff\xfe": "not UTF-8",
    b'{"strategy": "\\ud800"}': "lone surrogate",
    b'{"\\udc00": 1}': "lone surrogate",
    b'{"revision": 1e400}': "beyond a float",
}
CONTENT_TYPES = ["application/json", "", "application/octet-stream"]  # "": none at all
BODYLESS = {"/v1/replicas/r0/drain", "/v1/replicas/r0/undrain"}  # a body is not read
RAW_BODIES = [
    b"\xff\xfe",  # not UTF-8 at all
    b'{"strategy": "\xff"}',  # JSON around a byte that is not UTF-8
    b'{"strategy": "\\ud800"}',  # JSON escaping a lone surrogate
    b'{"strategy": "\xed\xa0\x80"}',  # a surrogate encoded as UTF-8 bytes
    b'{"\\udc00": 1}',  # a lone surrogate as a key
    b"\x00" * 16,
    b"{" * 5000,  # nested past any parser's depth
    b'{"revision": 1e400}',
]


@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
async def test_no_bytes_on_an_admin_write_route_get_a_server_error_or_a_reset(
    make_records: RecordsFactory,
) -> None:
    """Every write route, every body above, with and without a JSON content type: a 4xx
    whose detail names the problem (a route that reads no body may serve the request);
    never a 500, never a dropped connection."""
    records = await make_records(InTestFleet([replica_info("r0")]))
    failures = []
    async with serve(records.app) as base_url, aiohttp.ClientSession() as http:
        for (method, path), raw, typed in itertools.product(WRITES, RAW_BODIES, CONTENT_TYPES):
            headers = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
            if typed:
                headers["content-type"] = typed
            try:
                async with http.request(
                    method, base_url + path, data=raw, headers=headers,
                    skip_auto_headers=["content-type"],
                ) as r:  # fmt: skip
                    text = await r.text()
                    status = r.status
            except aiohttp.ClientError as exc:
                failures.append(f"{method} {path} {raw[:20]!r} typed={typed}: {exc!r}")
                continue
            if path in BODYLESS and status < 500:
                continue
            named = NAMED.get(raw, "") if typed == "application/json" else ""
            if typed == "application/octet-stream":
                named = "content-type: application/json"
            if not 400 <= status < 500 or named not in str(json.loads(text)["detail"]):
                failures.append(f"{method} {path} {raw[:20]!r} typed={typed}: {status} {text:.200}")

    assert failures == [], "\n".join(failures)
