"""Disaggregated prefill/decode: KV transfer between two simulated engines, as vLLM
0.33's NIXL connector (pull mode) and SGLang 0.5.23's disaggregation mode do it.

vLLM: the roles are per request, set by the router in ``kv_transfer_params``:

- ``do_remote_decode``: this engine is the prefill side. The request runs as any other
  (the router sends it with ``max_tokens`` 1; its cache, events and metrics as usual),
  but when it finishes its blocks are not freed: they are held for the decode engine to
  read, and the answer carries the parameters naming them (the connector's
  ``request_finished``, field for field: ``do_remote_prefill`` true, ``remote_block_ids``
  (one list per KV cache group), ``remote_engine_id``, ``remote_request_id``,
  ``remote_host`` and ``remote_port`` of the side channel, ``tp_size``, ``dcp_size``,
  ``pp_size``, ``remote_num_tokens``, ``remote_blocks_expiry_time``,
  ``remote_registration_generation``, ``transfer_mode``). The blocks are freed when the
  decode side has read them, or when the lease (vLLM's ``kv_lease_duration``, 30 s) runs
  out.
- ``do_remote_prefill``: this engine is the decode side. Before the request is queued
  the engine reads the blocks from the engine named (``POST /sim/kv_pull`` on
  ``remote_host:remote_port``, the simulator's stand-in for NIXL's side channel) and
  waits the modelled transfer time (``--kv-transfer-block-ms`` a block). As NIXL's
  connector, it reads only the prompt beyond the leading blocks its own cache holds
  (``get_num_new_matched_tokens`` counts the prompt less the local hit; the worker reads
  the prefill's last blocks into the ones allocated for them), and the request is
  admitted with every prompt token but the last computed: vLLM's scheduler sets
  ``num_computed_tokens`` to the prompt less one when every token was loaded
  (``_update_waiting_for_remote_kv``: the last one is computed again for its logits), so
  its ``cached_tokens`` are the prompt less one; the metrics count the read as the
  connector's hits and the local hit as the prefix cache's. A read that is refused (an
  unknown or expired request, another engine's id, a block list that is not the one
  held) fails the request as vLLM's default ``kv_load_failure_policy`` "fail" does:
  finish reason error, which its server answers 500 ``Internal server error``
  (``GenerationError``).

SGLang: the role is the server's (``--disaggregation-mode prefill|decode``, told in
``/server_info``), and the router adds ``bootstrap_host``, ``bootstrap_port`` (the prefill
server's bootstrap server; the simulator's is its HTTP port) and ``bootstrap_room`` (a
random 63-bit id pairing the two halves) to the body and sends it to both servers at
once. The prefill server computes the prompt (one token), holds the blocks in the room
and answers once the decode server has read them (or fails after the waiting timeout);
the decode server reads the room (``POST /sim/kv_pull`` with ``bootstrap_room``, waiting
for the prefill to arrive up to the bootstrap timeout) and decodes. By default it reads
every prompt block: SGLang resolves ``disable_radix_cache`` for a decode server
(``handle_pd_disaggregation``), so its tree (``radix_cache.py``, ``disable``) matches,
keeps and publishes nothing. Started with ``--disaggregation-decode-enable-radix-cache``
it keeps a radix cache (published like any), reads only the pages beyond its match
(SGLang's ``decode_prefix_len``) and adds its own hit beyond the prefill's to the
count (``prepare_for_prebuilt``). Either way it answers the ``cached_tokens`` its prefill
server found, which SGLang's metadata buffer carries with the first token
(``_commit_transfer_to_req``); the read's answer carries them here. A read that fails
aborts the decode request as SGLang does: 500 ``Decode handshake failed ...``.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import aiohttp

from enginesim import protocol as p

if TYPE_CHECKING:
    from enginesim.request import SimRequest

TRANSFER_MODE = "pull"
PULL_PATH = "/sim/kv_pull"
PULL_TIMEOUT_S = 30.0  # above the bootstrap wait of a read that waits for its prefill


class KvLoadFailed(p.ApiError):
    """The decode side could not read the prefill's KV: vLLM's ``GenerationError``."""

    def __init__(self, reason: str) -> None:
        super().__init__("Internal server error")
        self.reason = reason


@dataclass(frozen=True)
class RemotePrefill:
    """What a decode-side request's ``kv_transfer_params`` name: the blocks to read."""

    engine_id: str
    request_id: str
    host: str
    port: int
    block_ids: list[list[int]]

    @classmethod
    def parse(cls, params: dict[str, Any]) -> RemotePrefill:
        """The read asked for; ``KvLoadFailed`` when a field is missing or mistyped
        (vLLM's connector cannot start the read either)."""
        try:
            blocks = params["remote_block_ids"]
            if not all(isinstance(g, list) and all(isinstance(b, int) for b in g) for g in blocks):
                raise TypeError("remote_block_ids")
            return cls(
                str(params["remote_engine_id"]),
                str(params["remote_request_id"]),
                str(params["remote_host"]),
                int(params["remote_port"]),
                blocks,
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise KvLoadFailed(f"kv_transfer_params incomplete: {exc}") from exc

    def pull_body(self) -> dict[str, Any]:
        return {
            "remote_engine_id": self.engine_id,
            "remote_request_id": self.request_id,
            "remote_block_ids": self.block_ids,
        }

    @property
    def num_blocks(self) -> int:
        return sum(len(group) for group in self.block_ids)


@dataclass(frozen=True)
class Bootstrap:
    """SGLang's routing fields of one request: where its prefill's KV is to be read."""

    host: str
    port: int
    room: int

    @classmethod
    def of(cls, host: str | None, port: int | None, room: int | None) -> Bootstrap | None:
        """A request's routing fields, when it has all three (else it is not paired)."""
        if host and port and room is not None:
            return cls(host, port, room)
        return None

    def pull_body(self) -> dict[str, Any]:
        return {"bootstrap_room": self.room}


@dataclass
class _Held:
    req: SimRequest
    block_ids: list[list[int]]
    expires: float  # time.monotonic()


class _Room:
    """One SGLang bootstrap room: the prefill's blocks arrive (``held``), the decode
    server reads them (``read``), in either order of arrival."""

    def __init__(self) -> None:
        self.held = asyncio.Event()
        self.read = asyncio.Event()
        self.req: SimRequest | None = None


class KvTransfers:
    """One engine's KV transfers: the blocks it holds for decode engines (prefill side)
    and its reads from prefill engines (decode side)."""

    def __init__(self, lease_s: float, block_seconds: float) -> None:
        self.engine_id = str(uuid.uuid4())
        self.host, self.port = "127.0.0.1", 0  # the side channel: set once bound
        self.lease_s = lease_s
        self.block_seconds = block_seconds  # wall seconds to read one block
        self.pulled = self.expired = self.refused = 0
        self.blocks_read = 0  # decode side: blocks read from prefill engines
        self._held: dict[str, _Held] = {}
        self._rooms: dict[int, _Room] = {}
        self._session: aiohttp.ClientSession | None = None

    # -- prefill side --------------------------------------------------------------------

    def hold(self, req: SimRequest, block_ids: list[int]) -> None:
        """``req`` finished as a prefill for a decode engine: keep its blocks for the
        lease (in its bootstrap room too, for SGLang)."""
        self._held[req.request_id] = _Held(req, [block_ids], time.monotonic() + self.lease_s)
        if req.bootstrap_room is not None:
            room = self._room(req.bootstrap_room)
            room.req = req
            room.held.set()

    def _room(self, number: int) -> _Room:
        room = self._rooms.get(number)
        if room is None:
            room = self._rooms[number] = _Room()
        return room

    async def read_room(self, number: int) -> SimRequest | None:
        """A decode server reads room ``number``: waits up to the lease for its
        prefill to finish, then takes its request (to be freed now); ``None`` when the
        prefill never came, or its blocks were freed."""
        room = self._room(number)
        try:
            await asyncio.wait_for(room.held.wait(), self.lease_s)
        except TimeoutError:
            self._rooms.pop(number, None)
            self.refused += 1
            return None
        req = room.req
        if req is None or self._held.pop(req.request_id, None) is None:
            self.refused += 1
            return None
        room.read.set()
        self.pulled += 1
        return req

    async def until_read(self, req: SimRequest) -> bool:
        """The SGLang prefill's answer waits for its decode server to read the room:
        ``False`` when it did not within the lease (the blocks are freed by then)."""
        assert req.bootstrap_room is not None
        room = self._room(req.bootstrap_room)
        try:
            await asyncio.wait_for(room.read.wait(), self.lease_s)
            return True
        except TimeoutError:
            return False
        finally:
            self._rooms.pop(req.bootstrap_room, None)

    def params_of(self, req: SimRequest) -> dict[str, Any] | None:
        """The ``kv_transfer_params`` the answer to a held request carries."""
        held = self._held.get(req.request_id)
        if held is None:
            return None
        return {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_block_ids": held.block_ids,
            "remote_engine_id": self.engine_id,
            "remote_request_id": req.request_id,
            "remote_host": self.host,
            "remote_port": self.port,
            "tp_size": 1,
            "dcp_size": 1,
            "pp_size": 1,
            "remote_num_tokens": len(req.prompt),
            "remote_blocks_expiry_time": None,
            "remote_registration_generation": 0,
            "transfer_mode": TRANSFER_MODE,
        }

    def release(self, body: dict[str, Any]) -> SimRequest | None:
        """A decode engine reads the blocks ``body`` names: the request whose blocks
        they are (to be freed now), or ``None`` when the read is refused."""
        held = self._held.get(str(body.get("remote_request_id")))
        matches = (
            held is not None
            and body.get("remote_engine_id") == self.engine_id
            and body.get("remote_block_ids") == held.block_ids
        )
        if held is None or not matches:
            self.refused += 1
            return None
        del self._held[held.req.request_id]
        self.pulled += 1
        return held.req

    def expire(self) -> list[SimRequest]:
        """The held requests whose lease ran out, forgotten: their blocks are freed."""
        now = time.monotonic()
        gone = [h for h in self._held.values() if h.expires <= now]
        for held in gone:
            del self._held[held.req.request_id]
            if held.req.bootstrap_room is not None:
                self._rooms.pop(held.req.bootstrap_room, None)
        self.expired += len(gone)
        return [h.req for h in gone]

    def next_expiry(self) -> float | None:
        return min((h.expires for h in self._held.values()), default=None)

    def clear(self) -> None:
        """An engine restart: every held block is gone with the cache."""
        self._held.clear()
        self._rooms.clear()

    @property
    def num_held(self) -> int:
        return len(self._held)

    # -- decode side ---------------------------------------------------------------------

    async def pull(self, remote: RemotePrefill | Bootstrap, num_blocks: int) -> int:
        """Read ``num_blocks`` of ``remote``'s blocks from the prefill engine, taking the
        modelled transfer time; the cached tokens the prefill found (SGLang's metadata
        buffer carries them; 0 for vLLM, whose connector does not). ``KvLoadFailed`` when
        the prefill engine refuses or cannot be reached."""
        url = f"http://{remote.host}:{remote.port}{PULL_PATH}"
        try:
            async with self._client().post(url, json=remote.pull_body()) as resp:
                if resp.status != 200:
                    raise KvLoadFailed(f"the prefill engine refused the read ({resp.status})")
                answer = await resp.json()
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            raise KvLoadFailed(f"the prefill engine cannot be reached: {exc}") from exc
        self.blocks_read += num_blocks
        if self.block_seconds:
            await asyncio.sleep(self.block_seconds * num_blocks)
        cached = answer.get("cached_tokens") if isinstance(answer, dict) else None
        return cached if isinstance(cached, int) else 0

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None:
            timeout = aiohttp.ClientTimeout(total=PULL_TIMEOUT_S)
            self._session = aiohttp.ClientSession(timeout=timeout)
        return self._session

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()
