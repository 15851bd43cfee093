"""The proxy's local copy of its pools' routing state, and the views routing reads.

A proxy routes every request locally, so the state it routes on must be both current
(applied from the control plane's ``RoutingState.Watch`` stream) and cheap to read
(:meth:`FleetState.view` is called on every request). The stream is a snapshot in
chunks, then deltas with consecutive versions (``proto/kvroute/v1/routing.proto``):

- a snapshot is built aside (its own residency index, replica table and config) and
  swapped in when its ``last_chunk`` arrives, so routing never sees half of one;
- a delta must carry the current epoch and the next version; anything else raises
  :class:`~dataplane.errors.SnapshotNeeded` and :meth:`FleetState.position` then asks
  for a new snapshot (the old state keeps serving until it is complete);
- every update is applied in steps (:meth:`FleetState.apply_steps`) so the caller can
  yield to the event loop while a large chunk or a replica's clear is applied.

Views are cached per model and rebuilt only for what changed: a load report or one of
this proxy's requests starting, answering or ending rebuilds one replica's
:class:`~kvcore.policies.ReplicaState` when it is next read, and not at all when the
replica's counts are back to what its state shows (checked when a request ends, off the
next request's critical path, unless prefill books drain with time); a membership or
config change drops the views.
A replica's load is the engine's last report plus this proxy's requests sent after
that report (:class:`~kvcore.policies.InflightLedger`), so nothing is counted twice.
While a ``kv_cost`` workload is configured, its queued prefill is this proxy's own
books (:mod:`dataplane.prefill_books`), re-aged as routing reads the fleet.

With no control plane, :meth:`FleetState.from_static` builds the fleet from
``--static-replicas`` (no residency: kv strategies use their fallback).
"""

from __future__ import annotations

import math
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from itertools import count
from urllib.parse import urlsplit

from mypy_extensions import mypyc_attr

from dataplane.endpoints import ENGINE_KIND_OF, endpoint_of
from dataplane.endpoints import Endpoint as Endpoint  # re-exported: callers import it here
from dataplane.errors import SnapshotNeeded
from dataplane.fleet_config import DEFAULT_ROUTING, FleetConfig, InvalidConfig, fleet_config
from dataplane.prefill_books import DEFAULT_STEP_S, PrefillBooks
from kvcore.index import BitmaskResidencyIndex, ResidencyIndex
from kvcore.index.base import MAX_REPLICA_ORDINAL
from kvcore.index.columns import BadColumns, from_columns, words_of
from kvcore.pb import events_pb2, routing_pb2
from kvcore.policies import Decision, InflightLedger, ReplicaState
from kvcore.policies.board import ReplicaBoard
from kvcore.roles import ROLE_PB, split_role
from kvcore.workload import RoutingConfig

HEALTHY = routing_pb2.REPLICA_STATUS_HEALTHY
DEFAULT_CAPACITY = 256  # a replica that does not announce max_num_seqs
STEP_KEYS = 2_000  # residency keys applied between two yields to the event loop
STEP_ROWS = 8_192  # residency columns' rows applied between two yields
MAX_RESERVED_ROWS = 16_000_000  # a snapshot's announced size trusted up to this


@dataclass(slots=True)  # one per request; a frozen init costs 3x (read-only by convention)
class InflightTicket:
    """One request sent by this proxy, for :meth:`FleetState.on_done`."""

    ordinal: int
    ledger_key: int
    ticket: int
    prefill: int = 0  # the prefill books' ticket (0: not booked)
    # a batch's later prompts' ticket: a stream's first event is its first prompt's first
    # token, so only a whole answer or the request's end settles them
    prefill_later: int = 0

    def __init__(  # written out: one per request (see dataplane/native.py)
        self, ordinal: int, ledger_key: int, ticket: int, prefill: int = 0, prefill_later: int = 0
    ) -> None:
        self.ordinal = ordinal
        self.ledger_key = ledger_key
        self.ticket = ticket
        self.prefill = prefill
        self.prefill_later = prefill_later


@dataclass(slots=True)
class _Replica:
    info: routing_pb2.Replica
    ledger_key: int  # stable per replica id, across snapshots that renumber ordinals
    report_ts: float = -math.inf  # ts of the engine's load report in ``info.load``
    served: frozenset[str] = frozenset()  # model, served names and the model's aliases
    endpoint: Endpoint | None = None  # built on first use (info's fields, not its load)
    state: ReplicaState | None = None  # the routable state last built from this record


@dataclass(slots=True)
class _Pending:
    """A snapshot being received: applied aside, swapped in on its last chunk."""

    epoch: int
    version: int
    config: FleetConfig
    replicas: dict[int, routing_pb2.Replica] = field(default_factory=dict)
    index: ResidencyIndex = field(default_factory=BitmaskResidencyIndex)
    next_chunk: int = 0


_Counts = tuple[int, float | None, float | None]  # unreported, queued prefill, prefill rate


class FleetView:
    """kvcore's ``StateView`` over one model's routable replicas (see the module
    docstring for how it stays cheap)."""

    __slots__ = ("_board", "_fleet")

    def __init__(self, fleet: FleetState, states: list[ReplicaState]) -> None:
        self._fleet = fleet
        # patched one replica at a time; a board lets kvcore's strategies read the
        # prompt's holders and the best of the rest instead of every replica
        self._board = ReplicaBoard(states)

    def replicas(self) -> ReplicaBoard:
        fleet = self._fleet
        if fleet._dirty or fleet._books.draining:
            fleet._bring_up_to_date()
        return self._board

    def leading_runs(self, keys: Sequence[int], *, now: float | None) -> dict[int, int]:
        fleet = self._fleet
        # residency too old to trust: the workload's fallback routes (is_stale, inline:
        # read on every keyed request)
        if fleet._clock() - fleet._updated_at > fleet.max_age_s:
            return {}
        return fleet._index.leading_runs(keys, now=now)

    def placed_blocks(self, ordinal: int, *, now: float) -> int:
        return self._fleet._index.speculative_count(ordinal, now=now)

    def has_residency(self) -> bool:
        fleet = self._fleet
        return fleet._index.key_count() > 0 and not fleet.is_stale()

    def inflight(self) -> int:
        fleet = self._fleet
        records, ledger = fleet._records, fleet._ledger
        keys = (records[r.ordinal].ledger_key for r in self._board if r.ordinal in records)
        return sum(ledger.inflight(key) for key in keys)

    def _replace(self, state: ReplicaState) -> None:
        if self._board.get(state.ordinal) is not None:
            self._board.put(state)


@mypyc_attr(allow_interpreted_subclasses=True)  # tests build on it (compiled, see native.py)
class FleetState:
    """Replicas, residency and config of this proxy's pools; see the module docstring.

    ``max_age_s``: past this long without a message from a control plane the state is
    stale, and views show no residency at all (kv strategies take their fallback).
    ``clock``: monotonic seconds, for :meth:`age_s`, staleness and the prefill books.
    ``prefill_step_s``: how stale the books' queued prefill may get (``PrefillBooks``).
    """

    def __init__(
        self,
        *,
        default_routing: RoutingConfig = DEFAULT_ROUTING,
        max_age_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
        prefill_step_s: float = DEFAULT_STEP_S,
        index: Callable[[], ResidencyIndex] = BitmaskResidencyIndex,
    ) -> None:
        self.max_age_s = max_age_s
        self._new_index = index
        self._default_routing = default_routing
        self._clock = clock
        self._config = FleetConfig(routing=default_routing)
        self._records: dict[int, _Replica] = {}
        self._states: dict[int, ReplicaState] = {}  # routable replicas only
        self._dirty: set[int] = set()  # routable replicas whose state must be rebuilt
        self._reloaded: set[int] = set()  # of those, the ones with a new load report
        self._views: dict[str, FleetView] = {}
        self._canonical: dict[str, str] = {}
        self._adapters: dict[str, str] = {}  # LoRA adapter -> its base model
        self._block_sizes: dict[str, int] = {}  # canonical model -> announced router block size
        self._base_models: list[str] = []  # the replicas' own models (not aliases), sorted
        self._index = index()
        self._ledger = InflightLedger()
        self._books = PrefillBooks(clock, prefill_step_s)
        self._ledger_keys: dict[str, int] = {}
        self._next_ledger_key = count()
        self._listeners: list[Callable[[], None]] = []
        self._epoch: int | None = None
        self._version = 0
        self._pending: _Pending | None = None
        self._need_snapshot = True
        self._updated_at = -math.inf
        self.config_error = ""  # the last config refused, for /readyz; "" when fine
        # bumped by every change of replicas, served names or config: what a model name
        # resolves to (canonical id, registry entry, block size) may be kept until then
        self.generation = 0
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
            state._put(info)
        state._need_snapshot = False
        state.static = True
        state._membership_changed()
        return state

    def set_served_names(self, ordinal: int, names: Iterable[str], engine_kind: str = "") -> None:
        """What a replica serves and its engine ("vllm", "sglang" or "" unknown; static
        mode learns both from the replica's /v1/models); the first name becomes its model."""
        record = self._records.get(ordinal)
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
        record = self._records.get(ordinal)
        if record is None:
            return
        record.info.role, record.info.bootstrap_port = ROLE_PB[role], bootstrap_port
        record.endpoint = None
        self._membership_changed()

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
        self._updated_at = self._clock()

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
            self._pending = _Pending(epoch, version, config, index=self._new_index())
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
            return self._config
        self.config_error = ""
        return config

    def _swap_in(self, pending: _Pending) -> None:
        old = self._records
        self._records = {}
        for ordinal, info in pending.replicas.items():
            self._put(info, previous=old.get(ordinal))
        kept = {r.info.replica_id for r in self._records.values()}
        for record in old.values():
            if record.info.replica_id not in kept:
                self._forget_ledger(record)
        self._index = pending.index
        self._config = pending.config
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
            self._config = fleet_config(message, self._default_routing)
        except InvalidConfig as exc:
            self.config_error = str(exc)
            return False
        self.config_error = ""
        self.generation += 1  # the registry changed now, the names at the delta's end
        return True

    def _upsert(self, info: routing_pb2.Replica) -> Iterator[None]:
        if not self._valid_ordinal(info.ordinal):
            return
        previous = self._records.get(info.ordinal)
        if previous is not None and previous.info.replica_id != info.replica_id:
            yield from self._remove(info.ordinal)
            previous = None
        self._put(info, previous=previous)

    def _remove(self, ordinal: int) -> Iterator[None]:
        record = self._records.pop(ordinal, None)
        if record is None:
            return
        self._forget_ledger(record)
        for _ in self._index.clear_replica_steps(ordinal, chunk=STEP_KEYS):
            yield

    def _change_residency(self, change: routing_pb2.ResidencyChange) -> Iterator[None]:
        ordinal = change.ordinal
        if ordinal not in self._records:
            self.ignored += 1
            return
        if change.cleared:
            for _ in self._index.clear_replica_steps(ordinal, chunk=STEP_KEYS):
                yield
        yield from _add_in_steps(self._index, ordinal, change.added)
        if change.removed:
            self._index.remove(ordinal, change.removed)

    def _set_load(self, ordinal: int, load: events_pb2.LoadReport) -> None:
        record = self._records.get(ordinal)
        if record is None:
            self.ignored += 1
            return
        record.info.load.CopyFrom(load)
        record.report_ts = load.ts if load.ts > 0 else -math.inf
        self._refresh(ordinal, reloaded=True)

    def _valid_ordinal(self, ordinal: int) -> bool:
        if ordinal <= MAX_REPLICA_ORDINAL:
            return True
        self.ignored += 1
        return False

    # -- the replica table --------------------------------------------------------

    def _put(self, info: routing_pb2.Replica, previous: _Replica | None = None) -> None:
        key = self._ledger_keys.get(info.replica_id)
        if key is None:
            key = self._ledger_keys[info.replica_id] = next(self._next_ledger_key)
        record = _Replica(info, key)
        if info.HasField("load") and info.load.ts > 0:
            record.report_ts = info.load.ts
        elif previous is not None and previous.info.replica_id == info.replica_id:
            record.info.load.CopyFrom(previous.info.load)
            record.report_ts = previous.report_ts
        self._records[info.ordinal] = record

    def _forget_ledger(self, record: _Replica) -> None:
        key = self._ledger_keys.pop(record.info.replica_id, None)
        if key is not None:
            self._ledger.forget(key)
            self._books.forget(key)

    def _membership_changed(self) -> None:
        """Recompute served names, routable states and canonical names; drop views."""
        aliases = self._config.aliases
        canonical: dict[str, str] = dict(aliases)
        adapters: dict[str, str] = {}
        block_sizes: dict[str, Counter[int]] = {}
        self._states = {}
        self._books.configure(self._config.routing)
        for ordinal, record in self._records.items():
            info = record.info
            served = {info.model, *info.served_names, *info.lora_adapters} - {""}
            served |= self._config.aliases_of(info.model)
            for adapter in info.lora_adapters:  # a LoRA adapter: a name only its holders serve
                adapters.setdefault(adapter, info.model)
            record.served = frozenset(served)
            for name in sorted(served):
                canonical.setdefault(name, info.model or name)
            if info.status == HEALTHY:
                self._states[ordinal] = record.state = self._replica_state(record)
                if info.block_size:
                    block_sizes.setdefault(info.model, Counter())[info.block_size] += 1
        self._canonical = canonical
        self._adapters = adapters
        self._base_models = sorted({r.info.model for r in self._records.values()} - {""})
        self._block_sizes = {m: sizes.most_common(1)[0][0] for m, sizes in block_sizes.items()}
        self._dirty.clear()
        self._reloaded.clear()
        self._views = {}
        self.generation += 1  # last: a name resolved while this ran is resolved again
        for listener in list(self._listeners):
            listener()

    def _counts(self, record: _Replica) -> _Counts:
        """This proxy's own figures for a replica: unreported requests, queued prefill,
        its prefill rate as the books learned it."""
        key, books = record.ledger_key, self._books
        unreported = self._ledger.unreported(key, record.report_ts)
        return unreported, books.queued(record.info.ordinal, key), books.rate(key)

    def _replica_state(self, record: _Replica, counts: _Counts | None = None) -> ReplicaState:
        info, load = record.info, record.info.load
        unreported, queued, rate = counts or self._counts(record)
        return ReplicaState(
            ordinal=info.ordinal,
            replica_id=info.replica_id,
            models=record.served,
            running=load.running,
            waiting=load.waiting,
            kv_usage=load.kv_usage,
            unreported=unreported,
            capacity=info.capacity_seqs or DEFAULT_CAPACITY,
            prefill_tokens_per_s=rate,
            queued_prefill_tokens=queued,
        )

    def _refresh(self, ordinal: int, *, reloaded: bool = False) -> None:
        """Mark one routable replica's state for a rebuild when it is next read (a
        request's start and end cost one rebuild, not two). ``reloaded``: its load report
        changed; otherwise only its unreported count may have."""
        if ordinal in self._states:
            self._dirty.add(ordinal)
            if reloaded:
                self._reloaded.add(ordinal)

    def _bring_up_to_date(self) -> None:
        books = self._books
        if books.draining and books.due():
            self._dirty.update(books.draining)  # queued prefill drains with time
        if self._dirty:
            self._flush()

    def _flush(self) -> None:
        """Rebuild the marked replicas' states and patch the views holding them; a
        replica whose requests came and went since it was last read keeps its state."""
        for ordinal in self._dirty:
            record = self._records.get(ordinal)
            if record is None:  # leaving, in a delta not yet applied to its end
                continue
            counts = self._counts(record)
            current = self._states[ordinal]
            if ordinal not in self._reloaded and counts == (
                current.unreported,
                current.queued_prefill_tokens,
                current.prefill_tokens_per_s,
            ):
                continue
            if ordinal in self._reloaded or record.state is not current:
                state = self._replica_state(record, counts)
            else:  # only this proxy's counts changed: the rest is the current state's
                state = _recounted(current, *counts)
            self._states[ordinal] = record.state = state
            for view in self._views.values():
                view._replace(state)
        self._dirty.clear()
        self._reloaded.clear()

    # -- what routing reads ---------------------------------------------------------

    def view(self, model: str) -> FleetView:
        """The healthy, non-draining replicas serving ``model`` (any served name or
        alias), with load and residency (speculative entries included)."""
        view = self._views.get(model)
        if view is None:
            self._bring_up_to_date()
            states = [
                state
                for _, state in sorted(self._states.items())
                if model in state.models or not state.models  # models: the record's served
            ]
            view = FleetView(self, states)
            if model in self._canonical:  # not every name a client sends: memory is bounded
                self._views[model] = view
        return view

    def routing_config(self) -> RoutingConfig:
        return self._config.routing

    def models(self) -> dict[str, routing_pb2.Model]:
        """The model registry by name."""
        return self._config.models

    def api_keys(self) -> dict[str, routing_pb2.ApiKey]:
        """Client API keys by their SHA-256 (hex)."""
        return self._config.api_keys

    def model_entry(self, name: str) -> routing_pb2.Model | None:
        """The registry entry a requested name (entry name, model id or served name)
        belongs to; ``None``: the registry does not name it (use the proxy's defaults)."""
        return self._config.entries.get(name)

    def canonical_model(self, name: str) -> str | None:
        """The model id block keys use for a requested name; ``None``: nobody serves it
        (a static replica whose models are not known yet serves every name)."""
        canonical = self._canonical.get(name)
        if canonical is None and any(not state.models for state in self._states.values()):
            return name
        return canonical

    def adapter_base(self, name: str) -> str | None:
        """The base model of the LoRA adapter ``name`` when a replica announces it loaded
        (whatever its status); ``None`` for any other name."""
        return self._adapters.get(name)

    def replica_info(self, ordinal: int) -> routing_pb2.Replica | None:
        """The replica as the control plane last described it."""
        record = self._records.get(ordinal)
        return record.info if record is not None else None

    def adapter_paths(self) -> dict[str, str]:
        """Every adapter some replica announces loaded: name -> the path it came from."""
        return {
            name: path
            for record in self._records.values()
            for name, path in record.info.lora_adapters.items()
        }

    def block_size(self, name: str) -> int | None:
        """The router block size the routable replicas serving ``name`` key their blocks
        with (their sidecars' ``--router-block-size``, the most common one if they
        differ); ``None`` when none announces one. Use it when the registry does not
        name the model: keys computed with another size never match."""
        canonical = self.canonical_model(name)
        return None if canonical is None else self._block_sizes.get(canonical)

    def base_models(self) -> list[str]:
        """The replicas' own models (each replica's first name; not its other served
        names, aliases or adapters), sorted: what a request naming no model may be for."""
        return self._base_models

    def any_name_model(self) -> str | None:
        """The model a name no replica serves is for, where the engines take any name:
        SGLang checks no model name (clients often send ``"default"``), so behind SGLang
        replicas of one model every name is theirs; ``None`` for any other fleet (vLLM
        answers 404 for a name it does not serve, and so does the proxy). Read once per
        name and fleet generation (``Router`` keeps what a name resolves to)."""
        if len(self._base_models) != 1:
            return None
        kinds = {r.info.engine_kind for r in self._records.values() if r.info.model}
        return self._base_models[0] if kinds == {events_pb2.ENGINE_KIND_SGLANG} else None

    def served_models(self) -> list[str]:
        """Every name routable replicas answer to, sorted (``GET /v1/models``)."""
        names: set[str] = set()
        for state in self._states.values():
            names |= state.models
        return sorted(names)

    def endpoint(self, ordinal: int) -> Endpoint | None:
        record = self._records.get(ordinal)
        if record is None:
            return None
        if record.endpoint is None:
            record.endpoint = endpoint_of(record.info)
        return record.endpoint

    def endpoints(self) -> list[Endpoint]:
        """The routable replicas, in ordinal order."""
        records = self._records  # a replica leaving in a delta being applied has none
        return [endpoint_of(records[o].info) for o in sorted(self._states) if o in records]

    def subscribe(self, listener: Callable[[], None]) -> None:
        """Call ``listener`` after every change of replicas or config."""
        self._listeners.append(listener)

    # -- what the proxy writes back -----------------------------------------------

    @property
    def keeps_books(self) -> bool:
        """Whether this proxy keeps prefill books (a ``kv_cost`` workload is configured)."""
        return self._books.on

    def on_sent(
        self, ordinal: int, now: float, uncached_tokens: int = 0, later_uncached: int = 0
    ) -> InflightTicket | None:
        """A request went to ``ordinal`` at ``now`` (wall clock, like LoadReport.ts) with
        ``uncached_tokens`` to prefill there (its prompt less the predicted cached tokens)
        and, for a batch, ``later_uncached`` for its other prompts."""
        record = self._records.get(ordinal)
        if record is None:
            return None
        key = record.ledger_key
        ticket = self._ledger.sent(key, now)
        self._refresh(ordinal)
        books = self._books
        first = books.sent(key, uncached_tokens)  # booked first: the engine starts on it
        later = books.sent(key, later_uncached) if later_uncached else 0
        return InflightTicket(ordinal, key, ticket, first, later)

    def on_first_byte(self, ticket: InflightTicket | None, status: int, streaming: bool) -> None:
        """The first bytes of the request's answer arrived (a stream's first event, or a
        whole body), with HTTP ``status``: its prefill is settled (a batch's later
        prompts' only by a whole answer or an error)."""
        if ticket is None or not ticket.prefill:
            return
        books, key = self._books, ticket.ledger_key
        books.answered(key, ticket.prefill, status, streaming)
        if ticket.prefill_later and (not streaming or status >= 400):
            books.answered(key, ticket.prefill_later, status, streaming)
        self._refresh_ticket(ticket)

    def on_done(self, ticket: InflightTicket | None) -> None:
        """The request of ``ticket`` ended, in any way (twice: ignored)."""
        if ticket is None:
            return
        self._ledger.done(ticket.ledger_key, ticket.ticket)
        if ticket.prefill:
            self._books.ended(ticket.ledger_key, ticket.prefill)
        if ticket.prefill_later:
            self._books.ended(ticket.ledger_key, ticket.prefill_later)
        self._refresh_ticket(ticket, ended=True)

    def _refresh_ticket(self, ticket: InflightTicket, *, ended: bool = False) -> None:
        ordinal, record = ticket.ordinal, self._records.get(ticket.ordinal)
        if record is None or record.ledger_key != ticket.ledger_key:
            found = [(o, r) for o, r in self._records.items() if r.ledger_key == ticket.ledger_key]
            if not found:  # renumbered by a snapshot since, or gone
                return
            ordinal, record = found[0]
        if ended:
            self._settle(ordinal, record)
        else:
            self._refresh(ordinal)

    def _settle(self, ordinal: int, record: _Replica) -> None:
        """One of this proxy's requests to ``ordinal`` ended: as :meth:`_refresh`, but a
        replica whose counts are back to what its state shows (the request came and went
        since the state was last read, the usual case for a proxy that is not busy) is
        settled now, after the answer, not by :meth:`_flush` on the next request's
        critical path. Only without prefill books: their figure drains with time, so it is
        read when routing reads it, as before; a new load report is rebuilt all the same."""
        current = self._states.get(ordinal)
        if current is None:
            return
        if self._books.on or ordinal in self._reloaded:
            self._dirty.add(ordinal)
        elif self._ledger.unreported(record.ledger_key, record.report_ts) == current.unreported:
            self._dirty.discard(ordinal)  # what _flush would find: nothing to rebuild
        else:
            self._dirty.add(ordinal)

    def apply_speculative(self, decision: Decision) -> None:
        """Record the decision's speculative residency (keys on the chosen replica)."""
        record = decision.speculative
        if record is not None and record.replica in self._records:
            self._index.add_speculative(record.replica, record.keys, expires_at=record.expires_at)

    def prefill_rates(self) -> dict[str, float]:
        """Replica id -> the prefill rate kv_cost ranks it at (empty without books)."""
        books = self._books
        if not books.on:
            return {}
        rates = {r.info.replica_id: books.rate(r.ledger_key) for r in self._records.values()}
        return {replica: rate for replica, rate in rates.items() if rate is not None}

    def inflight_total(self) -> int:
        """This proxy's requests in flight to any replica (what the HPA scales on)."""
        return self._ledger.total()

    # -- freshness ----------------------------------------------------------------

    def age_s(self, now: float | None = None) -> float:
        """Seconds since the last message from a control plane (``inf``: never)."""
        return (self._clock() if now is None else now) - self._updated_at

    def is_stale(self) -> bool:
        return self.age_s() > self.max_age_s

    def residency_keys(self) -> int:
        """Distinct confirmed keys held (metrics)."""
        return self._index.key_count()


def _recounted(
    state: ReplicaState, unreported: int, queued: float | None, rate: float | None
) -> ReplicaState:
    """``state`` with this proxy's own counts replaced, for a replica whose record has not
    changed since ``state`` was built from it: read from ``state``'s plain attributes,
    not from the record's protobuf message (a loaded proxy rebuilds about one state per
    request: 0.7 us this way against 1.2)."""
    return ReplicaState(
        ordinal=state.ordinal,
        replica_id=state.replica_id,
        models=state.models,
        healthy=state.healthy,
        draining=state.draining,
        running=state.running,
        waiting=state.waiting,
        kv_usage=state.kv_usage,
        unreported=unreported,
        capacity=state.capacity,
        prefill_tokens_per_s=rate,
        queued_prefill_tokens=queued,
    )


def _add_in_steps(index: ResidencyIndex, ordinal: int, keys: Sequence[int]) -> Iterator[None]:
    for start in range(0, len(keys), STEP_KEYS):
        index.add(ordinal, keys[start : start + STEP_KEYS])
        yield
