"""A deliberately plain residency index: the oracle the fast one is checked against.

Sets of replicas per key, a dict of speculative ``(key, replica) -> expiry``, and
leading runs computed replica by replica. Obviously right, slow and large.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence

from kvcore.index.base import U64, check_replica
from kvcore.index.columns import add_by_replica, from_holdings, holdings_chunks


class ReferenceResidencyIndex:
    """Residency as ``dict[key, set[replica]]``; for tests and comparisons."""

    def __init__(self) -> None:
        self._holders: dict[int, set[int]] = {}
        self._speculative: dict[tuple[int, int], float] = {}

    def add(self, replica: int, keys: Iterable[int]) -> None:
        check_replica(replica)
        for key in keys:
            self._holders.setdefault(key, set()).add(replica)

    def remove(self, replica: int, keys: Iterable[int]) -> None:
        check_replica(replica)
        for key in keys:
            holders = self._holders.get(key, set())
            holders.discard(replica)
            if not holders:
                self._holders.pop(key, None)

    def clear_replica(self, replica: int) -> int:
        held = [key for key, holders in self._holders.items() if replica in holders]
        self.remove(replica, held)
        for key, owner in list(self._speculative):
            if owner == replica:
                del self._speculative[key, owner]
        return len(held)

    def clear_replica_steps(self, replica: int, *, chunk: int = 50_000) -> Iterator[int]:
        yield self.clear_replica(replica)

    def add_speculative(self, replica: int, keys: Iterable[int], *, expires_at: float) -> None:
        check_replica(replica)
        for key in keys:
            self._speculative[key, replica] = expires_at

    def expire(self, now: float) -> int:
        expired = [entry for entry, until in self._speculative.items() if until <= now]
        for entry in expired:
            del self._speculative[entry]
        return len(expired)

    def replicas_of(self, key: int) -> frozenset[int]:
        return frozenset(self._holders.get(key, ()))

    def leading_runs(self, keys: Sequence[int], *, now: float | None = None) -> dict[int, int]:
        if now is not None:
            self.expire(now)
        runs = {}
        for replica in self._candidates(now is not None):
            run = 0
            while run < len(keys) and self._holds(replica, keys[run], now is not None):
                run += 1
            if run:
                runs[replica] = run
        return runs

    def key_count(self, replica: int | None = None) -> int:
        if replica is None:
            return len(self._holders)
        return sum(replica in holders for holders in self._holders.values())

    def speculative_count(self, replica: int, *, now: float) -> int:
        self.expire(now)
        return sum(owner == replica for _, owner in self._speculative)

    def holdings(self) -> Iterator[tuple[int, int]]:
        for key, holders in self._holders.items():
            yield key, sum(1 << replica for replica in holders)

    def residency(self) -> tuple[U64, U64]:
        return from_holdings(self.holdings())

    def residency_chunks(self, rows: int = 1 << 18) -> Iterator[tuple[U64, U64]]:
        masks = dict(self.holdings())
        return holdings_chunks(list(masks), masks, 0, rows)

    def reserve(self, keys: int) -> None:
        return None

    def add_rows(self, keys: U64, masks: U64) -> None:
        add_by_replica(self, keys, masks)

    def keys_of(self, replica: int) -> list[int]:
        check_replica(replica)
        return [key for key, holders in self._holders.items() if replica in holders]

    def _candidates(self, speculative: bool) -> set[int]:
        replicas = {r for holders in self._holders.values() for r in holders}
        if speculative:
            replicas |= {replica for _, replica in self._speculative}
        return replicas

    def _holds(self, replica: int, key: int, speculative: bool) -> bool:
        if replica in self._holders.get(key, ()):
            return True
        return speculative and (key, replica) in self._speculative
