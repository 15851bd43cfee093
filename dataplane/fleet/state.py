"""The proxy's local copy of its pools' routing state, applied from the control plane.

A proxy routes every request locally, so the state it routes on must be both current
(applied from the control plane's ``RoutingState.Watch`` stream) and cheap to read.
:class:`FleetState` applies the stream and holds the four parts the proxy reads, each
from one module:

- ``replicas`` (:mod:`dataplane.fleet.replicas`): the replica table, residency and
  freshness; endpoints and speculative residency;
- ``catalogue`` (:mod:`dataplane.fleet.catalogue`): the routing config and what each
  model name stands for;
- ``inflight`` (:mod:`dataplane.fleet.inflight`): this proxy's requests in flight and its
  prefill books;
- ``views`` (:mod:`dataplane.fleet.views`): the per-model views routing reads.

The stream is a snapshot in chunks, then deltas with consecutive versions
(``proto/kvroute/v1/routing.proto``):

- a snapshot is built aside (its own residency index, replica table and config) and
  swapped in when its ``last_chunk`` arrives, so routing never sees half of one;
- a delta must carry the current epoch and the next version; anything else raises
  :class:`~dataplane.errors.SnapshotNeeded` and :meth:`FleetState.position` then asks
  for a new snapshot (the old state keeps serving until it is complete);
- every update is applied in steps (:meth:`FleetState.apply_steps`) so the caller can
  yield to the event loop while a large chunk or a replica's clear is applied.

With no control plane, :meth:`FleetState.from_static` builds the fleet from
``--static-replicas`` (no residency: kv strategies use their fallback).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from mypy_extensions import mypyc_attr

from dataplane.endpoints import ENGINE_KIND_OF
from dataplane.errors import SnapshotNeeded
from dataplane.fleet.catalogue import ModelCatalogue
from dataplane.fleet.config import DEFAULT_ROUTING, FleetConfig, InvalidConfig, fleet_config
from dataplane.fleet.inflight import Inflight
from dataplane.fleet.prefill_books import DEFAULT_STEP_S, PrefillBooks
from dataplane.fleet.replicas import HEALTHY, ReplicaRecord, ReplicaTable
from dataplane.fleet.views import ViewCache
from kvcore.index import BitmaskResidencyIndex, ResidencyIndex
from kvcore.index.base import MAX_REPLICA_ORDINAL
from kvcore.index.columns import BadColumns, from_columns, words_of
from kvcore.pb import events_pb2, routing_pb2
from kvcore.policies import InflightLedger
from kvcore.roles import ROLE_PB, split_role
from kvcore.workload import RoutingConfig

STEP_KEYS = 2_000  # residency keys applied between two yields to the event loop
STEP_ROWS = 8_192  # residency columns' rows applied between two yields
MAX_RESERVED_ROWS = 16_000_000  # a snapshot's announced size trusted up to this


@dataclass(slots=True)
class _Pending:
    """A snapshot being received: applied aside, swapped in on its last chunk."""

    epoch: int
    version: int
    config: FleetConfig
    replicas: dict[int, routing_pb2.Replica] = field(default_factory=dict)
    index: ResidencyIndex = field(default_factory=BitmaskResidencyIndex)
    next_chunk: int = 0


@mypyc_attr(allow_interpreted_subclasses=True)  # tests build on it (compiled, see native.py)
class FleetState:
    """Replicas, residency and config of this proxy's pools; see the module docstring.

    ``max_age_s``: past this long without a message from a control plane the state is
    stale, and views show no residency at all (kv strategies take their fallback).
    ``clock``: monotonic seconds, for staleness and the prefill books.
    ``prefill_step_s``: how stale the books' queued prefill may get (``PrefillBooks``).
    ``views``, ``inflight``: the parts' classes (tests give subclasses that observe).
    """

    def __init__(
        self,
        *,
        default_routing: RoutingConfig = DEFAULT_ROUTING,
        max_age_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
        prefill_step_s: float = DEFAULT_STEP_S,
        index: Callable[[], ResidencyIndex] = BitmaskResidencyIndex,
        views: type[ViewCache] = ViewCache,
        inflight: type[Inflight] = Inflight,
    ) -> None:
        self._default_routing = default_routing
        self._clock = clock
        self.replicas = ReplicaTable(index, clock, max_age_s)
        self.catalogue = ModelCatalogue(self.replicas, default_routing)
        ledger, self._books = InflightLedger(), PrefillBooks(clock, prefill_step_s)
        self.views = views(self.replicas, self.catalogue, ledger, self._books)
        self.inflight = inflight(self.replicas, self.views, ledger, self._books)
        self._listeners: list[Callable[[], None]] = []
        self._epoch: int | None = None
        self._version = 0
        self._pending: _Pending | None = None
        self._need_snapshot = True
        self.config_error = ""  # the last config refused, for /readyz; "" when fine
        self.ignored = 0  # malformed entries skipped (ordinal out of range or unknown)
        self.refused = 0  # snapshot chunks refused (residency columns not as their header says)
        self.static = False  # --static-replicas: no control plane, never any residency

    # -- building ---------------------------------------------------------------

    @classmethod
    def from_static(
        cls, urls: Iterable[str], *, default_routing: RoutingConfig = DEFAULT_ROUTING
    ) -> FleetState:
        """A fleet of fixed replicas (``--static-replicas``): healthy, no residency,
        serving whatever they are asked until :meth:`set_served_names` says what."""
        state = cls(default_routing=default_routing)
        for ordinal, entry in enumerate(urls):
            role, url = split_role(entry)  # ``prefill=URL``: a P/D role (kvcore.roles)
            base_url = url.rstrip("/")
            info = routing_pb2.Replica(
                ordinal=ordinal,
                replica_id=urlsplit(base_url).netloc or base_url,
                pool="static",
                base_url=base_url,
                status=HEALTHY,
                role=ROLE_PB[role or "both"],
            )
            state.replicas.put(info)
        state._need_snapshot = False
        state.static = True
        state._membership_changed()
        return state

    def set_served_names(self, ordinal: int, names: Iterable[str], engine_kind: str = "") -> None:
        """What a replica serves and its engine ("vllm", "sglang" or "" unknown; static
        mode learns both from the replica's /v1/models); the first name becomes its model."""
        record = self.replicas.records.get(ordinal)
        names = list(dict.fromkeys(names))
        if record is None or not names:
            return
        record.info.engine_kind = ENGINE_KIND_OF.get(
            engine_kind, events_pb2.ENGINE_KIND_UNSPECIFIED
        )
        record.info.model = names[0]
        del record.info.served_names[:]
        record.info.served_names.extend(names[1:])
        record.endpoint = None
        self._membership_changed()

    def set_role(self, ordinal: int, role: str, bootstrap_port: int) -> None:
        """A static replica's P/D role and bootstrap port, as its engine tells them."""
        record = self.replicas.records.get(ordinal)
        if record is None:
            return
        record.info.role, record.info.bootstrap_port = ROLE_PB[role], bootstrap_port
        record.endpoint = None
        self._membership_changed()

    def subscribe(self, listener: Callable[[], None]) -> None:
        """Call ``listener`` after every change of replicas or config."""
        self._listeners.append(listener)

    # -- applying the stream ----------------------------------------------------

    def apply(self, update: routing_pb2.StateUpdate) -> None:
        """Apply one update at once; see :meth:`apply_steps`."""
        for _ in self.apply_steps(update):
            pass

    def apply_steps(self, update: routing_pb2.StateUpdate) -> Iterator[None]:
        """Apply one update, yielding between steps so an event loop can run.

        Raises :class:`SnapshotNeeded` when the stream is broken (version gap, epoch
        change, chunks out of order); the state keeps what it had.
        """
        body = update.WhichOneof("body")
        try:
            if body == "snapshot":
                yield from self._snapshot_chunk(update.epoch, update.version, update.snapshot)
            elif body == "delta":
                yield from self._delta(update.epoch, update.version, update.delta)
            else:
                raise SnapshotNeeded("an update with neither a snapshot nor a delta")
        except SnapshotNeeded:
            self._pending = None
            self._need_snapshot = True
            raise
        self.replicas.updated_at = self._clock()

    def position(self) -> tuple[int, int]:
        """``(have_epoch, have_version)`` for a Watch request; ``(0, 0)`` asks for a
        snapshot (none yet, or the stream broke)."""
        if self._need_snapshot or self._epoch is None:
            return 0, 0
        return self._epoch, self._version

    def _snapshot_chunk(
        self, epoch: int, version: int, chunk: routing_pb2.SnapshotChunk
    ) -> Iterator[None]:
        if chunk.chunk_index == 0:
            config = self._chunk_config(chunk)
            self._pending = _Pending(epoch, version, config, index=self.replicas.new_index())
        pending = self._pending
        if pending is None or (epoch, version, chunk.chunk_index) != (
            pending.epoch,
            pending.version,
            pending.next_chunk,
        ):
            raise SnapshotNeeded(
                f"snapshot chunk {chunk.chunk_index} of epoch {epoch} version {version} "
                "does not continue the snapshot being received"
            )
        pending.next_chunk += 1
        for info in chunk.replicas:
            if self._valid_ordinal(info.ordinal):
                pending.replicas[info.ordinal] = info
        for blocks in chunk.residency:
            if blocks.ordinal in pending.replicas:
                yield from _add_in_steps(pending.index, blocks.ordinal, blocks.keys)
            else:
                self.ignored += 1
        if chunk.HasField("residency_columns"):
            yield from self._column_rows(pending, chunk.residency_columns)
        if chunk.last_chunk:
            self._swap_in(pending)

    def _column_rows(
        self, pending: _Pending, columns: routing_pb2.ResidencyColumns
    ) -> Iterator[None]:
        """A chunk's residency columns into the snapshot being built, ``STEP_ROWS`` rows
        a step; bits of replicas the snapshot does not list are dropped (counted in
        ``ignored``); buffers not as their header says refuse the chunk."""
        try:
            keys, masks = from_columns(columns)
        except BadColumns as exc:
            self.refused += 1
            raise SnapshotNeeded(f"snapshot chunk refused: {exc}") from exc
        if columns.total_rows:
            pending.index.reserve(min(columns.total_rows, MAX_RESERVED_ROWS))
        known = words_of(sum(1 << o for o in pending.replicas), masks.shape[1])
        stray = (masks & ~known).any(axis=1)
        if stray.any():
            self.ignored += int(stray.sum())
            masks = masks & known
        for start in range(0, keys.size, STEP_ROWS):
            pending.index.add_rows(
                keys[start : start + STEP_ROWS], masks[start : start + STEP_ROWS]
            )
            yield

    def _chunk_config(self, chunk: routing_pb2.SnapshotChunk) -> FleetConfig:
        if not chunk.HasField("config"):
            return FleetConfig(routing=self._default_routing)
        try:
            config = fleet_config(chunk.config, self._default_routing)
        except InvalidConfig as exc:
            self.config_error = str(exc)
            return self.catalogue.config
        self.config_error = ""
        return config

    def _swap_in(self, pending: _Pending) -> None:
        table = self.replicas
        old = table.records
        table.records, table.warming = {}, {}
        for ordinal, info in pending.replicas.items():
            table.put(info, previous=old.get(ordinal))
        kept = {r.info.replica_id for r in table.records.values()}
        for record in old.values():
            if record.info.replica_id not in kept:
                self._forget(record)
        table.index = pending.index
        self.catalogue.config = pending.config
        self._epoch, self._version = pending.epoch, pending.version
        self._pending = None
        self._need_snapshot = False
        self._membership_changed()

    def _delta(self, epoch: int, version: int, delta: routing_pb2.Delta) -> Iterator[None]:
        if self._pending is not None or self._epoch is None or self._need_snapshot:
            raise SnapshotNeeded(f"delta version {version} arrived before a complete snapshot")
        if epoch != self._epoch:
            raise SnapshotNeeded(f"control-plane epoch changed from {self._epoch} to {epoch}")
        if version != self._version + 1:
            raise SnapshotNeeded(f"delta version {version} after version {self._version}")
        changed = delta.HasField("config") and self._set_config(delta.config)
        for info in delta.replicas_upserted:
            changed = True
            yield from self._upsert(info)
        for ordinal in delta.replicas_removed:
            changed = True
            yield from self._remove(ordinal)
        for residency in delta.residency:
            yield from self._change_residency(residency)
        for update in delta.loads:
            self._set_load(update.ordinal, update.load)
        self._version = version
        if changed:
            self._membership_changed()

    def _set_config(self, message: routing_pb2.RoutingConfig) -> bool:
        try:
            self.catalogue.config = fleet_config(message, self._default_routing)
        except InvalidConfig as exc:
            self.config_error = str(exc)
            return False
        self.config_error = ""
        self.catalogue.generation += 1  # the registry now, the names at the delta's end
        return True

    def _upsert(self, info: routing_pb2.Replica) -> Iterator[None]:
        if not self._valid_ordinal(info.ordinal):
            return
        previous = self.replicas.records.get(info.ordinal)
        if previous is not None and previous.info.replica_id != info.replica_id:
            yield from self._remove(info.ordinal)
            previous = None
        self.replicas.put(info, previous=previous)
        if previous is not None and previous.info.warmup.warming and not info.warmup.warming:
            self.inflight.warmed(previous.ledger_key)

    def _remove(self, ordinal: int) -> Iterator[None]:
        record = self.replicas.records.pop(ordinal, None)
        self.replicas.warming.pop(ordinal, None)
        if record is None:
            return
        self._forget(record)
        for _ in self.replicas.index.clear_replica_steps(ordinal, chunk=STEP_KEYS):
            yield

    def _change_residency(self, change: routing_pb2.ResidencyChange) -> Iterator[None]:
        ordinal = change.ordinal
        table = self.replicas
        if ordinal not in table.records:
            self.ignored += 1
            return
        if change.cleared:
            for _ in table.index.clear_replica_steps(ordinal, chunk=STEP_KEYS):
                yield
        yield from _add_in_steps(table.index, ordinal, change.added)
        if change.removed:
            table.index.remove(ordinal, change.removed)

    def _set_load(self, ordinal: int, load: events_pb2.LoadReport) -> None:
        record = self.replicas.records.get(ordinal)
        if record is None:
            self.ignored += 1
            return
        record.info.load.CopyFrom(load)
        record.report_ts = load.ts if load.ts > 0 else -math.inf
        self._books.reported(record.ledger_key, load)
        self.views.refresh(ordinal, reloaded=True)

    def _valid_ordinal(self, ordinal: int) -> bool:
        if ordinal <= MAX_REPLICA_ORDINAL:
            return True
        self.ignored += 1
        return False

    def _forget(self, record: ReplicaRecord) -> None:
        key = self.replicas.forget_key(record)
        if key is not None:
            self.inflight.forget(key)

    def _membership_changed(self) -> None:
        """Recompute served names, canonical names and routable states; drop views."""
        self._books.configure(self.catalogue.config.routing)
        self.catalogue.index_names()
        self.views.rebuild()
        self.catalogue.generation += 1  # last: a name resolved while this ran is resolved again
        for listener in list(self._listeners):
            listener()


def _add_in_steps(index: ResidencyIndex, ordinal: int, keys: Sequence[int]) -> Iterator[None]:
    for start in range(0, len(keys), STEP_KEYS):
        index.add(ordinal, keys[start : start + STEP_KEYS])
        yield
