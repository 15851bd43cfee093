"""Routing one request: workload, tenant, tokens, block keys, then the workload's policy.

:meth:`Router.prepare` does the per-request work once (classify into a workload, find
the tenant's cache namespace, render, tokenize and key with the model's tokenizer
through ``kvcore.request.prompt_keys`` and a per-thread
:class:`~kvcore.tokenize.PrefixTokenCache`, which tokenizes and keys only what no recent
prompt began with; the explain endpoint reads requests through the same module);
:meth:`Router.choose` runs
the workload's policy and may run again with replicas excluded (a retry). Policies are
built once per workload and rebuilt when the routing config object changes; what a
requested model name resolves to (canonical id, tokenizer, block size) is remembered
until the fleet's replicas or config change (``ModelCatalogue.generation``).

Tenant namespace (``kvcore.tenancy``): the tenant is who the proxy knows the client to
be, never what it says: with ``--auth`` the API key's tenant, without it the configured
tenant header (which a front proxy that authenticates must set; without either, tenants
are not told apart, and the proxy says so at start-up). A client's ``cache_salt`` or
``prompt_cache_key`` only subdivides its own tenant's namespace; the namespace is the
``cache_salt`` set upstream, since the sidecar keys the engine's blocks under it.
"""

from __future__ import annotations

import contextlib
import logging
import random
import threading
from array import array
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from dataplane.fleet.state import FleetState
from dataplane.fleet.views import FleetView
from dataplane.hot_prefixes import HotPrefixBook
from dataplane.http_errors import BadRequest, NotFound
from dataplane.openai_request import InferenceRequest
from kvcore.keys import root_key
from kvcore.pb import routing_pb2
from kvcore.policies import Decision, Policy, ReplicaState, RouteContext, create_policy
from kvcore.policies.kv_scoring import KvScoringPolicy
from kvcore.request import InvalidRequest, keyed, later_prompts, prompt_keys, session_id
from kvcore.tenancy import cache_namespace
from kvcore.tokenize import Encoded, PrefixTokenCache, Tokenizer, TokenizerError, load_tokenizer
from kvcore.warmup import warming_excluded
from kvcore.workload import (
    RequestInfo,
    RoutingConfig,
    UnknownWorkload,
    Workload,
    parse_workload,
)
from kvcore.workload.classify import WORKLOAD_HEADER

log = logging.getLogger("dataplane")
ROOTS_REMEMBERED = 4096  # (model, tenant) roots kept before the memo starts over
MODELS_REMEMBERED = 1024  # requested model names resolved, kept before the memo starts over


@dataclass(frozen=True, slots=True)
class Defaults:
    """Tokenizer and block size of models the registry does not name."""

    tokenizer: str = "builtin"
    block_size: int = 16
    tenant_header: str = ""


@dataclass(slots=True)
class Prepared:
    """A request ready for its policy: everything computed once per request. Unkeyed
    (``keyed`` false: no tokens, no keys, ``prompt_tokens`` 0) when nothing would read the
    keys: see :meth:`Router.prepare`."""

    workload: Workload
    policy: Policy
    model: str  # the name the client asked for, or the model it stands for (behind SGLang
    # replicas of one model, a name nobody serves): what the fleet's view is keyed by
    key_model: str  # the canonical model id in block-key roots
    block_size: int
    namespace: str
    upstream_salt: str | None  # cache_salt to set upstream (None: leave the body alone)
    prompt_tokens: int
    block_keys: list[int]
    session_id: str | None
    request_id: str
    keyed: bool = True
    # a completion batch's prompts after the first, keyed only while the fleet keeps
    # prefill books (what else the batch asks its replica to prefill)
    later: tuple[Encoded, ...] = ()
    lora_name: str = ""  # the LoRA adapter the request names (its keys' root names it)
    only: int | None = None  # the replica an adapter was just loaded onto: route there

    def __init__(  # written out: one per request (see dataplane/native.py)
        self,
        workload: Workload,
        policy: Policy,
        model: str,
        key_model: str,
        block_size: int,
        namespace: str,
        upstream_salt: str | None,
        prompt_tokens: int,
        block_keys: list[int],
        session_id: str | None,
        request_id: str,
        keyed: bool = True,
        later: tuple[Encoded, ...] = (),
        lora_name: str = "",
        only: int | None = None,
    ) -> None:
        self.workload = workload
        self.policy = policy
        self.model = model
        self.key_model = key_model
        self.block_size = block_size
        self.namespace = namespace
        self.upstream_salt = upstream_salt
        self.prompt_tokens = prompt_tokens
        self.block_keys = block_keys
        self.session_id = session_id
        self.request_id = request_id
        self.keyed = keyed
        self.later = later
        self.lora_name = lora_name
        self.only = only


@dataclass(frozen=True, slots=True)
class _ModelRoute:
    """What a requested model name resolves to while the fleet's generation lasts."""

    generation: int
    name: str  # the name routed by (the fleet's views are keyed by it)
    key_model: str | None  # the canonical model id (None: nobody serves the name)
    spec: str  # the tokenizer spec
    block_size: int
    lora: str = ""  # the LoRA adapter the name is ("" for a model name)

    def for_adapter(self, lora: str, *, name: str, generation: int) -> _ModelRoute:
        """The route of LoRA adapter ``lora`` over this base model's: keyed, tokenized
        and sized as the base, routed by ``name`` as of ``generation``."""
        return _ModelRoute(generation, name, self.key_model, self.spec, self.block_size, lora)


_NOBODY = _ModelRoute(-1, "", None, "", 0)


class TokenizerPool:
    """Tokenizers by spec, loaded once, and one prefix cache (tokens and keys) per thread
    and tokenizer."""

    def __init__(self) -> None:
        self._tokenizers: dict[str, Tokenizer] = {}
        self._local = threading.local()
        self._lock = threading.Lock()

    def loaded(self, spec: str) -> bool:
        return spec in self._tokenizers

    def load(self, spec: str) -> Tokenizer:
        """Load ``spec`` (file I/O: call it off the event loop); raises TokenizerError."""
        with self._lock:
            tokenizer = self._tokenizers.get(spec)
            if tokenizer is None:
                tokenizer = self._tokenizers[spec] = load_tokenizer(spec)
            return tokenizer

    def token_cache(self, spec: str) -> PrefixTokenCache:
        caches: dict[str, PrefixTokenCache] | None = getattr(self._local, "caches", None)
        if caches is None:
            caches = self._local.caches = {}
        cache = caches.get(spec)
        if cache is None:
            cache = caches[spec] = PrefixTokenCache(self.load(spec))
        return cache


class Router:
    """Prepares requests and chooses replicas; one per worker process."""

    def __init__(
        self,
        fleet: FleetState,
        defaults: Defaults,
        rng: random.Random | None = None,
        place: int | None = None,
    ) -> None:
        """``place``: this proxy's index behind its balancer (``--proxy-index``)."""
        self.fleet = fleet
        self.catalogue = fleet.catalogue  # what names stand for
        self.views = fleet.views  # what policies read
        self.defaults = defaults
        self.tokenizers = TokenizerPool()
        self._rng = rng or random.Random()
        self._place = place
        self.hot: HotPrefixBook | None = None  # set when a control plane takes reports
        self._config: RoutingConfig | None = None
        self._policies: dict[str, Policy] = {}
        self._roots: dict[tuple[str, str, str], int] = {}
        self._models: dict[str, _ModelRoute] = {}
        self._refusing: set[str] = set()  # models whose tokenizer refused a prompt
        self._forward_workload = parse_workload({"name": "forward", "strategy": "least_load"})
        self._least_load = create_policy(self._forward_workload, rng=self._rng)

    def tokenizer_spec(self, model: str) -> str:
        return self._model(model).spec

    def _model(self, name: str) -> _ModelRoute:
        """``name``'s canonical id, tokenizer and block size, looked up once per fleet
        generation (five lookups cost a short request as much as tokenizing it)."""
        route = self._models.get(name)
        if route is None or route.generation != self.catalogue.generation:
            if len(self._models) >= MODELS_REMEMBERED:
                self._models = {}
            route = self._models[name] = self._resolve(name)
        return route

    def _resolve(self, name: str) -> _ModelRoute:
        catalogue, defaults = self.catalogue, self.defaults
        generation = catalogue.generation  # read first: a change after it is seen next time
        base = catalogue.adapter_base(name)
        if base is not None:  # a LoRA adapter: keyed under it, routed to its holders
            return self._resolve(base).for_adapter(name, name=name, generation=generation)
        adapter = self._adapter_after_colon(name)
        if adapter is not None:  # SGLang's "base:adapter": the adapter's route
            return self._resolve(adapter)
        if catalogue.canonical_model(name) is None:
            name = catalogue.any_name_model() or name  # behind SGLang, any name: its model
        entry = catalogue.model_entry(name)
        spec = entry.tokenizer if entry is not None and entry.tokenizer else defaults.tokenizer
        block_size = entry.block_size if entry is not None and entry.block_size else None
        block_size = block_size or catalogue.block_size(name) or defaults.block_size
        return _ModelRoute(generation, name, catalogue.canonical_model(name), spec, block_size)

    def _adapter_after_colon(self, name: str) -> str | None:
        """The adapter SGLang's ``_parse_model_parameter`` reads in ``base:adapter`` (the
        rest after a served model's name and a colon, else after the first colon), when
        a replica announces it loaded."""
        if ":" not in name:
            return None
        catalogue = self.catalogue
        bases = (b for b in catalogue.base_models() if name.startswith(b + ":"))
        base = next(bases, None)
        rest = name[len(base) + 1 :] if base is not None else name.split(":", 1)[1]
        adapter = rest.strip()
        return adapter if catalogue.adapter_base(adapter) is not None else None

    def prepare(
        self,
        request: InferenceRequest,
        *,
        path: str,
        headers: Mapping[str, str],
        api_key: routing_pb2.ApiKey | None,
        request_id: str,
        keys_read: bool = True,
        adapter_on: int | None = None,
    ) -> Prepared:
        """Workload, tenant, tokens and keys of ``request``; 400/404 when it cannot route.

        ``adapter_on``: the replica the request's LoRA adapter was just loaded onto
        (``dataplane.lora``), routed to before its sidecar announces the adapter.

        ``keys_read`` false: the caller reads no keys of its own (no debug header, no
        trace). The prompt is then not tokenized at all when nothing else would read its
        keys either: a static fleet (no residency, so nothing to predict) whose workload's
        policy does not read the prompt (``round_robin``, ``least_load``), for a request
        the engine runs as one (the fidelity counters take its prompt tokens from the
        engine's usage; :meth:`key` when the engine reports none). Keying a short prompt
        is about a fifth of such a proxy's CPU per request, and the engine still checks
        the prompt it gets."""
        route = self._model(request.model)
        if adapter_on is not None:
            route = self._loaded_adapter(request.model, adapter_on)
        elif route.lora and not self.views.view(route.name).replicas():
            route = _NOBODY  # every replica holding the adapter is down or draining
        key_model, block_size = route.key_model, route.block_size
        if key_model is None:
            raise NotFound(
                f"The model `{request.model}` does not exist.", "model", "model_not_found"
            )
        workload = self.classify(request, path, headers, api_key)
        namespace, salt = self._tenant(request, workload, headers, api_key)
        policy = self._policy(workload)
        prepared = Prepared(
            workload=workload,
            policy=policy,
            model=route.name,
            key_model=key_model,
            block_size=block_size,
            namespace=namespace,
            upstream_salt=salt,
            prompt_tokens=0,
            block_keys=[],
            session_id=session_id(workload, headers, request.body),
            request_id=request_id,
            keyed=False,
            lora_name=route.lora,
            only=adapter_on,
        )
        if keys_read or policy.reads_keys or not self.fleet.static or request.fans_out:
            self._key(prepared, request, route.spec)
            if request.is_batch and self.fleet.inflight.keeps_books:
                self._key_later(prepared, request, route.spec)
        return prepared

    def _loaded_adapter(self, name: str, ordinal: int) -> _ModelRoute:
        """The route of an adapter loaded onto ``ordinal`` that no announce shows yet:
        its base model's replicas (of which the request takes ``ordinal``)."""
        endpoint = self.fleet.replicas.endpoint(ordinal)
        base = endpoint.model if endpoint is not None else ""
        route = self._model(base)
        return route.for_adapter(name, name=route.name, generation=route.generation)

    def key(self, prepared: Prepared, request: InferenceRequest) -> None:
        """Tokens and keys of a request :meth:`prepare` left unkeyed (400 if the prompt
        cannot be routed)."""
        if not prepared.keyed:
            self._key(prepared, request, self._model(request.model).spec)

    def _key(self, prepared: Prepared, request: InferenceRequest, spec: str) -> None:
        root = self._root(prepared.key_model, prepared.namespace, prepared.lora_name)
        prompt = self._prompt(request, spec, root, prepared.block_size)
        prepared.prompt_tokens, prepared.block_keys = prompt.count, prompt.keys
        prepared.keyed = True
        hot = self.hot
        if hot is not None and prepared.workload.warmup.enabled and not prepared.namespace:
            # (a tenant's salted prefixes are its own: never kept for warm-ups)
            self._observe(hot, prepared, prompt)

    @staticmethod
    def _observe(hot: HotPrefixBook, prepared: Prepared, prompt: Encoded) -> None:
        """Count the prompt for the warm-up's hot prefixes; named by its last block's key
        and its partial block's tokens (prompts often differ only in a short question)."""
        keys = prompt.keys
        if len(keys) < 2:
            return
        tail = prompt.tokens[len(keys) * prepared.block_size :].tobytes()
        hot.observe(
            prepared.workload,
            prepared.key_model,
            keys,
            lambda: prompt.tokens,
            prepared.block_size,
            hash((keys[-1], tail)),
        )

    def _key_later(self, prepared: Prepared, request: InferenceRequest, spec: str) -> None:
        cache = self.tokenizers.token_cache(spec)
        root = self._root(prepared.key_model, prepared.namespace, prepared.lora_name)
        size = prepared.block_size
        # a later prompt the tokenizer refuses is the engine's to refuse (the whole batch)
        with contextlib.suppress(TokenizerError):
            prepared.later = tuple(
                keyed(prompt, cache, root=root, block_size=size)
                for prompt in later_prompts(request.body, request.kind)
            )

    def later_uncached(self, prepared: Prepared, ordinal: int, now: float) -> int:
        """Tokens a batch's later prompts leave to prefill on ``ordinal`` (after the
        decision's speculative record: a prompt starting as the first does is a hit),
        each prompt also hitting the blocks of the batch's prompts before it."""
        view, size = self.views.view(prepared.model), prepared.block_size
        batch: set[int] = set(prepared.block_keys)
        uncached = 0
        for prompt in prepared.later:
            keys = prompt.keys
            run = view.leading_runs(keys, now=now).get(ordinal, 0) if keys else 0
            while run < len(keys) and keys[run] in batch:
                run += 1
            batch.update(keys)
            uncached += prompt.count - _cached(run, prompt.count, size)
        return uncached

    def choose(
        self, prepared: Prepared, *, now: float, exclude: frozenset[int] = frozenset()
    ) -> tuple[Decision, int]:
        """The policy's decision and the predicted cached tokens on its replica."""
        keys = prepared.block_keys
        view = self.views.view(prepared.model)
        if prepared.only is not None:  # an adapter just loaded there: no other replica
            exclude |= {r.ordinal for r in view.replicas() if r.ordinal != prepared.only}
        ctx = RouteContext(
            workload=prepared.workload,
            model=prepared.key_model,
            block_keys=keys,
            block_size=prepared.block_size,
            session_id=prepared.session_id,
            now=now,
            exclude=exclude,
            request_id=prepared.request_id,
        )
        if not keys:  # nothing to look up, nothing predicted
            return prepared.policy.select(ctx, view), 0
        runs = _RunsOnce(view)
        if self.fleet.replicas.warming:
            ctx.exclude = self._warming_gate(prepared, runs, exclude, now)
        decision = prepared.policy.select(ctx, runs)
        return decision, self._predicted(prepared, decision, runs, now)

    def _warming_gate(
        self, prepared: Prepared, runs: _RunsOnce, exclude: frozenset[int], now: float
    ) -> frozenset[int]:
        """``exclude`` and the warming replicas this request must not go to
        (:mod:`kvcore.warmup.gate`), unless that would leave no replica."""
        keys = prepared.block_keys
        gated = warming_excluded(
            self.fleet.replicas.warming,
            keys,
            runs.leading_runs(keys, now=now),
            prepared.workload.warmup.new_prefix_share,
            self._rng.random(),
        )
        if not gated:
            return exclude
        closed = exclude | gated
        if all(replica.ordinal in closed for replica in runs.replicas()):
            return exclude  # warming never refuses a request
        return closed

    def least_loaded(self, model: str) -> int | None:
        """The least-loaded replica serving ``model`` (routes other than inference)."""
        route = self._model(model)
        if route.key_model is None:
            return None
        ctx = RouteContext(workload=self._forward_workload, model=route.key_model)
        return self._least_load.select(ctx, self.views.view(route.name)).ordinal

    def classify(
        self,
        request: InferenceRequest,
        path: str,
        headers: Mapping[str, str],
        api_key: routing_pb2.ApiKey | None,
    ) -> Workload:
        """Header, else the first matching rule, else the key's default, else the config's."""
        config = self.catalogue.routing_config()
        keyed = api_key is not None and bool(api_key.default_workload)
        if not config.rules and not keyed and WORKLOAD_HEADER not in headers:
            return config.workload(config.default_workload)  # nothing to match
        info = RequestInfo(
            path=path,
            model=request.model,
            api_key=api_key.key_sha256 if api_key is not None else None,
            headers=headers,
        )
        try:
            if WORKLOAD_HEADER in headers or api_key is None or not api_key.default_workload:
                return config.classify(info)
            for rule in config.rules:
                if rule.matches(info):
                    return config.workload(rule.workload)
            return config.workload(api_key.default_workload)
        except UnknownWorkload as exc:
            raise BadRequest(str(exc), WORKLOAD_HEADER, "unknown_workload") from None

    def _root(self, model: str, namespace: str, lora: str = "") -> int:
        """The block keys' root for a model, tenant and LoRA adapter (remembered: hashing
        it costs a short prompt as much as keying its blocks)."""
        root = self._roots.get((model, namespace, lora))
        if root is None:
            if len(self._roots) >= ROOTS_REMEMBERED:
                self._roots.clear()
            root = root_key(model=model, lora_name=lora, namespace=namespace)
            self._roots[model, namespace, lora] = root
        return root

    def take_place(self, place: int) -> None:
        """This proxy's place among the routers watching the control plane, which numbers
        them when ``--proxy-index`` is not given: kv_aware's and kv_cost's turns for new
        prompts start there (:meth:`KvScoringPolicy.take_place`)."""
        self._place = place
        for policy in self._policies.values():
            if isinstance(policy, KvScoringPolicy):
                policy.take_place(place)

    def _policy(self, workload: Workload) -> Policy:
        config = self.catalogue.routing_config()
        if config is not self._config:
            self._config, self._policies = config, {}
        policy = self._policies.get(workload.name)
        if policy is None:
            policy = create_policy(workload, rng=self._rng, place=self._place)
            self._policies[workload.name] = policy
        return policy

    def _tenant(
        self,
        request: InferenceRequest,
        workload: Workload,
        headers: Mapping[str, str],
        api_key: routing_pb2.ApiKey | None,
    ) -> tuple[str, str | None]:
        """The request's namespace and the salt to send upstream (see the module's
        docstring)."""
        body, isolating = request.body, workload.tenant_isolation
        if not isolating and "cache_salt" not in body and "extra_key" not in body:
            return "", None  # nothing names a namespace: the shared one (the common case)
        tenant = self.tenant_of(headers, api_key)
        salt = cache_namespace(body, tenant=tenant, isolating=isolating)
        return salt, salt or None

    def tenant_of(
        self, headers: Mapping[str, str], api_key: routing_pb2.ApiKey | None
    ) -> str | None:
        """Who the proxy knows the client to be: the key's tenant with ``--auth`` (a
        key is given exactly then), else the configured tenant header's value."""
        if api_key is not None:
            return api_key.tenant or None
        header = self.defaults.tenant_header
        return (headers.get(header) or None) if header else None

    def _prompt(self, request: InferenceRequest, spec: str, root: int, block_size: int) -> Encoded:
        cache = self.tokenizers.token_cache(spec)
        try:
            return prompt_keys(
                request.body, cache, root=root, block_size=block_size, kind=request.kind
            )
        except InvalidRequest as invalid:  # one name per type: see dataplane/native.py
            raise BadRequest(f"The prompt cannot be routed: {invalid}", invalid.field) from None
        except TokenizerError as refused:
            # the engine judges it: its template may take what this tokenizer's refuses
            # (a multimodal part, a role), and where it refuses too, the client gets the
            # engine's own words. Routed without keys, so predicting nothing.
            self._warn_once(request.model, refused)
            return Encoded(array("I"))

    def _warn_once(self, model: str, refused: TokenizerError) -> None:
        if model not in self._refusing and len(self._refusing) < MODELS_REMEMBERED:
            self._refusing.add(model)
            log.warning(
                "the tokenizer of model %s refused a prompt (%s): such requests go to a "
                "replica without their prompt's keys, and the engine judges them (this is "
                "said once per model)", model, refused,
            )  # fmt: skip

    def _predicted(
        self, prepared: Prepared, decision: Decision, view: _RunsOnce, now: float
    ) -> int:
        """Cached tokens the router expects the engine to report (its leading run, capped
        as vLLM caps a hit: at least the prompt's last token is computed)."""
        ordinal = decision.ordinal
        if ordinal is None or not prepared.block_keys:
            return 0
        run = view.leading_runs(prepared.block_keys, now=now).get(ordinal, 0)
        return _cached(run, prepared.prompt_tokens, prepared.block_size)


class _RunsOnce:
    """One decision's view of the fleet: the leading runs the policy looked up are the
    ones the prediction reads, without a second lookup."""

    __slots__ = (
        "_keys",
        "_now",
        "_runs",
        "_view",
        "has_residency",
        "inflight",
        "placed_blocks",
        "replicas",
    )

    def __init__(self, view: FleetView) -> None:
        self._view = view
        self._keys: Sequence[int] | None = None
        self._now: float | None = None
        self._runs: dict[int, int] = {}
        # the view's own methods (a policy calls them per replica: one call, not two)
        self.replicas: Callable[[], Sequence[ReplicaState]] = view.replicas
        self.placed_blocks: Callable[..., int] = view.placed_blocks
        self.has_residency: Callable[[], bool] = view.has_residency
        self.inflight: Callable[[], int] = view.inflight

    def leading_runs(self, keys: Sequence[int], *, now: float | None) -> dict[int, int]:
        if keys is not self._keys or now != self._now:
            self._runs = self._view.leading_runs(keys, now=now)
            self._keys, self._now = keys, now
        return self._runs


def _cached(run: int, prompt_tokens: int, block_size: int) -> int:
    """The tokens an engine reports cached for a prompt whose first ``run`` blocks it
    holds: capped as vLLM caps a hit, at least the prompt's last token is computed."""
    return min(run, max(prompt_tokens - 1, 0) // block_size) * block_size
