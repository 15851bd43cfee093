"""Residency changes held back to be applied in bulk: each replica's last word per key.

Why: the compact index applies a batch in a few dozen array operations, whose fixed
cost dwarfs an engine's event batch of a few dozen keys; the control plane ingests such
batches by the hundred thousand a second. Held here, a change costs a dict write, and
the index applies thousands at once when it is read or enough are held.

Rule: for one replica and one key only the last change matters (added then removed is
removed, and the other way round), and changes of different replicas, or of different
keys, commute; so each replica keeps ``key -> added?`` and the held changes come out as
one set of added and one of removed keys per replica, in any order.
"""

from __future__ import annotations

from collections.abc import Iterable
from itertools import repeat


class PendingChanges:
    """Each replica's held changes; ``count`` the keys held over all replicas."""

    def __init__(self) -> None:
        self._by_replica: dict[int, dict[int, bool]] = {}
        self.count = 0

    def __bool__(self) -> bool:
        return self.count > 0

    def record(self, replica: int, keys: Iterable[int], *, added: bool) -> None:
        changes = self._by_replica.get(replica)
        if changes is None:
            changes = self._by_replica[replica] = {}
        before = len(changes)
        changes.update(zip(keys, repeat(added)))
        self.count += len(changes) - before

    def take(self) -> list[tuple[int, list[int], list[int]]]:
        """Every replica's ``(replica, added keys, removed keys)``; holds nothing after."""
        taken = [
            (
                replica,
                [k for k, a in changes.items() if a],
                [k for k, a in changes.items() if not a],
            )
            for replica, changes in self._by_replica.items()
        ]
        self._by_replica, self.count = {}, 0
        return taken
