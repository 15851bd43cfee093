"""The model catalogue: what the names a client sends stand for.

The routing config (workloads, rules, the model registry, aliases, API keys) as the
control plane streams it (:mod:`dataplane.fleet.config`), and from the replica table what
each name is served as: every replica's model, served names and the model's aliases, the
canonical model id block keys are rooted at, and the router block size the replicas of a
model announce. Recomputed on every change of replicas or config, never per request;
:attr:`ModelCatalogue.generation` says when what a name resolves to may have changed.
"""

from __future__ import annotations

from collections import Counter

from dataplane.fleet.config import FleetConfig
from dataplane.fleet.replicas import HEALTHY, ReplicaTable
from kvcore.pb import events_pb2, routing_pb2
from kvcore.workload import RoutingConfig


class ModelCatalogue:
    """Config and served names of one fleet; see the module docstring."""

    def __init__(self, table: ReplicaTable, default_routing: RoutingConfig) -> None:
        self._table = table
        self.config = FleetConfig(routing=default_routing)
        self._canonical: dict[str, str] = {}
        self._adapters: dict[str, str] = {}  # LoRA adapter -> its base model
        self._block_sizes: dict[str, int] = {}  # canonical model -> announced router block size
        self._base_models: list[str] = []  # the replicas' own models (not aliases), sorted
        # bumped by every change of replicas, served names or config: what a model name
        # resolves to (canonical id, registry entry, block size) may be kept until then
        self.generation = 0

    def index_names(self) -> None:
        """Recompute every record's served names, the canonical names, the base models
        and the block sizes (the replicas or the config changed)."""
        aliases = self.config.aliases
        canonical: dict[str, str] = dict(aliases)
        adapters: dict[str, str] = {}
        block_sizes: dict[str, Counter[int]] = {}
        records = self._table.records
        for record in records.values():
            info = record.info
            served = {info.model, *info.served_names, *info.lora_adapters} - {""}
            served |= self.config.aliases_of(info.model)
            for adapter in info.lora_adapters:  # a LoRA adapter: a name only its holders serve
                adapters.setdefault(adapter, info.model)
            record.served = frozenset(served)
            for name in sorted(served):
                canonical.setdefault(name, info.model or name)
            if info.status == HEALTHY and info.block_size:
                block_sizes.setdefault(info.model, Counter())[info.block_size] += 1
        self._canonical = canonical
        self._adapters = adapters
        self._base_models = sorted({r.info.model for r in records.values()} - {""})
        self._block_sizes = {m: sizes.most_common(1)[0][0] for m, sizes in block_sizes.items()}

    def knows(self, name: str) -> bool:
        """Whether ``name`` is a served name or alias (what a view may be kept for)."""
        return name in self._canonical

    def routing_config(self) -> RoutingConfig:
        return self.config.routing

    def models(self) -> dict[str, routing_pb2.Model]:
        """The model registry by name."""
        return self.config.models

    def api_keys(self) -> dict[str, routing_pb2.ApiKey]:
        """Client API keys by their SHA-256 (hex)."""
        return self.config.api_keys

    def model_entry(self, name: str) -> routing_pb2.Model | None:
        """The registry entry a requested name (entry name, model id or served name)
        belongs to; ``None``: the registry does not name it (use the proxy's defaults)."""
        return self.config.entries.get(name)

    def canonical_model(self, name: str) -> str | None:
        """The model id block keys use for a requested name; ``None``: nobody serves it
        (a static replica whose models are not known yet serves every name)."""
        canonical = self._canonical.get(name)
        if canonical is None and any(not state.models for state in self._table.states.values()):
            return name
        return canonical

    def adapter_base(self, name: str) -> str | None:
        """The base model of the LoRA adapter ``name`` when a replica announces it loaded
        (whatever its status); ``None`` for any other name."""
        return self._adapters.get(name)

    def adapter_paths(self) -> dict[str, str]:
        """Every adapter some replica announces loaded: name -> the path it came from."""
        return {
            name: path
            for record in self._table.records.values()
            for name, path in record.info.lora_adapters.items()
        }

    def block_size(self, name: str) -> int | None:
        """The router block size the routable replicas serving ``name`` key their blocks
        with (their sidecars' ``--router-block-size``, the most common one if they
        differ); ``None`` when none announces one. Use it when the registry does not
        name the model: keys computed with another size never match."""
        canonical = self.canonical_model(name)
        return None if canonical is None else self._block_sizes.get(canonical)

    def base_models(self) -> list[str]:
        """The replicas' own models (each replica's first name; not its other served
        names, aliases or adapters), sorted: what a request naming no model may be for."""
        return self._base_models

    def any_name_model(self) -> str | None:
        """The model a name no replica serves is for, where the engines take any name:
        SGLang checks no model name (clients often send ``"default"``), so behind SGLang
        replicas of one model every name is theirs; ``None`` for any other fleet (vLLM
        answers 404 for a name it does not serve, and so does the proxy). Read once per
        name and fleet generation (``Router`` keeps what a name resolves to)."""
        if len(self._base_models) != 1:
            return None
        kinds = {r.info.engine_kind for r in self._table.records.values() if r.info.model}
        return self._base_models[0] if kinds == {events_pb2.ENGINE_KIND_SGLANG} else None

    def served_models(self) -> list[str]:
        """Every name routable replicas answer to, sorted (``GET /v1/models``)."""
        names: set[str] = set()
        for state in self._table.states.values():
            names |= state.models
        return sorted(names)
