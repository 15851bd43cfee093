"""Level 1: a session's requests go to one replica (bounded-load consistent hashing)."""

from __future__ import annotations

import random
from dataclasses import replace

from kvcore.policies.base import Decision, Policy, RouteContext, StateView
from kvcore.policies.fallback import fallback_policy
from kvcore.policies.hash_ring import RingRouter, key_hash
from kvcore.workload import SessionAffinityWorkload


class SessionAffinityPolicy:
    """The session id's owner on the ring; requests without one use the fallback."""

    name = "session_affinity"
    reads_keys = True  # its fallback may

    def __init__(self, workload: SessionAffinityWorkload, rng: random.Random) -> None:
        self._router = RingRouter(workload.virtual_nodes)
        self._fallback: Policy = fallback_policy(workload, rng)

    def select(self, ctx: RouteContext, state: StateView) -> Decision:
        if not ctx.session_id:
            decision = self._fallback.select(ctx, state)
            note = f"no session id: fallback {decision.strategy}"
            return replace(decision, strategy=self.name, note=_join(note, decision.note))
        return self._router.route(self.name, key_hash(ctx.session_id), ctx, state)


def _join(*notes: str) -> str:
    return "; ".join(n for n in notes if n)
