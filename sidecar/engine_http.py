"""The engine's HTTP side: load scrapes and KV-event endpoint discovery.

Everything the sidecar asks the engine over HTTP goes through :class:`EngineHttp`, which
keeps one keep-alive session and turns every aiohttp failure into
:class:`~sidecar.errors.EngineUnavailable`.

LoRA adapters: ``GET /v1/models``, the cards with a ``parent`` (vLLM's and SGLang's), read
with every load scrape so that a load or an unload is announced within one
``load_interval_s``.

Discovery, when no ``--kv-events-endpoint`` is given:

- vLLM (0.33+): ``GET /kv_event_sources`` -> ``{dp_rank: KVEventsConfig}``; each rank's
  ``endpoint``, ``replay_endpoint`` and ``topic``, with a wildcard host (``*``) replaced
  by the engine's host;
- SGLang (0.5.23+): ``GET /server_info`` -> ``kv_events`` with ``endpoint_host``,
  ``endpoint_port_base``, ``replay_endpoint_port_base``, ``dp_size`` and ``topic``
  (rank ``r`` listens on base + ``r``).
"""

from __future__ import annotations

import ssl
from dataclasses import dataclass, replace
from typing import Any
from urllib.parse import urlsplit

import aiohttp

from kvcore.roles import sglang_disaggregation
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


def configured_endpoints(endpoints: str, replays: str | None, topic: str) -> list[EventEndpoints]:
    """``--kv-events-endpoint`` / ``--replay-endpoint`` as one entry per rank (both may be
    comma-separated lists, in rank order; the replay list may be empty or as long)."""
    events = [e.strip() for e in endpoints.split(",") if e.strip()]
    replay = [r.strip() or None for r in replays.split(",")] if replays else []
    replay += [None] * (len(events) - len(replay))
    return [EventEndpoints(e, r, topic) for e, r in zip(events, replay, strict=False)]


def _vllm_rank(config: Any, host: str) -> EventEndpoints:
    if not isinstance(config, dict) or not isinstance(config.get("endpoint"), str):
        raise EngineUnavailable("/kv_event_sources has a rank without an endpoint")
    replay = config.get("replay_endpoint")
    return EventEndpoints(
        _resolve(config["endpoint"], host),
        _resolve(replay, host) if isinstance(replay, str) else None,
        str(config.get("topic") or ""),
    )


def vllm_endpoints(body: Any, engine_url: str) -> list[EventEndpoints]:
    """Every rank's endpoints from ``/kv_event_sources``, in rank order."""
    if not isinstance(body, dict) or not body:
        raise EngineUnavailable("/kv_event_sources returned no publisher")
    try:
        ranks = sorted(body.items(), key=lambda item: int(item[0]))
    except ValueError:
        raise EngineUnavailable("/kv_event_sources has a rank that is not a number") from None
    return [_vllm_rank(config, _host_of(engine_url)) for _, config in ranks]


def sglang_endpoints(body: Any, engine_url: str) -> list[EventEndpoints]:
    """Every rank's endpoints from ``/server_info``: port bases plus the rank."""
    events = body.get("kv_events") if isinstance(body, dict) else None
    if not isinstance(events, dict) or "endpoint_port_base" not in events:
        raise EngineUnavailable("/server_info has no kv_events block")
    host = str(events.get("endpoint_host") or _host_of(engine_url))
    if host in ("*", "0.0.0.0"):
        host = _host_of(engine_url)
    try:
        base, ranks = int(events["endpoint_port_base"]), max(1, int(events.get("dp_size") or 1))
        replay = events.get("replay_endpoint_port_base")
        replay_base = int(replay) if replay is not None else None
    except (TypeError, ValueError):
        raise EngineUnavailable("/server_info kv_events has non-numeric ports") from None
    return [
        EventEndpoints(
            f"tcp://{host}:{base + rank}",
            f"tcp://{host}:{replay_base + rank}" if replay_base is not None else None,
            str(events.get("topic") or ""),
        )
        for rank in range(ranks)
    ]


def lora_adapters(body: Any) -> dict[str, str]:
    """The LoRA adapters in ``/v1/models`` (vLLM's and SGLang's cards with a ``parent``):
    name -> path (the card's ``root``)."""
    cards = body.get("data") if isinstance(body, dict) else None
    if not isinstance(cards, list):
        raise EngineUnavailable("/v1/models returned no model list")
    return {
        card["id"]: str(card.get("root") or "")
        for card in cards
        if isinstance(card, dict) and isinstance(card.get("id"), str) and card.get("parent")
    }


def sglang_capacity(body: Any) -> tuple[int, int]:
    """``(capacity in pages, page size)`` from SGLang's ``/server_info``; zeros if absent."""
    if not isinstance(body, dict):
        return 0, 0
    tokens, page = body.get("max_total_num_tokens"), body.get("page_size")
    if not isinstance(tokens, int) or not isinstance(page, int) or page < 1 or tokens < 0:
        return 0, 0
    return tokens // page, page


class EngineHttp:
    """The engine's HTTP server; an ``https://`` one checked against ``ssl_context`` (or
    the system's roots when it is ``None``)."""

    def __init__(
        self, base_url: str, *, timeout_s: float, ssl_context: ssl.SSLContext | None = None
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._ssl: ssl.SSLContext | bool = True if ssl_context is None else ssl_context
        self._session: aiohttp.ClientSession | None = None

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None:
            connector = aiohttp.TCPConnector(ssl=self._ssl)
            self._session = aiohttp.ClientSession(timeout=self._timeout, connector=connector)
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

    async def load(self, engine_kind: str) -> EngineLoad:
        """Load figures from ``/metrics``; SGLang's capacity comes from ``/server_info``,
        since its metrics do not carry it."""
        load = parse_engine_load(await self._get("/metrics", json=False))
        if engine_kind != "sglang" or load.capacity_blocks:
            return load
        info = await self._get("/server_info", json=True)
        capacity, page = sglang_capacity(info)
        role, bootstrap_port = sglang_disaggregation(info)
        return replace(
            load,
            capacity_blocks=capacity,
            engine_block_size=page,
            role=role or "",
            bootstrap_port=bootstrap_port,
        )

    async def adapters(self) -> dict[str, str]:
        """The LoRA adapters the engine has loaded, from ``/v1/models``."""
        return lora_adapters(await self._get("/v1/models", json=True))

    async def discover(self, engine_kind: str) -> list[EventEndpoints]:
        if engine_kind == "sglang":
            return sglang_endpoints(await self._get("/server_info", json=True), self.base_url)
        return vllm_endpoints(await self._get("/kv_event_sources", json=True), self.base_url)
