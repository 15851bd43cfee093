"""Replica roles in disaggregated prefill/decode, by name and on the wire.

A ``prefill`` replica computes prompts and hands their KV to a ``decode`` replica, which
generates; ``both`` (the default, and what a replica that says nothing is) does all of a
request. Sidecars announce the role, the control plane passes it on, proxies pick by it.
"""

from __future__ import annotations

from typing import Literal

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


def role_name(value: int) -> Role:
    """The name of a role on the wire; an unknown value (a newer peer's) is ``both``."""
    return ROLE_NAMES.get(value, "both")
