"""Why a request would go where: the proxy's routing steps, run on the fleet's state.

The steps and the code are the proxy's: classify the request into a workload
(``kvcore.workload.RoutingConfig.classify``), tokenize it with its model's tokenizer
(``kvcore.request.prompt_token_ids``), compute its block keys (``kvcore.keys``) in the
tenant's key namespace (``kvcore.tenancy``, for the tenant the caller names), and let
the workload's policy (``kvcore.policies``) rank the replicas of the model's pool as the
fleet half sees them now. Tokenizers are loaded once per spec, in a thread (a model
directory is read from disk), and long prompts are tokenized in a thread too.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Mapping
from typing import Any

from controlplane.contracts import FleetView
from controlplane.records.config_store import EtcdConfigStore
from controlplane.records.errors import InvalidInput
from kvcore.keys import DEFAULT_BLOCK_SIZE, block_keys
from kvcore.policies import RouteContext, create_policy
from kvcore.request import InvalidRequest, prompt_token_ids, session_id
from kvcore.tenancy import cache_namespace
from kvcore.tokenize import BUILTIN, Tokenizer, TokenizerError, load_tokenizer
from kvcore.workload import (
    WORKLOAD_HEADER,
    ModelSpec,
    RequestInfo,
    RoutingConfig,
    UnknownWorkload,
    WorkloadError,
)


class Explainer:
    def __init__(self, store: EtcdConfigStore, fleet: FleetView) -> None:
        self.store = store
        self.fleet = fleet
        self._tokenizers: dict[str, Tokenizer] = {}

    async def explain(
        self,
        body: Mapping[str, Any],
        *,
        path: str,
        workload: str | None,
        tenant: str | None,
        headers: Mapping[str, str],
    ) -> dict[str, Any]:
        model_name = body.get("model")
        if not isinstance(model_name, str) or not model_name:
            raise InvalidInput("body.request.model", "the request must name a model")
        base = self._adapter_base(model_name)  # a LoRA adapter: its base model's entry
        spec = self._model(base or model_name)
        chosen = self._classify(path, model_name, workload, headers)
        tokenizer = await self._tokenizer(spec.tokenizer)
        tokens, refused = await self._tokens(body, tokenizer)
        keys = block_keys(
            tokens,
            model=spec.canonical,
            lora_name=model_name if base is not None else "",
            namespace=cache_namespace(body, tenant=tenant, isolating=chosen.tenant_isolation),
            block_size=spec.block_size,
        )
        ctx = RouteContext(
            workload=chosen,
            model=model_name if base is not None else spec.canonical,  # holders only
            block_keys=keys,
            token_ids=tokens,
            block_size=spec.block_size,
            session_id=session_id(chosen, headers, body),
            now=time.monotonic(),
        )
        decision = create_policy(chosen, rng=random.Random(0)).select(
            ctx, self.fleet.state_view(spec.pool)
        )
        explained = {
            "workload": chosen.name,
            "model": spec.canonical,
            "lora_adapter": model_name if base is not None else None,
            "pool": spec.pool,
            "tokenizer": spec.tokenizer,
            "prompt_tokens": len(tokens),
            "block_size": spec.block_size,
            "blocks": len(keys),
            "decision": decision.to_dict(),
        }
        if refused:
            explained["note"] = (
                f"the model's tokenizer refuses this prompt ({refused}): the proxy routes "
                "it without keys, and the engine judges it"
            )
        return explained

    def _adapter_base(self, name: str) -> str | None:
        """The base model of the LoRA adapter ``name`` when a replica announces it loaded
        (the proxy keys its prompts under it and offers only its holders)."""
        infos = self.fleet.replicas(None)
        return next((info.model for info in infos if name in info.lora_adapters), None)

    def _model(self, requested: str) -> ModelSpec:
        for spec in self.store.models().values():
            if spec.answers_to(requested):
                return spec
        # not configured: what a proxy assumes (built-in tokenizer, default block size)
        return ModelSpec.model_validate(
            {"name": "unconfigured", "model": requested[:256], "block_size": DEFAULT_BLOCK_SIZE}
        )

    def _classify(
        self, path: str, model: str, workload: str | None, headers: Mapping[str, str]
    ) -> Any:
        workloads = self.store.workloads()
        rules = self.store.rules()
        named = dict(headers)
        if workload is not None:
            named[WORKLOAD_HEADER] = workload
        try:
            config = RoutingConfig.model_validate(
                {
                    "workloads": list(workloads.values()),
                    "rules": list(rules.rules),
                    "default_workload": rules.default_workload,
                }
            )
            return config.classify(RequestInfo(path=path, model=model, headers=named))
        except UnknownWorkload as exc:
            raise InvalidInput("body.workload", str(exc)) from None
        except WorkloadError as exc:
            raise InvalidInput("body", f"the live rules do not resolve: {exc}") from None
        except ValueError as exc:
            raise InvalidInput("body", f"the live rules do not resolve: {exc}") from None

    async def _tokenizer(self, spec: str) -> Tokenizer:
        tokenizer = self._tokenizers.get(spec)
        if tokenizer is None:
            try:
                if spec == BUILTIN:
                    tokenizer = load_tokenizer(spec)
                else:
                    tokenizer = await asyncio.to_thread(load_tokenizer, spec)
            except (TokenizerError, OSError) as exc:
                raise InvalidInput("body.request.model", f"its tokenizer: {exc}") from None
            self._tokenizers[spec] = tokenizer
        return tokenizer

    async def _tokens(self, body: Mapping[str, Any], tokenizer: Tokenizer) -> tuple[list[int], str]:
        """The prompt's token ids, and why the tokenizer refused it ("" when it did not):
        a prompt it refuses (its chat template's refusal of a role or an image part) is
        routed by the proxy without keys, for the engine to judge."""
        try:
            if _size(body) > 4096:
                return await asyncio.to_thread(prompt_token_ids, body, tokenizer), ""
            return prompt_token_ids(body, tokenizer), ""
        except InvalidRequest as exc:
            raise InvalidInput(f"body.request.{exc.field}", str(exc)) from None
        except TokenizerError as exc:
            return [], str(exc)
        except (TypeError, ValueError) as exc:
            raise InvalidInput("body.request", str(exc)) from None


def _size(body: Mapping[str, Any]) -> int:
    return len(str(body.get("messages") or body.get("prompt") or ""))
