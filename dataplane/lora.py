"""LoRA adapters across the pool: loading one where a workload says to, and the load and
unload routes acting on the pool.

Routing by adapter needs nothing here: a replica's sidecar announces the adapters its
engine has loaded (name -> path, from the engine's ``/v1/models``), the fleet state
counts each as a name only its holders serve, and the router keys an adapter's prompt
under the adapter as the engine keys its blocks (``kvcore.keys``), so a request naming
one goes only to its holders, scored by their residency. This module covers the rest:

- a request naming an adapter no routable replica holds, in a workload with
  ``lora_on_miss: load`` (the default ``refuse`` answers OpenAI's 404): the adapter is
  loaded (its path as a replica announced it, or as loaded through this proxy) onto the
  least-loaded replica of its base model, through the engine's own API (vLLM
  ``/v1/load_lora_adapter``, SGLang ``/load_lora_adapter``), and the request goes
  there; so does any request for it until the replica's announce shows the adapter
  (``PLACED_TTL_S``). A replica already holding ``lora_max_per_replica`` adapters first
  unloads the one this proxy routed to least recently. When every holder is at the
  workload's ``lora_spread_load`` (0.6), ``load`` adds a replica the same way.
- ``POST /v1/load_lora_adapter`` through the proxy loads onto ``lora_load_replicas``
  replicas of the model (least loaded first; 0: all), ``/v1/unload_lora_adapter``
  unloads from every holder; never one replica picked at random. A name an engine would
  not take as a model name (``ADAPTER_NAME``) is a 400.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Iterable, Mapping
from typing import Any, TypeVar, cast

from dataplane.endpoints import Endpoint
from dataplane.fleet.state import FleetState
from dataplane.http_errors import ApiError, BadRequest, NotFound
from dataplane.upstream import Retriable, Upstream
from kvcore.policies import ReplicaState
from kvcore.workload import Workload
from kvcore.workload.classify import WORKLOAD_HEADER

log = logging.getLogger("dataplane")
T = TypeVar("T")
PLACED_TTL_S = 5.0  # a load this proxy made routes its adapter until announced
PATHS_REMEMBERED = 4096
ADAPTER_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:@+-]{0,127}$")
LOAD_PATHS = {"vllm": "/v1/load_lora_adapter", "sglang": "/load_lora_adapter"}
UNLOAD_PATHS = {"vllm": "/v1/unload_lora_adapter", "sglang": "/unload_lora_adapter"}
ROUTES = frozenset({*LOAD_PATHS.values(), *UNLOAD_PATHS.values()})


class AdapterLoadFailed(ApiError):
    """An engine refused to load or unload an adapter: its 4xx and words passed on; a
    5xx, or no answer, is the proxy's 502 (the engine's failure, not the client's)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message, "lora_name", "adapter_load_failed")
        self.status = status if 400 <= status < 500 else 502
        self.error_type = "invalid_request_error" if self.status < 500 else "upstream_error"


class LoraPlacement:
    """What one proxy knows and does about adapters beyond the fleet's announces."""

    def __init__(
        self, fleet: FleetState, upstream: Upstream, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.fleet = fleet
        self.upstream = upstream
        self.clock = clock
        self._paths: OrderedDict[str, str] = OrderedDict()  # every adapter path seen
        # whether any adapter was announced or loaded yet: until then no name is one, and
        # the handler (compiled) asks nothing of this class (from source) for a request
        self.known = False
        self._placed: dict[str, tuple[int, float]] = {}  # adapter -> (ordinal, until)
        self._used: dict[int, OrderedDict[str, None]] = {}  # per replica, LRU first
        self._locks: dict[str, asyncio.Lock] = {}
        # (action "load"/"unload", outcome "ok"/"failed") of each engine call, for metrics
        self.counted: Callable[[str, str], None] = lambda action, outcome: None
        fleet.subscribe(self._learn_paths)  # kept after the adapter is unloaded everywhere
        self._learn_paths()

    # -- requests ------------------------------------------------------------------

    def names_adapter(self, model: str) -> bool:
        """Whether ``model`` is an adapter this proxy knows of (cheap: every request)."""
        return self.fleet.catalogue.adapter_base(model) is not None or model in self._paths

    async def place(self, model: str, workload: Workload) -> int | None:
        """The replica a request for adapter ``model`` must go to because this proxy
        loads (or just loaded) it there; None: route as usual (to its holders, or 404)."""
        holders = self.fleet.views.view(model).replicas()
        if holders and not _all_saturated(holders, workload):
            return None
        placed = self._placement(model)
        if placed is not None or workload.lora_on_miss != "load":
            return placed
        path = self._paths.get(model)
        if path is None:
            return None  # never seen loaded anywhere: nothing to load from (404)
        async with self._locks.setdefault(model, asyncio.Lock()):
            placed = self._placement(model)  # a request before this one may have loaded it
            if placed is not None:
                return placed
            target = self._target(model, {h.ordinal for h in holders})
            if target is None:
                return None
            try:
                await self._load_onto(target, model, path, workload.lora_max_per_replica)
            except AdapterLoadFailed as exc:
                if exc.status >= 500:
                    raise
                raise NotFound(  # the engine will not have it: no such model, as refused
                    f"The model `{model}` does not exist: loading it failed ({exc.message}).",
                    "model",
                    "model_not_found",
                ) from None
            self._placed[model] = (target.ordinal, self.clock() + PLACED_TTL_S)
            return target.ordinal

    def _placement(self, model: str) -> int | None:
        """The replica this proxy loaded ``model`` onto lately, while it is there."""
        placed = self._placed.get(model)
        if placed is None:
            return None
        ordinal, until = placed
        if self.clock() >= until or self.fleet.replicas.endpoint(ordinal) is None:
            del self._placed[model]
            return None
        return ordinal

    def routed(self, model: str, ordinal: int | None) -> None:
        """A request for adapter ``model`` went to ``ordinal`` (least recently used order)."""
        if ordinal is not None:
            used = self._used.setdefault(ordinal, OrderedDict())
            used[model] = None
            used.move_to_end(model)

    def _learn_paths(self) -> None:
        """Remember the path of every adapter announced (on each membership change)."""
        paths = self.fleet.catalogue.adapter_paths()
        if paths:
            self.known = True
        for name, path in paths.items():
            self._remember(name, path)

    def _remember(self, name: str, path: str) -> None:
        if path:
            self.known = True
            self._paths[name] = path
            self._paths.move_to_end(name)
            while len(self._paths) > PATHS_REMEMBERED:
                self._paths.popitem(last=False)

    def _target(self, model: str, holders: set[int]) -> Endpoint | None:
        """The least-loaded replica of the adapter's base model without it."""
        base = self.fleet.catalogue.adapter_base(model) or self._base_model()
        states = [s for s in self.fleet.views.view(base).replicas() if s.ordinal not in holders]
        if not states:
            return None
        best = min(states, key=lambda s: (s.load, len(self._used.get(s.ordinal, ()))))
        return self.fleet.replicas.endpoint(best.ordinal)

    def _base_model(self) -> str:
        models = self.fleet.catalogue.base_models()
        return models[0] if len(models) == 1 else ""

    async def _load_onto(self, endpoint: Endpoint, model: str, path: str, bound: int) -> None:
        """Load ``model`` onto ``endpoint``, first unloading its least recently used
        adapter(s) while it holds ``bound`` or more."""
        holding = self._holding(endpoint)
        used = self._used.setdefault(endpoint.ordinal, OrderedDict())
        while len(holding) >= bound:
            victim = next((n for n in used if n in holding), None) or next(iter(holding))
            await self._unload(endpoint, victim)
            holding.discard(victim)
            used.pop(victim, None)
        body = {"lora_name": model, "lora_path": path}
        status, words = await self._engine_call(endpoint, LOAD_PATHS, body)
        if status == 400 and "already" in words:  # loaded before its announce came
            return
        if status != 200:
            self.counted("load", "failed")
            raise AdapterLoadFailed(status, f"replica {endpoint.replica_id} refused: {words}")
        self.counted("load", "ok")
        log.info("loaded LoRA adapter", extra={"adapter": model, "replica": endpoint.replica_id})

    async def _unload(self, endpoint: Endpoint, model: str) -> bool:
        """Unload ``model`` from ``endpoint``; False when the engine does not have it."""
        status, words = await self._engine_call(endpoint, UNLOAD_PATHS, {"lora_name": model})
        if status in (400, 404):  # vLLM's NotFoundError, SGLang's failed unload
            return False
        if status != 200:
            self.counted("unload", "failed")
            raise AdapterLoadFailed(status, f"replica {endpoint.replica_id} refused: {words}")
        self.counted("unload", "ok")
        return True

    def _holding(self, endpoint: Endpoint) -> set[str]:
        record = self.fleet.replicas.replica_info(endpoint.ordinal)
        held = set(record.lora_adapters) if record is not None else set()
        held |= {name for name, (o, until) in self._placed.items() if o == endpoint.ordinal}
        return held

    async def _engine_call(
        self, endpoint: Endpoint, paths: Mapping[str, str], body: dict[str, Any]
    ) -> tuple[int, str]:
        """The engine's status and words (``AdapterLoadFailed`` 503 if unreachable)."""
        path = paths.get(endpoint.engine_kind, paths["vllm"])
        headers = [("content-type", "application/json")]
        try:
            opened = await self.upstream.open(
                "POST", endpoint.base_url + path, json.dumps(body).encode(), headers
            )
        except Retriable as exc:
            self.counted("load" if paths is LOAD_PATHS else "unload", "failed")
            raise AdapterLoadFailed(503, f"replica {endpoint.replica_id}: {exc}") from None
        text = opened.first
        while chunk := await opened.next_chunk():
            text += chunk
        opened.release()
        return opened.status, text.decode("utf-8", "replace")[:500]

    # -- the load and unload routes ----------------------------------------------------

    async def admin(self, path: str, body: bytes, headers: Mapping[str, str]) -> str:
        """``/v1/load_lora_adapter`` or ``/v1/unload_lora_adapter`` (or SGLang's) on the
        pool; vLLM's success text; raises an OpenAI-shaped error."""
        fields = _fields(body)
        name = fields.get("lora_name")
        if not isinstance(name, str) or not ADAPTER_NAME.match(name):
            raise BadRequest(
                f"'lora_name' must be an adapter name an engine takes as a model name "
                f"(letters, digits and ._:@+-, at most 128): {name!r}.",
                "lora_name",
                "invalid_lora_name",
            )
        if path in UNLOAD_PATHS.values():
            return await self._unload_everywhere(name)
        lora_path = fields.get("lora_path")
        if not isinstance(lora_path, str) or not lora_path:
            raise BadRequest("Both 'lora_name' and 'lora_path' must be provided.", "lora_path")
        return await self._load_on_pool(name, lora_path, self._workload(headers))

    def _workload(self, headers: Mapping[str, str]) -> Workload:
        config = self.fleet.catalogue.routing_config()
        return config.workload(headers.get(WORKLOAD_HEADER) or config.default_workload)

    async def _load_on_pool(self, name: str, lora_path: str, workload: Workload) -> str:
        base = self.fleet.catalogue.adapter_base(name) or self._base_model()
        holders = {s.ordinal for s in self.fleet.views.view(name).replicas()}
        states = sorted(
            (s for s in self.fleet.views.view(base).replicas() if s.ordinal not in holders),
            key=lambda s: s.load,
        )
        wanted = workload.lora_load_replicas or len(states) + len(holders)
        targets = states[: max(wanted - len(holders), 0)]
        if not targets and not holders:
            raise NotFound(f"No replica serves a model to load `{name}` onto.", "lora_name")
        self._remember(name, lora_path)
        endpoints = self._endpoints(s.ordinal for s in targets)
        bound = workload.lora_max_per_replica
        await _all_or_first_error(self._load_onto(e, name, lora_path, bound) for e in endpoints)
        if endpoints:
            self._placed[name] = (endpoints[0].ordinal, self.clock() + PLACED_TTL_S)
        return f"Success: LoRA adapter '{name}' added successfully."

    async def _unload_everywhere(self, name: str) -> str:
        """Every replica of the adapter's model is asked (an announce may lag behind a
        load); the engines that do not have it say so, and are passed over."""
        base = self.fleet.catalogue.adapter_base(name) or self._base_model()
        ordinals = {s.ordinal for s in self.fleet.views.view(base).replicas()}
        ordinals |= {s.ordinal for s in self.fleet.views.view(name).replicas()}
        self._placed.pop(name, None)
        endpoints = self._endpoints(sorted(ordinals))
        unloaded = await _all_or_first_error(self._unload(e, name) for e in endpoints)
        for ordinal in ordinals:
            self._used.get(ordinal, OrderedDict()).pop(name, None)
        if not any(unloaded):
            raise NotFound(f"The lora adapter '{name}' cannot be found.", "lora_name")
        return f"Success: LoRA adapter '{name}' removed successfully."

    def _endpoints(self, ordinals: Iterable[int]) -> list[Endpoint]:
        found = (self.fleet.replicas.endpoint(o) for o in ordinals)
        return [e for e in found if e is not None]


async def _all_or_first_error(calls: Iterable[Awaitable[T]]) -> list[T]:
    """Every call run at once; the first failure raised once all have ended."""
    results = await asyncio.gather(*calls, return_exceptions=True)
    for result in results:
        if isinstance(result, BaseException):
            raise result
    return cast(list[T], results)


def _all_saturated(holders: Iterable[ReplicaState], workload: Workload) -> bool:
    return all(h.load >= workload.lora_spread_load for h in holders)


def _fields(body: bytes) -> dict[str, Any]:
    try:
        fields = json.loads(body or b"{}")
    except (ValueError, RecursionError):
        raise BadRequest("The body is not JSON.") from None
    if not isinstance(fields, dict):
        raise BadRequest("The body must be a JSON object.")
    return fields
