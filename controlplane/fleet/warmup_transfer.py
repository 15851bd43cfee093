"""Warm-up by KV transfer: a prefix moved from a replica that holds it, not recomputed.

vLLM engines started with a KV connector in ``kv_both`` role (``--kv-transfer-config
'{"kv_connector":"NixlConnector","kv_role":"kv_both"}'``) take their P/D role per request
from ``kv_transfer_params``, as the proxy's disaggregated serving drives them
(``dataplane/pd.py``). A warm-up by transfer is that pair:

1. the replica holding the prefix gets it as a one-token completion with
   ``{"do_remote_decode": true, ...}`` (:func:`kvcore.roles.vllm_prefill_params`): a
   cache hit there, about one step; its answer carries the ``kv_transfer_params`` naming
   the blocks it holds for the reader;
2. the warming replica gets the same prompt with those parameters
   (``do_remote_prefill``): it reads the blocks (NIXL) instead of computing them, and
   they land in its prefix cache (its KV events say so) as computed ones would.

Either half failing (a refusal, a connection failure, an answer without
``kv_transfer_params``: no connector configured) raises :class:`WarmupFailed`; the
warmer then recomputes the prefix on the warming replica (``controlplane.fleet.warmup``).
"""

from __future__ import annotations

import json

from controlplane.fleet.warmup import WarmupFailed, WarmupRefused
from controlplane.fleet.warmup_client import EngineCompletions, one_token
from kvcore.roles import vllm_prefill_params


class EngineTransfers(EngineCompletions):
    """Moves warm-up prefixes between engines over one keep-alive session."""

    async def move(self, source_url: str, target_url: str, model: str, tokens: list[int]) -> None:
        """``tokens`` computed (held) on ``source_url``, read by ``target_url``; or
        :class:`WarmupFailed` naming the half that failed."""
        prefill = one_token(model, tokens) | {"kv_transfer_params": vllm_prefill_params()}
        try:
            answer = await self.complete(source_url, prefill)
        except WarmupRefused as exc:
            raise WarmupFailed(f"the source refused: {exc}") from None
        params = _params(answer)
        if params is None:
            raise WarmupFailed(
                f"{source_url} answered no kv_transfer_params (no KV connector in kv_both role?)"
            )
        try:
            await self.complete(
                target_url, one_token(model, tokens) | {"kv_transfer_params": params}
            )
        except WarmupRefused as exc:
            raise WarmupFailed(f"the target refused the transfer: {exc}") from None


def _params(answer: bytes) -> dict[str, object] | None:
    try:
        value = json.loads(answer)
    except ValueError:
        return None
    params = value.get("kv_transfer_params") if isinstance(value, dict) else None
    return params if isinstance(params, dict) else None
