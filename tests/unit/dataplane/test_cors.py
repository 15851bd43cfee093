"""A browser page calling the proxy from another origin (``--cors-allowed-origins``): the
preflight is answered by the proxy itself, the answers carry the proxy's CORS headers and
never the replicas' own, and a proxy with no origins allowed adds nothing."""

from __future__ import annotations

import json

import pytest

from dataplane.main import SettingsRefused, load_settings
from tests.unit.dataplane.test_critical_path import Proxy, json_reply

PAGE = "https://chat.example.com"
PREFLIGHT = {
    "origin": PAGE,
    "access-control-request-method": "POST",
    "access-control-request-headers": "authorization, content-type",
}
# what vLLM's own CORSMiddleware adds to every answer by default
REPLICA_CORS = b"access-control-allow-origin: *\r\n"


def parse(raw: bytes) -> tuple[int, list[tuple[str, str]], bytes]:
    head, _, body = raw.partition(b"\r\n\r\n")
    status_line, *lines = head.decode("latin-1").split("\r\n")
    headers = [(k.lower(), v.strip()) for k, _, v in (line.partition(":") for line in lines)]
    return int(status_line.split()[1]), headers, body


def values(headers: list[tuple[str, str]], name: str) -> list[str]:
    return [v for k, v in headers if k == name]


async def test_a_preflight_from_an_allowed_origin_is_answered_without_touching_a_replica() -> None:
    proxy = Proxy(json_reply(cached=0), cors_allowed_origins=f"{PAGE},http://localhost:3000")
    status, headers, body = parse(await proxy.ask(None, method="OPTIONS", headers=PREFLIGHT))
    assert status == 200
    assert body == b""
    assert values(headers, "access-control-allow-origin") == [PAGE]
    assert values(headers, "vary") == ["origin"]
    assert "POST" in values(headers, "access-control-allow-methods")[0].split(", ")
    assert values(headers, "access-control-allow-headers") == ["authorization, content-type"]
    assert proxy.replicas.connects == 0


async def test_a_preflight_from_an_origin_not_allowed_is_refused_in_openais_shape() -> None:
    proxy = Proxy(json_reply(cached=0), cors_allowed_origins=PAGE)
    asked = PREFLIGHT | {"origin": "https://evil.example"}
    status, headers, body = parse(await proxy.ask(None, method="OPTIONS", headers=asked))
    assert status == 400
    error = json.loads(body)["error"]
    assert error["param"] == "origin"
    assert "https://evil.example" in error["message"]
    assert not [k for k, _ in headers if k.startswith("access-control-")]
    assert proxy.replicas.connects == 0


@pytest.mark.parametrize(("allowed", "expected"), [(PAGE, PAGE), ("*", "*")])
async def test_an_answer_to_an_allowed_page_carries_the_proxys_cors_headers_not_the_replicas(
    allowed: str, expected: str
) -> None:
    proxy = Proxy(json_reply(cached=0, extra_headers=REPLICA_CORS), cors_allowed_origins=allowed)
    raw = await proxy.ask({"prompt": "hello"}, headers={"origin": PAGE})
    status, headers, body = parse(raw)
    assert status == 200
    assert json.loads(body)["choices"][0]["text"] == " hi"
    assert values(headers, "access-control-allow-origin") == [expected]
    exposed = values(headers, "access-control-expose-headers")[0].split(", ")
    assert {"x-request-id", "x-kvroute-replica"} <= set(exposed)


async def test_with_no_origin_allowed_the_proxy_adds_no_cors_and_relays_none() -> None:
    proxy = Proxy(json_reply(cached=0, extra_headers=REPLICA_CORS))
    status, headers, _ = parse(await proxy.ask({"prompt": "hello"}, headers={"origin": PAGE}))
    assert status == 200
    assert not [k for k, _ in headers if k.startswith("access-control-")]
    status, headers, body = parse(await proxy.ask(None, method="OPTIONS", headers=PREFLIGHT))
    assert status == 405
    assert "use POST" in json.loads(body)["error"]["message"]
    assert not [k for k, _ in headers if k.startswith("access-control-")]


def test_allowed_origins_are_checked_when_the_proxy_starts() -> None:
    base = ["--static-replicas", "http://127.0.0.1:9"]
    given = "https://A.example:8443, http://localhost:3000/, *"
    settings = load_settings([*base, "--cors-allowed-origins", given])
    assert settings.cors_allowed_origins == ["https://a.example:8443", "http://localhost:3000", "*"]
    for bad in ["https://a.example/chat", "a.example", "https://a.example:99999"]:
        with pytest.raises(SettingsRefused, match=f"--cors-allowed-origins: '{bad}' is not an"):
            load_settings([*base, "--cors-allowed-origins", bad])
