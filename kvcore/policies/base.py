"""The routing contract: one read-only context in, one self-explaining decision out.

Every strategy implements :class:`Policy`: ``select(ctx, state) -> Decision``. The
context (:class:`RouteContext`) is one object, so adding a field never changes a
signature, and read-only (by convention: a frozen init costs 3x, built per request);
the state (:class:`StateView`) is read-only, so policies are pure apart from their own
small state (a round-robin cursor, a cached ring, a random generator). What a policy
wants written back (speculative residency) is part of the :class:`Decision`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, overload

from kvcore.keys import DEFAULT_BLOCK_SIZE
from kvcore.workload import Workload


@dataclass(slots=True, unsafe_hash=True)
class ReplicaState:
    """A replica as routing sees it (from announcements, load reports, this proxy).

    ``running`` and ``waiting`` are the engine's figures at its last load report, which
    already include the requests this proxy sent before that report; ``unreported``
    counts only the ones sent after it (see :mod:`kvcore.policies.inflight`), so no
    request is counted twice.

    Read-only by convention, hashed by its fields as a frozen one would be: not frozen,
    because a proxy under load builds one or two per request (each request it sends or
    ends changes a replica's ``unreported``), and a frozen init cost 1.6 us against 0.9.
    """

    ordinal: int
    replica_id: str
    models: frozenset[str] = frozenset()  # empty: serves whatever it is asked for
    healthy: bool = True
    draining: bool = False
    running: int = 0  # engine-reported
    waiting: int = 0  # engine-reported
    kv_usage: float = 0.0  # engine-reported, 0-1
    unreported: int = 0  # this proxy's in-flight requests sent after the last load report
    capacity: int = 256  # concurrent sequences the engine runs (max_num_seqs)
    prefill_tokens_per_s: float | None = None  # measured or announced, if known
    queued_prefill_tokens: float | None = None  # prompt tokens waiting, if known
    # seconds more than on the fleet's typical replica that each prefill's engine step
    # takes there (learned from first tokens: a slower GPU or model; 0 for the others)
    extra_step_s: float = 0.0
    # derived once (policies read them for every replica on every request):
    requests: int = field(init=False, compare=False)  # running + waiting + unreported
    # max(reported, kv_usage) + unreported, per seat: 1 = every seat taken; above 1, the
    # queue behind them (not capped: an overloaded fleet still ranks by queue depth)
    load: float = field(init=False, compare=False)

    def __init__(  # written out: one or two per request (see dataplane/native.py)
        self,
        ordinal: int,
        replica_id: str,
        models: frozenset[str] = frozenset(),
        healthy: bool = True,
        draining: bool = False,
        running: int = 0,
        waiting: int = 0,
        kv_usage: float = 0.0,
        unreported: int = 0,
        capacity: int = 256,
        prefill_tokens_per_s: float | None = None,
        queued_prefill_tokens: float | None = None,
        extra_step_s: float = 0.0,
    ) -> None:
        self.ordinal = ordinal
        self.replica_id = replica_id
        self.models = models
        self.healthy = healthy
        self.draining = draining
        self.running = running
        self.waiting = waiting
        self.kv_usage = kv_usage
        self.unreported = unreported
        self.capacity = capacity
        self.prefill_tokens_per_s = prefill_tokens_per_s
        self.queued_prefill_tokens = queued_prefill_tokens
        self.extra_step_s = extra_step_s
        reported, seats = running + waiting, max(capacity, 1)
        self.requests = reported + unreported
        # unreported requests add on top of whichever reported measure dominates: with
        # max() alone they vanish under a higher KV usage and a proxy herds every request
        # of a report period to the replica whose last report was lowest; and not capped
        # at 1: when every replica has a queue, a cap would leave the strategies blind to
        # which queue is shortest
        measured = max(reported / seats, kv_usage, 0.0)
        self.load = measured + unreported / seats


class StateView(Protocol):
    """Read-only routing state: the fleet and its residency."""

    def replicas(self) -> Sequence[ReplicaState]:
        """Every known replica of the pool, in ordinal order."""
        ...

    def leading_runs(self, keys: Sequence[int], *, now: float | None) -> dict[int, int]:
        """Each replica's leading run of ``keys`` (see ``kvcore.index``)."""
        ...

    def placed_blocks(self, ordinal: int, *, now: float) -> int:
        """Blocks this router sent the replica lately: its unexpired speculative entries
        (``ResidencyIndex.speculative_count``)."""
        ...

    def has_residency(self) -> bool:
        """Whether any confirmed (engine-reported) residency exists: false on a cold
        start, where only this proxy's speculative entries may exist."""
        ...

    def inflight(self) -> int:
        """This router's requests in flight to these replicas. The engines' figures
        (``running``, ``waiting``) count every router's, so the two compared say what
        share of the fleet's traffic this router sees (one of several behind a balancer)."""
        ...


@dataclass(slots=True)
class RouteContext:
    """Everything a policy may look at about one request; read-only by convention (not
    frozen: the proxy builds one per decision, and a frozen init of its nine fields cost
    1.25 us against 0.45 us)."""

    workload: Workload
    model: str
    block_keys: Sequence[int] = ()  # the prompt's router block keys
    token_ids: Sequence[int] = ()  # the prompt's tokens (read-only by convention)
    block_size: int = DEFAULT_BLOCK_SIZE
    session_id: str | None = None
    now: float = 0.0  # monotonic seconds, for speculative expiry
    exclude: frozenset[int] = frozenset()  # ordinals already tried for this request
    request_id: str = ""

    def __init__(  # written out: one per request (see dataplane/native.py)
        self,
        workload: Workload,
        model: str,
        block_keys: Sequence[int] = (),
        token_ids: Sequence[int] = (),
        block_size: int = DEFAULT_BLOCK_SIZE,
        session_id: str | None = None,
        now: float = 0.0,
        exclude: frozenset[int] = frozenset(),
        request_id: str = "",
    ) -> None:
        self.workload = workload
        self.model = model
        self.block_keys = block_keys
        self.token_ids = token_ids
        self.block_size = block_size
        self.session_id = session_id
        self.now = now
        self.exclude = exclude
        self.request_id = request_id

    @property
    def prompt_tokens(self) -> int:
        """Prompt length in tokens (from the keys when tokens were not passed)."""
        return len(self.token_ids) or len(self.block_keys) * self.block_size


@dataclass(slots=True)
class ReplicaReason:
    """Why a replica was or was not chosen: the explain endpoint and debug headers (not
    frozen: a debug header builds one per request, and a frozen init costs 3x)."""

    ordinal: int
    replica_id: str
    load: float
    excluded: str | None = None
    hit_blocks: int | None = None
    hit: float | None = None
    score: float | None = None
    # a strategy in time (kv_cost): seconds the request would wait and prefill there, at
    # the replica's prefill rate (learned, or configured)
    wait_s: float | None = None
    prefill_s: float | None = None
    prefill_tokens_per_s: float | None = None
    extra_step_s: float | None = None  # of prefill_s: the replica's longer steps (learned)
    # what a second of prefill weighs against one of waiting ((1 - alpha) each)
    prefill_weight: float | None = None

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready; absent figures are left out."""
        values = {
            "ordinal": self.ordinal,
            "replica_id": self.replica_id,
            "load": round(self.load, 4),
            "excluded": self.excluded,
            "hit_blocks": self.hit_blocks,
            "hit": None if self.hit is None else round(self.hit, 4),
            "score": None if self.score is None else round(self.score, 6),
            "wait_s": None if self.wait_s is None else round(self.wait_s, 6),
            "prefill_s": None if self.prefill_s is None else round(self.prefill_s, 6),
            "prefill_tokens_per_s": (
                None if self.prefill_tokens_per_s is None else round(self.prefill_tokens_per_s)
            ),
            "extra_step_s": None if self.extra_step_s is None else round(self.extra_step_s, 6),
            "prefill_weight": (
                None if self.prefill_weight is None else round(self.prefill_weight, 4)
            ),
        }
        return {k: v for k, v in values.items() if v is not None}


class Reasons(Sequence[ReplicaReason]):
    """Per-replica reasons, built on first use: the proxy's hot path rarely reads them,
    the explain endpoint does. ``chosen`` builds the chosen replica's row alone, all a
    debug header reads (building every row costs more than the decision itself)."""

    __slots__ = ("_build", "_chosen", "_rows")

    def __init__(
        self,
        build: Callable[[], Iterable[ReplicaReason]],
        chosen: Callable[[], ReplicaReason | None] | None = None,
    ) -> None:
        self._build: Callable[[], Iterable[ReplicaReason]] | None = build
        self._chosen = chosen
        self._rows: tuple[ReplicaReason, ...] = ()

    def row(self, ordinal: int) -> ReplicaReason | None:
        """The row of ``ordinal``, the chosen replica's without building the others."""
        if self._build is not None and self._chosen is not None:
            row = self._chosen()
            if row is not None and row.ordinal == ordinal:
                return row
        return next((r for r in self._materialize() if r.ordinal == ordinal), None)

    def _materialize(self) -> tuple[ReplicaReason, ...]:
        if self._build is not None:
            self._rows = tuple(sorted(self._build(), key=lambda row: row.ordinal))
            self._build = None
        return self._rows

    @overload
    def __getitem__(self, index: int) -> ReplicaReason: ...
    @overload
    def __getitem__(self, index: slice) -> tuple[ReplicaReason, ...]: ...
    def __getitem__(self, index: int | slice) -> ReplicaReason | tuple[ReplicaReason, ...]:
        return self._materialize()[index]

    def __len__(self) -> int:
        return len(self._materialize())

    def __repr__(self) -> str:
        return f"Reasons({list(self._materialize())!r})"


@dataclass(slots=True)  # one per request; a frozen init costs 3x (read-only by convention)
class SpeculativeRecord:
    """Residency the caller should record: ``keys`` on ``replica`` until ``expires_at``."""

    replica: int
    keys: tuple[int, ...]
    expires_at: float

    def __init__(self, replica: int, keys: tuple[int, ...], expires_at: float) -> None:
        self.replica = replica  # written out: one per request (see dataplane/native.py)
        self.keys = keys
        self.expires_at = expires_at


@dataclass(slots=True)  # one per request; a frozen init costs 3x (read-only by convention)
class Decision:
    """The chosen replica (``None``: no replica can serve) and the reasons."""

    replica: ReplicaState | None
    strategy: str
    reasons: Sequence[ReplicaReason] = ()  # in ordinal order, one per known replica
    note: str = ""
    speculative: SpeculativeRecord | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def __init__(  # written out: one per request (see dataplane/native.py)
        self,
        replica: ReplicaState | None,
        strategy: str,
        reasons: Sequence[ReplicaReason] = (),
        note: str = "",
        speculative: SpeculativeRecord | None = None,
        extra: dict[str, Any] | None = None,
    ) -> None:
        self.replica = replica
        self.strategy = strategy
        self.reasons = reasons
        self.note = note
        self.speculative = speculative
        self.extra = {} if extra is None else extra

    @property
    def ordinal(self) -> int | None:
        return None if self.replica is None else self.replica.ordinal

    @property
    def replica_id(self) -> str | None:
        return None if self.replica is None else self.replica.replica_id

    def summary(self) -> str:
        """One ASCII line for a debug response header: the choice and its figures."""
        text = f"replica={self.replica_id or '-'}; strategy={self.strategy}"
        row = None
        if self.ordinal is not None:
            reasons = self.reasons
            if type(reasons) is Reasons:  # not isinstance: see ReplicaBoard
                row = reasons.row(self.ordinal)
            else:
                row = next((r for r in reasons if r.ordinal == self.ordinal), None)
        if row is not None:
            if row.hit is not None:
                text += f"; hit={row.hit:.3f}"
            text += f"; load={row.load:.3f}"
            if row.score is not None:
                text += f"; score={row.score:.3f}"
        note = self.note
        if note:
            text += "; note=" + (
                note if note.isascii() else note.encode("ascii", "replace").decode()
            )
        return text

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready explanation."""
        return {
            "replica_id": self.replica_id,
            "ordinal": self.ordinal,
            "strategy": self.strategy,
            "note": self.note,
            "replicas": [reason.to_dict() for reason in self.reasons],
            **self.extra,
        }


class Policy(Protocol):
    """One routing strategy."""

    @property
    def name(self) -> str:
        """The strategy's name, as decisions carry it (a class attribute)."""
        ...

    # whether ``select`` reads the prompt (``block_keys``, ``token_ids``): a router with no
    # residency to predict from may route without keying the prompt when it does not
    reads_keys: bool

    def select(self, ctx: RouteContext, state: StateView) -> Decision:
        """Choose a replica for ``ctx`` given ``state``; never raises for a fleet shape."""
        ...
