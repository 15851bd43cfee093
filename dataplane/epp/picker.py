"""Picking replicas for requests a gateway holds: the proxy's routing, without its hop.

A request is routed exactly as the proxy routes it (``dataplane.routing``: classify,
tokenize, key, the workload's policy, on the same ``RoutingState.Watch`` state) and
booked the way the proxy books one it sends (``Dispatcher.sent``: in-flight count,
speculative residency, prefill books), but the gateway sends it. So the picker gives the
gateway an ordered list: the policy's choice, then up to ``fallback_endpoints`` other
eligible replicas for its retries, those holding more of the prompt first, then the less
loaded. When the gateway says another one served (a retry), the first is charged with a
failure (its circuit breaker, as the proxy's retry would) and the request moves to the
one that served. The answer's usage, read as it passes back, feeds the same fidelity
counters and reports as the proxy's (``Dispatcher.account``).

Refusals, each an :class:`~dataplane.http_errors.ApiError` the stream turns into an
``ImmediateResponse``: 400/404 as the proxy's; 503 when no replica (of the gateway's
subset hint, if it gave one) can serve; 429 when the request's inference objective is
sheddable and every eligible replica is saturated.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from dataplane.app import INFERENCE, THREAD_PROMPT_CHARS
from dataplane.endpoints import Endpoint
from dataplane.epp.messages import OBJECTIVE_HEADERS
from dataplane.exchange import Dispatcher, Exchange
from dataplane.fleet.inflight import InflightTicket
from dataplane.fleet.state import FleetState
from dataplane.http_errors import ApiError, BadRequest, NoReplica, NotFound
from dataplane.openai_request import InferenceRequest, decode_object, parse_inference
from dataplane.relay import Usage
from dataplane.routing import Prepared, Router, _cached
from kvcore.policies import RouteContext
from kvcore.policies.screening import ALL_SATURATED, screen_rows

NO_SUBSET_REPLICA = "no replica of the gateway's subset hint can serve this request"


class Shed(ApiError):
    """429: a sheddable request while every replica is saturated."""

    status, error_type = 429, "rate_limit_exceeded"


@dataclass(slots=True)
class Pick:
    """One request's endpoints, primary first, and its bookkeeping until it ends."""

    endpoints: list[Endpoint]
    predicted: list[int]  # cached tokens predicted on each endpoint
    exchange: Exchange | None  # None: not an inference request (nothing counted)
    body: bytes  # what the replica gets (the client's, unless usage or salt was added)
    ticket: InflightTicket | None = None
    served: int = 0  # index in ``endpoints`` of the one that served
    handed_at: float = 0.0  # perf_counter when the gateway got the pick
    answered: bool = False
    usage: Usage | None = field(default=None)

    def addresses(self) -> str:
        return ",".join(address_of(e) for e in self.endpoints)


def address_of(endpoint: Endpoint) -> str:
    """``ip:port`` of a replica's base URL, as the gateway's endpoints are named."""
    parts = urlsplit(endpoint.base_url)
    port = parts.port or (443 if parts.scheme == "https" else 80)
    host = parts.hostname or ""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


class Picker:
    """Routes requests for a gateway; one per process."""

    def __init__(
        self,
        fleet: FleetState,
        router: Router,
        dispatcher: Dispatcher,
        *,
        fallbacks: int,
        sheddable: frozenset[str],
    ) -> None:
        self.fleet = fleet
        self.router = router
        self.dispatcher = dispatcher
        self.fallbacks = fallbacks
        self.sheddable = sheddable

    # -- the request ----------------------------------------------------------------

    async def pick(
        self,
        headers: Mapping[str, str],
        body: bytes,
        subset: frozenset[str] | None,
        *,
        add_usage: bool,
    ) -> Pick:
        """Endpoints for a request; ``add_usage``: the answer passes back through the
        picker, which can take out a usage event the client did not ask for."""
        path = headers.get(":path", "").partition("?")[0]
        kind = INFERENCE.get(path)
        if kind is None:
            return self._forwarded(headers, body, subset)
        inference = parse_inference(body, kind)
        if not inference.model:
            inference.model = self._default_model()
        request_id = headers.get("x-request-id", "")
        started = time.perf_counter()
        prepared = await self._prepare(inference, path, headers, request_id)
        exclude = self._outside(subset)
        now = time.monotonic()
        if self._shed(prepared, headers, exclude, now):
            raise Shed("Every replica is saturated and this request's objective is sheddable.",
                       code="saturated")  # fmt: skip
        decision, predicted = self.router.choose(
            prepared, now=now, exclude=exclude | self.dispatcher.breakers.excluded(now)
        )
        endpoint = (
            None if decision.ordinal is None else self.fleet.replicas.endpoint(decision.ordinal)
        )
        if endpoint is None:
            raise NoReplica(
                NO_SUBSET_REPLICA if subset is not None else "No replica can take the request.",
                self.dispatcher.policies.retry_after_s,
            )
        exchange = Exchange(inference, prepared, time.perf_counter() - started)
        others, their_predictions = self._fallbacks(prepared, endpoint.ordinal, exclude, now)
        upstream = inference.upstream_body(
            include_usage=add_usage and inference.adds_usage, cache_salt=prepared.upstream_salt
        )
        pick = Pick([endpoint, *others], [predicted, *their_predictions], exchange, upstream)
        pick.ticket = self.dispatcher.sent(exchange, decision, endpoint, now, predicted)
        return pick

    async def _prepare(
        self, inference: InferenceRequest, path: str, headers: Mapping[str, str], request_id: str
    ) -> Prepared:
        """As the proxy prepares: on the event loop unless the prompt is long or its
        tokenizer is still to be loaded."""
        router = self.router
        inline = len(inference.raw) <= THREAD_PROMPT_CHARS and router.tokenizers.loaded(
            router.tokenizer_spec(inference.model)
        )
        if inline:
            return router.prepare(
                inference, path=path, headers=headers, api_key=None, request_id=request_id,
                keys_read=False,
            )  # fmt: skip
        return await asyncio.to_thread(
            router.prepare, inference, path=path, headers=headers, api_key=None,
            request_id=request_id,
        )  # fmt: skip

    def _outside(self, subset: frozenset[str] | None) -> frozenset[int]:
        """The replicas the gateway's subset hint leaves out."""
        if subset is None:
            return frozenset()
        return frozenset(
            e.ordinal for e in self.fleet.replicas.endpoints() if address_of(e) not in subset
        )

    def _shed(
        self, prepared: Prepared, headers: Mapping[str, str], exclude: frozenset[int], now: float
    ) -> bool:
        """A sheddable objective's request while every eligible replica is saturated."""
        if not self.sheddable or not any(
            headers.get(name) in self.sheddable for name in OBJECTIVE_HEADERS
        ):
            return False
        ctx = RouteContext(workload=prepared.workload, model=prepared.key_model, now=now,
                           exclude=exclude)  # fmt: skip
        screened = screen_rows(ctx, self.fleet.views.view(prepared.model).replicas())
        return screened.note == ALL_SATURATED

    def _fallbacks(
        self, prepared: Prepared, chosen: int, exclude: frozenset[int], now: float
    ) -> tuple[list[Endpoint], list[int]]:
        """Up to ``fallbacks`` other eligible replicas, the longest prefix held first,
        then the lowest load, each with the cached tokens predicted there."""
        if not self.fallbacks:
            return [], []
        view = self.fleet.views.view(prepared.model)
        ctx = RouteContext(workload=prepared.workload, model=prepared.key_model, now=now,
                           exclude=exclude | {chosen})  # fmt: skip
        eligible = screen_rows(ctx, view.replicas()).usable
        keys = prepared.block_keys
        runs = view.leading_runs(keys, now=now) if keys and eligible else {}
        ranked = sorted(eligible, key=lambda r: (-runs.get(r.ordinal, 0), r.load, r.ordinal))
        endpoints, predicted = [], []
        for replica in ranked[: self.fallbacks]:
            endpoint = self.fleet.replicas.endpoint(replica.ordinal)
            if endpoint is not None:
                endpoints.append(endpoint)
                run = runs.get(replica.ordinal, 0)
                predicted.append(_cached(run, prepared.prompt_tokens, prepared.block_size))
        return endpoints, predicted

    def _forwarded(
        self, headers: Mapping[str, str], body: bytes, subset: frozenset[str] | None
    ) -> Pick:
        """A request other than inference: the least-loaded replica serving the model the
        body names (else the fleet's only one), as the proxy forwards it."""
        model = ""
        if body:
            with contextlib.suppress(BadRequest):
                named = decode_object(body).get("model")
                model = named if isinstance(named, str) else ""
        ordinal = self.router.least_loaded(model or self._default_model())
        endpoint = None if ordinal is None else self.fleet.replicas.endpoint(ordinal)
        if endpoint is None or (subset is not None and address_of(endpoint) not in subset):
            raise NotFound(f"The model `{model}` does not exist.", "model", "model_not_found")
        return Pick([endpoint], [0], None, body)

    def _default_model(self) -> str:
        """The fleet's only model, for a request that names none (as the proxy)."""
        models = self.fleet.catalogue.base_models()
        if len(models) == 1:
            return models[0]
        if models:
            raise BadRequest(f"'model' is required: this picker serves {', '.join(models)}.",
                             "model")  # fmt: skip
        raise BadRequest("'model' is required: no replica has said which model it serves.",
                         "model")  # fmt: skip

    def refused(self, refusal: ApiError) -> None:
        """Count a request refused before any replica was picked (as the proxy counts
        one: no replica, its outcome)."""
        outcome = {503: "no_replica", 429: "shed"}.get(refusal.status, "client_error")
        self.dispatcher.metrics.count("", "", outcome)

    # -- the answer, as it passes back --------------------------------------------------

    def served_by(self, pick: Pick, address: str | None) -> None:
        """The gateway reports which endpoint served: another than the first means the
        first refused (its breaker counts a failure) and the request moved."""
        if address is None or pick.exchange is None or address == address_of(pick.endpoints[0]):
            return
        index = next((i for i, e in enumerate(pick.endpoints) if address_of(e) == address), None)
        if index is None or index == pick.served:
            return
        first = pick.endpoints[pick.served]
        dispatcher = self.dispatcher
        dispatcher.breakers.on_failure(first.replica_id, first.ordinal, time.monotonic())
        self.fleet.inflight.on_done(pick.ticket)
        endpoint = pick.endpoints[index]
        pick.served = index
        pick.exchange.tried.append(endpoint.replica_id)
        uncached = pick.exchange.prepared.prompt_tokens - pick.predicted[index]
        pick.ticket = self.fleet.inflight.on_sent(endpoint.ordinal, time.time(), uncached)

    def first_byte(self, pick: Pick, status: int, streaming: bool) -> None:
        """The answer's first bytes passed back (once)."""
        if pick.answered or pick.exchange is None:
            return
        pick.answered = True
        endpoint = pick.endpoints[pick.served]
        ttfb = time.perf_counter() - pick.handed_at
        self.dispatcher.first_byte(pick.ticket, endpoint.replica_id, status, streaming, ttfb)

    def finish(self, pick: Pick, status: int, outcome: str) -> None:
        """The request ended (``outcome`` as the proxy's); count it once."""
        exchange = pick.exchange
        if exchange is None:
            return
        pick.exchange = None
        if not pick.answered:  # ended before any answer: settle its prefill booking
            pick.answered = True
            self.fleet.inflight.on_first_byte(pick.ticket, status, False)
        self.fleet.inflight.on_done(pick.ticket)
        exchange.outcome = outcome
        exchange.usage = pick.usage
        served = pick.served
        self.dispatcher.account(exchange, pick.endpoints[served], pick.predicted[served], status)
