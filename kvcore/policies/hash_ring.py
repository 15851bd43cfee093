"""A consistent-hash ring with virtual nodes and bounded loads (levels 1 and 2).

Each replica id owns ``virtual_nodes`` points ``xxh3_64(id + "\\0" + i)`` on a 64-bit
ring; a key belongs to the first point at or after it, clockwise. Adding or removing one
of N replicas moves only the keys of the points it gains or loses, about 1/N of them.
Bounded loads: a saturated owner passes the key on to the next distinct replica along
the ring, so a hot key spills over in a stable order instead of at random.
"""

from __future__ import annotations

from bisect import bisect_left
from collections import OrderedDict
from collections.abc import Iterator, Sequence

import xxhash

from kvcore.policies.base import Decision, ReplicaState, RouteContext, StateView
from kvcore.policies.screening import decide, plain_rows, screen, static_exclusion

_hash = xxhash.xxh3_64_intdigest
_RINGS_KEPT = 8


class HashRing:
    """Points of every replica id, sorted; :meth:`walk` yields owners clockwise."""

    def __init__(self, replica_ids: Sequence[str], virtual_nodes: int) -> None:
        points = sorted(
            (_hash(f"{rid}\0{i}".encode()), rid)
            for rid in replica_ids
            for i in range(virtual_nodes)
        )
        self._points = [point for point, _ in points]
        self._owners = [owner for _, owner in points]
        self.members = frozenset(replica_ids)

    def owner(self, key: int) -> str:
        """The replica id that owns ``key``."""
        return next(self.walk(key))

    def walk(self, key: int) -> Iterator[str]:
        """Distinct replica ids in ring order starting at ``key``'s owner."""
        total, seen = len(self._points), set()
        start = bisect_left(self._points, key)
        for step in range(total):
            owner = self._owners[(start + step) % total]
            if owner not in seen:
                seen.add(owner)
                yield owner
                if len(seen) == len(self.members):
                    return


def key_hash(text: str) -> int:
    """Ring position of a string key (a session id)."""
    return _hash(text.encode("utf-8", "surrogatepass"))


class RingRouter:
    """The bounded-load walk shared by ``session_affinity`` and ``prefix_hash``."""

    def __init__(self, virtual_nodes: int) -> None:
        self._virtual_nodes = virtual_nodes
        self._rings: OrderedDict[tuple[str, ...], HashRing] = OrderedDict()

    def route(self, strategy: str, key: int, ctx: RouteContext, state: StateView) -> Decision:
        """The first unsaturated replica along the ring from ``key``."""
        screened = screen(ctx, state)
        if not screened.usable:
            return decide(strategy, screened, None)
        # the ring spans every replica that serves the model, so that a retry (which
        # excludes one) or a saturated replica does not reshape it
        members = [r for r in state.replicas() if static_exclusion(r, ctx) is None]
        by_id = {r.replica_id: r for r in members}
        passed: list[ReplicaState] = []
        for rid in self._ring(members).walk(key):
            replica = by_id[rid]
            if replica.ordinal in ctx.exclude:
                continue
            if replica.ordinal not in screened.saturated:
                note = f"passed on by {len(passed)} saturated replica(s)" if passed else ""
                extra = {"ring_key": key}
                return decide(strategy, screened, replica, plain_rows, note=note, extra=extra)
            passed.append(replica)
        raise AssertionError("screen() leaves a usable replica when any is eligible")

    def _ring(self, members: list[ReplicaState]) -> HashRing:
        ids = tuple(r.replica_id for r in members)
        ring = self._rings.get(ids)
        if ring is None:
            ring = self._rings[ids] = HashRing(ids, self._virtual_nodes)
            if len(self._rings) > _RINGS_KEPT:
                self._rings.popitem(last=False)
        self._rings.move_to_end(ids)
        return ring
