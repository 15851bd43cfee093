"""Replica roles in disaggregated prefill/decode, by name and on the wire.

A ``prefill`` replica computes prompts and hands their KV to a ``decode`` replica, which
generates; ``both`` (the default, and what a replica that says nothing is) does all of a
request. Sidecars announce the role, the control plane passes it on, proxies pick by it.
"""

from __future__ import annotations

from typing import Any, Literal, cast

from kvcore.pb import events_pb2

Role = Literal["both", "prefill", "decode"]
ROLE_PB: dict[str, events_pb2.ReplicaRole] = {
    "both": events_pb2.REPLICA_ROLE_BOTH,
    "prefill": events_pb2.REPLICA_ROLE_PREFILL,
    "decode": events_pb2.REPLICA_ROLE_DECODE,
}
ROLE_NAMES: dict[int, Role] = {
    events_pb2.REPLICA_ROLE_BOTH: "both",
    events_pb2.REPLICA_ROLE_PREFILL: "prefill",
    events_pb2.REPLICA_ROLE_DECODE: "decode",
}


# vLLM's KV connectors (NIXL's in ``kv_both`` role) take the role per request, from its
# ``kv_transfer_params``: a prefill for a decode engine elsewhere carries these (as vLLM's
# disaggregated-serving proxy sends them); its answer carries the parameters the decode
# engine is then sent with (``do_remote_prefill`` and the blocks to read). The proxy's
# P/D and the control plane's warm-up by transfer both send them.
_VLLM_PREFILL_PARAMS: dict[str, Any] = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}


def vllm_prefill_params() -> dict[str, Any]:
    """A fresh copy of the ``kv_transfer_params`` of a vLLM prefill for a remote decode."""
    return dict(_VLLM_PREFILL_PARAMS)


def role_name(value: int) -> Role:
    """The name of a role on the wire; an unknown value (a newer peer's) is ``both``."""
    return ROLE_NAMES.get(value, "both")


def split_role(entry: str) -> tuple[Role | None, str]:
    """A static replica's ``role=url`` (``prefill=http://10.0.0.1:8000``): its role, or
    ``None`` when the entry names none, and the rest."""
    role, sep, rest = entry.partition("=")
    if sep and role in ROLE_PB:
        return cast(Role, role), rest
    return None, entry


_SGLANG_ROLES: dict[str, Role] = {"prefill": "prefill", "decode": "decode", "null": "both"}


def sglang_disaggregation(server_info: Any) -> tuple[Role | None, int]:
    """``(role, bootstrap port)`` from SGLang's ``/server_info`` (its
    ``--disaggregation-mode`` and ``--disaggregation-bootstrap-port``); ``(None, 0)``
    where it says nothing."""
    if not isinstance(server_info, dict):
        return None, 0
    role = _SGLANG_ROLES.get(str(server_info.get("disaggregation_mode")))
    port = server_info.get("disaggregation_bootstrap_port")
    return role, port if isinstance(port, int) and 0 < port < 65536 else 0
