"""The replica table: the replicas this proxy knows, their residency and how fresh it is.

Each replica is one :class:`ReplicaRecord` by ordinal, with a ledger key that stays the
same for its replica id across snapshots that renumber ordinals (the in-flight ledger and
the prefill books count by it). The table also holds the residency index, the states of
the routable replicas (what :mod:`dataplane.fleet.views` builds and patches) and the time
of the last message from a control plane: past ``max_age_s`` without one, residency is
too old to trust.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from itertools import count

from dataplane.endpoints import Endpoint, endpoint_of
from kvcore.index import ResidencyIndex
from kvcore.pb import routing_pb2
from kvcore.policies import Decision, ReplicaState

HEALTHY = routing_pb2.REPLICA_STATUS_HEALTHY


@dataclass(slots=True)
class ReplicaRecord:
    info: routing_pb2.Replica
    ledger_key: int  # stable per replica id, across snapshots that renumber ordinals
    report_ts: float = -math.inf  # ts of the engine's load report in ``info.load``
    served: frozenset[str] = frozenset()  # model, served names and the model's aliases
    endpoint: Endpoint | None = None  # built on first use (info's fields, not its load)
    state: ReplicaState | None = None  # the routable state last built from this record
    ended: int = 0  # of this proxy's requests the report counts, those ended (in ``state``)


class ReplicaTable:
    """Replicas by ordinal, residency, routable states and freshness; see the module
    docstring. ``clock``: monotonic seconds."""

    def __init__(
        self,
        index: Callable[[], ResidencyIndex],
        clock: Callable[[], float],
        max_age_s: float,
    ) -> None:
        self.new_index = index
        self.index = index()
        self.clock = clock
        self.max_age_s = max_age_s
        self.records: dict[int, ReplicaRecord] = {}
        self.states: dict[int, ReplicaState] = {}  # routable replicas only
        self.updated_at = -math.inf  # the last message from a control plane
        # replicas the control plane's leader is warming: ordinal -> the last keys of the
        # prefixes being warmed there, not confirmed yet (kvcore.warmup.gate reads it)
        self.warming: dict[int, frozenset[int]] = {}
        self._ledger_keys: dict[str, int] = {}
        self._next_ledger_key = count()

    def put(self, info: routing_pb2.Replica, previous: ReplicaRecord | None = None) -> None:
        """Record ``info`` at its ordinal, keeping ``previous``'s load report when it is
        the same replica and ``info`` carries none."""
        key = self._ledger_keys.get(info.replica_id)
        if key is None:
            key = self._ledger_keys[info.replica_id] = next(self._next_ledger_key)
        record = ReplicaRecord(info, key)
        if info.HasField("load") and info.load.ts > 0:
            record.report_ts = info.load.ts
        elif previous is not None and previous.info.replica_id == info.replica_id:
            record.info.load.CopyFrom(previous.info.load)
            record.report_ts = previous.report_ts
        self.records[info.ordinal] = record
        if info.warmup.warming:
            self.warming[info.ordinal] = frozenset(info.warmup.pending_keys)
        else:
            self.warming.pop(info.ordinal, None)

    def forget_key(self, record: ReplicaRecord) -> int | None:
        """Drop a departed replica's ledger key; the key, or ``None`` if already gone."""
        return self._ledger_keys.pop(record.info.replica_id, None)

    def by_ledger_key(self, key: int) -> tuple[int, ReplicaRecord] | None:
        """The record holding ledger key ``key``, with its ordinal; ``None``: gone."""
        found = [(o, r) for o, r in self.records.items() if r.ledger_key == key]
        return found[0] if found else None

    def endpoint(self, ordinal: int) -> Endpoint | None:
        record = self.records.get(ordinal)
        if record is None:
            return None
        if record.endpoint is None:
            record.endpoint = endpoint_of(record.info)
        return record.endpoint

    def replica_info(self, ordinal: int) -> routing_pb2.Replica | None:
        """The replica as the control plane last described it."""
        record = self.records.get(ordinal)
        return record.info if record is not None else None

    def endpoints(self) -> list[Endpoint]:
        """The routable replicas, in ordinal order."""
        records = self.records  # a replica leaving in a delta being applied has none
        return [endpoint_of(records[o].info) for o in sorted(self.states) if o in records]

    def apply_speculative(self, decision: Decision) -> None:
        """Record the decision's speculative residency (keys on the chosen replica)."""
        record = decision.speculative
        if record is not None and record.replica in self.records:
            self.index.add_speculative(record.replica, record.keys, expires_at=record.expires_at)

    def residency_keys(self) -> int:
        """Distinct confirmed keys held (metrics)."""
        return self.index.key_count()

    def age_s(self, now: float | None = None) -> float:
        """Seconds since the last message from a control plane (``inf``: never)."""
        return (self.clock() if now is None else now) - self.updated_at

    def is_stale(self) -> bool:
        return self.age_s() > self.max_age_s
