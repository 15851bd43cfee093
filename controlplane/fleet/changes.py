"""What changed in the fleet since the last delta went out to the proxies.

The fleet records every change here as it applies it; the routing-state server takes
the whole log every <= 50 ms and turns it into one ``Delta`` per pool. Residency changes
are kept as net sets per replica (``added`` and ``removed`` never share a key), so the
order a proxy applies them in (cleared, then added, then removed) gives exactly the
fleet's state; a change applied twice (once in a snapshot, once in the delta that
follows it) gives the same state, which is what lets a snapshot be cut between deltas.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field


@dataclass(slots=True)
class ResidencyNet:
    cleared: bool = False
    added: set[int] = field(default_factory=set)
    removed: set[int] = field(default_factory=set)

    def add(self, keys: Iterable[int]) -> None:
        if self.removed:
            keys = list(keys)
            self.removed.difference_update(keys)
        self.added.update(keys)

    def remove(self, keys: Iterable[int]) -> None:
        if self.added:
            keys = list(keys)
            self.added.difference_update(keys)
        self.removed.update(keys)

    def clear(self) -> None:
        self.cleared = True
        self.added.clear()
        self.removed.clear()


@dataclass(slots=True)
class ChangeLog:
    """Changes since :meth:`take`; ``on_change`` is called on the first one."""

    residency: dict[int, ResidencyNet] = field(default_factory=dict)
    loads: set[int] = field(default_factory=set)  # ordinals whose load changed
    replicas: set[int] = field(default_factory=set)  # ordinals to upsert
    config: bool = False
    since: float | None = None  # monotonic time of the oldest change
    on_change: Callable[[], None] | None = None

    def residency_of(self, ordinal: int) -> ResidencyNet:
        self._touch()
        net = self.residency.get(ordinal)
        if net is None:
            net = self.residency[ordinal] = ResidencyNet()
        return net

    def load(self, ordinal: int) -> None:
        self._touch()
        self.loads.add(ordinal)

    def replica(self, ordinal: int) -> None:
        self._touch()
        self.replicas.add(ordinal)

    def config_changed(self) -> None:
        self._touch()
        self.config = True

    def take(self) -> ChangeLog:
        """The changes so far, leaving this log empty."""
        taken = ChangeLog(self.residency, self.loads, self.replicas, self.config, self.since)
        self.residency, self.loads, self.replicas = {}, set(), set()
        self.config, self.since = False, None
        return taken

    def empty(self) -> bool:
        return self.since is None

    def _touch(self) -> None:
        if self.since is None:
            self.since = time.monotonic()
            if self.on_change is not None:
                self.on_change()
