"""The proxy's ``/v1/models`` cards are the engines' own: asked of a replica over
loopback, kept for a while, and the proxy's own card wherever an engine gives none
(an error status, no card list, silence, an oversized answer): listing never fails for an
engine's sake."""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import AsyncIterator, Callable, Iterator

import pytest

from dataplane import model_cards
from dataplane.model_cards import ModelCards, own_card
from dataplane.upstream import Upstream

VLLM_CARD = {
    "id": "meta-llama/Llama-3.1-8B-Instruct", "object": "model", "created": 1796327242,
    "owned_by": "vllm", "root": "meta-llama/Llama-3.1-8B-Instruct", "parent": None,
    "max_model_len": 131072, "permission": [],
}  # fmt: skip
LORA_CARD = {
    "id": "sql-lora", "object": "model", "created": 1796327242, "owned_by": "vllm",
    "root": "/adapters/sql", "parent": "meta-llama/Llama-3.1-8B-Instruct",
    "max_model_len": None, "permission": [],
}  # fmt: skip


class Replica:
    """A loopback HTTP server answering every request with ``answer()``'s status and
    body, counting the requests."""

    def __init__(self, answer: Callable[[], tuple[int, bytes]]) -> None:
        self.answer = answer
        self.requests: list[bytes] = []
        self.url = ""
        self._server: asyncio.Server | None = None

    async def start(self) -> Replica:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self._server.sockets[0].getsockname()[1]}"
        return self

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while head := await reader.readuntil(b"\r\n\r\n"):
                self.requests.append(head)
                status, body = self.answer()
                writer.write(
                    b"HTTP/1.1 %d X\r\ncontent-type: application/json\r\n"
                    b"content-length: %d\r\n\r\n%s" % (status, len(body), body)
                )
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    async def aclose(self) -> None:
        assert self._server is not None
        self._server.close()
        await self._server.wait_closed()


def listing(*cards: dict[str, object]) -> Callable[[], tuple[int, bytes]]:
    return lambda: (200, json.dumps({"object": "list", "data": list(cards)}).encode())


@pytest.fixture
async def upstream() -> AsyncIterator[Upstream]:
    client = Upstream(connect_timeout_s=2.0, read_timeout_s=5.0)
    yield client
    await client.aclose()


@pytest.fixture
def silent() -> Iterator[str]:
    """A replica that never answers: a listening socket nobody accepts on."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(8)
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"


async def test_the_engines_cards_are_listed_as_the_engine_wrote_them(upstream: Upstream) -> None:
    replica = await Replica(listing(VLLM_CARD, LORA_CARD)).start()
    try:
        cards = ModelCards(upstream)
        found = await cards.cards({VLLM_CARD["id"]: replica.url, "sql-lora": replica.url})
    finally:
        await replica.aclose()
    assert found == {VLLM_CARD["id"]: VLLM_CARD, "sql-lora": LORA_CARD}
    assert len(replica.requests) == 1  # one list per replica asked, whatever its names
    assert replica.requests[0].startswith(b"GET /v1/models HTTP/1.1\r\n")


async def test_a_replicas_list_is_kept_for_the_ttl_and_asked_again_after_it(
    upstream: Upstream,
) -> None:
    replica = await Replica(listing(VLLM_CARD)).start()
    asked = {VLLM_CARD["id"]: replica.url}
    try:
        kept = ModelCards(upstream, ttl_s=60.0)
        for _ in range(5):
            assert (await kept.cards(asked))[VLLM_CARD["id"]] == VLLM_CARD
        assert len(replica.requests) == 1
        expired = ModelCards(upstream, ttl_s=0.0)  # each list expired when next asked
        for _ in range(3):
            assert (await expired.cards(asked))[VLLM_CARD["id"]] == VLLM_CARD
        assert len(replica.requests) == 4
    finally:
        await replica.aclose()


@pytest.mark.parametrize(
    "answer",
    [
        lambda: (401, b'{"error": "Unauthorized"}'),  # an engine started with --api-key
        lambda: (200, b"<html>not json</html>"),
        lambda: (200, b'{"object": "list", "data": {"id": "x"}}'),
        lambda: (200, b"[" * 100_000 + b"]" * 100_000),  # nested past any parser's depth
        lambda: (200, json.dumps({"data": [{"id": "m", "pad": "x" * (1 << 21)}]}).encode()),
    ],
    ids=["401", "not-json", "no-list", "deep", "oversized"],
)
async def test_an_engine_that_gives_no_cards_gets_the_proxys_own(
    upstream: Upstream, answer: Callable[[], tuple[int, bytes]]
) -> None:
    replica = await Replica(answer).start()
    try:
        found = await ModelCards(upstream).cards({"m": replica.url})
    finally:
        await replica.aclose()
    assert found == {"m": own_card("m")}


async def test_an_oversized_streamed_list_is_refused(upstream: Upstream) -> None:
    """A list sent chunked (no content-length) is read only up to the bound."""
    body = json.dumps({"data": [{"id": "m", "pad": "x" * (1 << 21)}]}).encode()

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
        for i in range(0, len(body), 65536):
            piece = body[i : i + 65536]
            writer.write(b"%x\r\n%s\r\n" % (len(piece), piece))
        writer.write(b"0\r\n\r\n")
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    try:
        assert await ModelCards(upstream).cards({"m": url}) == {"m": own_card("m")}
    finally:
        server.close()
        await server.wait_closed()


async def test_a_silent_replica_costs_the_listing_the_timeout_not_more(
    upstream: Upstream, silent: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(model_cards, "CARDS_TIMEOUT_S", 0.2)
    loop = asyncio.get_running_loop()
    started = loop.time()
    assert await ModelCards(upstream).cards({"m": silent}) == {"m": own_card("m")}
    assert 0.2 <= loop.time() - started < 2.0


async def test_a_name_its_replica_does_not_list_takes_another_replicas_card(
    upstream: Upstream, silent: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Replicas of one model may list different adapters: a card any replica asked lists
    is used, and a replica that failed is asked again next time, not remembered."""
    monkeypatch.setattr(model_cards, "CARDS_TIMEOUT_S", 0.2)
    base = await Replica(listing(VLLM_CARD)).start()
    adapters = await Replica(listing(VLLM_CARD, LORA_CARD)).start()
    try:
        cards = ModelCards(upstream)
        asked = {VLLM_CARD["id"]: base.url, "sql-lora": base.url, "other": adapters.url}
        found = await cards.cards(asked)
        assert found == {
            VLLM_CARD["id"]: VLLM_CARD, "sql-lora": LORA_CARD, "other": own_card("other"),
        }  # fmt: skip
        assert await cards.cards({"m": silent}) == {"m": own_card("m")}
        assert silent not in cards._kept
    finally:
        await base.aclose()
        await adapters.aclose()
