"""The engines' own model cards, for the proxy's ``GET /v1/models`` and
``GET /v1/models/{id}``.

A client that lists models through the proxy should read what it would read from an
engine: vLLM's and SGLang's cards carry ``max_model_len`` (which chat front-ends read to
size their context), ``root`` and ``parent`` (a LoRA adapter's base model) and the
engine's ``owned_by``. The proxy asks one routable replica per model, the least loaded,
for its ``/v1/models`` and keeps each replica's list for :data:`CARDS_TTL_S`; a name no
engine lists (a replica that did not answer in :data:`CARDS_TIMEOUT_S`, one that wants an
API key the proxy does not hold, any other answer than a list of cards) gets the proxy's
own card, so listing never fails for an engine's sake. Which names are listed stays the
fleet's: a card an engine lists under a name no routable replica announced is left out,
as the proxy could not route to it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping
from typing import Any

import msgspec

from dataplane.upstream import Upstream, UpstreamError

log = logging.getLogger("dataplane")

CARDS_TTL_S = 10.0
CARDS_TIMEOUT_S = 2.0
MAX_CARDS_BYTES = 1 << 20
_HEADERS = (("accept", "application/json"), ("accept-encoding", "identity"))
Card = dict[str, Any]


def own_card(name: str) -> Card:
    """The proxy's card for ``name`` when no engine's is at hand."""
    return {"id": name, "object": "model", "created": 0, "owned_by": "kvroute"}


def cards_of(body: bytes) -> list[Card] | None:
    """The cards of a ``/v1/models`` answer (each a JSON object with a string ``id``);
    ``None`` when it is not such a list."""
    try:
        listing = msgspec.json.decode(body)
    except (msgspec.DecodeError, RecursionError):
        return None
    cards = listing.get("data") if isinstance(listing, dict) else None
    if not isinstance(cards, list):
        return None
    return [c for c in cards if isinstance(c, dict) and isinstance(c.get("id"), str)]


class ModelCards:
    """Replicas' ``/v1/models`` lists, fetched through the proxy's upstream client and
    kept per replica URL for :data:`CARDS_TTL_S`."""

    def __init__(self, upstream: Upstream, ttl_s: float = CARDS_TTL_S) -> None:
        self.upstream = upstream
        self.ttl_s = ttl_s
        self._kept: dict[str, tuple[float, dict[str, Card]]] = {}  # url: (until, cards)

    async def cards(self, replicas: Mapping[str, str]) -> dict[str, Card]:
        """A card for every name in ``replicas`` (name: the base URL of the replica to
        ask): the engine's, else the one any other replica asked lists, else the
        proxy's own."""
        now = time.monotonic()
        self._kept = {url: kept for url, kept in self._kept.items() if kept[0] > now}
        urls = sorted(set(replicas.values()))
        stale = [url for url in urls if url not in self._kept]
        for url, listed in zip(stale, await asyncio.gather(*map(self._fetch, stale)), strict=True):
            if listed is not None:
                self._kept[url] = (now + self.ttl_s, listed)
        lists = [self._kept[url][1] for url in urls if url in self._kept]
        out: dict[str, Card] = {}
        for name, url in replicas.items():
            card = self._kept[url][1].get(name) if url in self._kept else None
            if card is None:
                card = next((listed[name] for listed in lists if name in listed), None)
            out[name] = card if card is not None else own_card(name)
        return out

    async def _fetch(self, url: str) -> dict[str, Card] | None:
        """``url``'s cards by id, or ``None`` (logged) when it gave none."""
        try:
            body = await asyncio.wait_for(self._get(url + "/v1/models"), CARDS_TIMEOUT_S)
        except (UpstreamError, OSError, ValueError) as exc:  # OSError: timeouts, resets
            log.warning("model cards unavailable", extra={"url": url, "error": str(exc)})
            return None
        cards = cards_of(body) if body is not None else None
        if cards is None:
            log.warning("model cards unavailable", extra={"url": url, "error": "no card list"})
            return None
        return {card["id"]: card for card in reversed(cards)}  # the first of an id wins

    async def _get(self, url: str) -> bytes | None:
        """The body of a 200 answer to ``GET url`` (at most :data:`MAX_CARDS_BYTES`),
        ``None`` for any other status."""
        opened = await self.upstream.open("GET", url, b"", _HEADERS)
        try:
            body = opened.first
            while len(body) <= MAX_CARDS_BYTES and (chunk := await opened.next_chunk()):
                body += chunk
            if len(body) > MAX_CARDS_BYTES:
                raise ValueError(f"a model list over {MAX_CARDS_BYTES} bytes")
        except BaseException:
            opened.close()
            raise
        opened.release()
        return body if opened.status == 200 else None
