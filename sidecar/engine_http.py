"""The engine's HTTP side: load scrapes and KV-event endpoint discovery.

Everything the sidecar asks the engine over HTTP goes through :class:`EngineHttp`, which
keeps one keep-alive session and turns every aiohttp failure into
:class:`~sidecar.errors.EngineUnavailable`.

Discovery, when no ``--kv-events-endpoint`` is given:

- vLLM (0.33+): ``GET /kv_event_sources`` -> ``{dp_rank: KVEventsConfig}``; rank 0's
  ``endpoint``, ``replay_endpoint`` and ``topic``, with a wildcard host (``*``) replaced
  by the engine's host;
- SGLang (0.5.23+): ``GET /server_info`` -> ``kv_events`` with ``endpoint_host``,
  ``endpoint_port_base``, ``replay_endpoint_port_base`` and ``topic``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import aiohttp

from sidecar.errors import EngineUnavailable
from sidecar.load_metrics import EngineLoad, parse_engine_load


@dataclass(frozen=True, slots=True)
class EventEndpoints:
    endpoint: str
    replay_endpoint: str | None
    topic: str


def _host_of(url: str) -> str:
    return urlsplit(url).hostname or "127.0.0.1"


def _resolve(endpoint: str, host: str) -> str:
    for wildcard in ("*", "0.0.0.0", "[::]"):
        endpoint = endpoint.replace(f"//{wildcard}:", f"//{host}:")
    return endpoint


def vllm_endpoints(body: Any, engine_url: str) -> EventEndpoints:
    if not isinstance(body, dict) or not body:
        raise EngineUnavailable("/kv_event_sources returned no publisher")
    rank0 = body.get("0", body.get(0, next(iter(body.values()))))
    if not isinstance(rank0, dict) or not isinstance(rank0.get("endpoint"), str):
        raise EngineUnavailable("/kv_event_sources has no endpoint for rank 0")
    host = _host_of(engine_url)
    replay = rank0.get("replay_endpoint")
    return EventEndpoints(
        _resolve(rank0["endpoint"], host),
        _resolve(replay, host) if isinstance(replay, str) else None,
        str(rank0.get("topic") or ""),
    )


def sglang_endpoints(body: Any, engine_url: str) -> EventEndpoints:
    events = body.get("kv_events") if isinstance(body, dict) else None
    if not isinstance(events, dict) or "endpoint_port_base" not in events:
        raise EngineUnavailable("/server_info has no kv_events block")
    host = str(events.get("endpoint_host") or _host_of(engine_url))
    if host in ("*", "0.0.0.0"):
        host = _host_of(engine_url)
    replay_port = events.get("replay_endpoint_port_base")
    return EventEndpoints(
        f"tcp://{host}:{int(events['endpoint_port_base'])}",
        f"tcp://{host}:{int(replay_port)}" if replay_port is not None else None,
        str(events.get("topic") or ""),
    )


class EngineHttp:
    def __init__(self, base_url: str, *, timeout_s: float) -> None:
        self.base_url = base_url.rstrip("/")
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._session: aiohttp.ClientSession | None = None

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=self._timeout)
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()

    async def _get(self, path: str, *, json: bool) -> Any:
        try:
            async with self._client().get(self.base_url + path) as response:
                if response.status != 200:
                    raise EngineUnavailable(f"GET {path} answered {response.status}")
                return await (response.json(content_type=None) if json else response.text())
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            raise EngineUnavailable(f"GET {path} failed: {exc!r}") from exc

    async def load(self) -> EngineLoad:
        return parse_engine_load(await self._get("/metrics", json=False))

    async def discover(self, engine_kind: str) -> EventEndpoints:
        if engine_kind == "sglang":
            return sglang_endpoints(await self._get("/server_info", json=True), self.base_url)
        return vllm_endpoints(await self._get("/kv_event_sources", json=True), self.base_url)
