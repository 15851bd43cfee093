"""The proof of "keys may be missing, never wrong": the sidecar against a model engine.

A hypothesis state machine drives an engine model (:class:`EngineModel`: the engine
blocks actually resident per data-parallel rank and medium, cached the way vLLM and SGLang
cache them) and the sidecar's real pipeline (adapter, key mapper, outbox), with every
engine event encoded in a real wire format and the published batches applied the way the
control plane applies them (:class:`ResidencyMirror`). Random interleavings of stores
(prefix walks that stop at the first missing block, so that blocks evicted out of order
are computed and stored again; and runs chained to any resident block, as a request
goes on after a sliding window dropped its early blocks), removals of any resident
blocks in any order, clears, lost ranges with and without a usable replay history, engine
restarts and sidecar restarts, for engine/router block sizes 16/16, 16/32, 16/64, 1/16
and 32/16 in vLLM and SGLang formats (SGLang pages may end short). After every step:

- every published router key is *backed*: every engine block that contributed tokens to
  it is resident, in one rank, on that medium (never wrong);
- every backed key of a rank whose events were not lost is published (nothing missing);
- the published state equals the sidecar's own, listed parents first, and the sidecar
  says its state is incomplete exactly when events were lost.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import xxhash
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from kvcore.engine_events import (
    MEDIUM_CPU,
    MEDIUM_GPU,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EngineEvent,
)
from kvcore.keys import block_keys
from sidecar.adapters import adapter_for
from sidecar.adapters.encoders import FORMATS, encode_batch
from sidecar.outbox import Outbox, OutboxConfig
from sidecar.pipeline import Pipeline
from sidecar.zmq_source import EngineRestarted, Frame, FramesLost, HistoryReplay
from tests.unit.sidecar.support import ResidencyMirror

MODEL = "m"
MEDIA = (MEDIUM_GPU, MEDIUM_CPU)
# (wire format, engine block size, router block size)
COMBOS = [
    (fmt, engine_bs, router_bs)
    for engine_bs, router_bs in ((16, 16), (16, 32), (16, 64), (32, 16))
    for fmt in ("vllm-0.23", "vllm-0.33", "sglang-0.5.23")
] + [("sglang-0.5.23", 1, 16)]
RARELY = st.sampled_from((1, 1, 1, 0))  # a rare step acts when this is 0


@dataclass(frozen=True, slots=True)
class Block:
    parent: int | None
    tokens: tuple[int, ...]
    namespace: str


def block_hash(parent: int | None, tokens: tuple[int, ...], namespace: str) -> int:
    """A chained engine hash: the same prefix (and salt) gives the same hash."""
    data = repr((parent, tokens, namespace if parent is None else "")).encode()
    return xxhash.xxh3_64_intdigest(data)


@dataclass
class EngineModel:
    """The engine's prefix cache per (rank, medium): which blocks are resident.

    A store walks the prompt down resident blocks and caches the rest as a new run
    chained to the last block found, as vLLM (full blocks, aligned at token 0) and SGLang
    (pages cut from the start of each new run, the last one possibly short) do; blocks of
    the run that are still resident further down are reported again."""

    engine_bs: int
    partial_pages: bool
    registry: dict[int, Block] = field(default_factory=dict)
    resident: dict[tuple[int, str], set[int]] = field(default_factory=dict)
    completed: dict[int, list[tuple[int, tuple[int, ...]]]] = field(default_factory=dict)

    def cache(self, rank: int, medium: str) -> set[int]:
        return self.resident.setdefault((rank, medium), set())

    def _walk(self, cached: set[int], tokens: list[int], ns: str) -> tuple[int | None, int]:
        """The last resident block on the prompt's path and the tokens it covers."""
        parent: int | None = None
        pos = 0
        while pos < len(tokens):
            found = None
            for length in range(min(self.engine_bs, len(tokens) - pos), 0, -1):
                if length < self.engine_bs and not self.partial_pages:
                    break
                h = block_hash(parent, tuple(tokens[pos : pos + length]), ns)
                if h in cached:
                    found = (h, length)
                    break
            if found is None:
                break
            parent, pos = found[0], pos + found[1]
        return parent, pos

    def store(self, rank: int, medium: str, tokens: list[int], ns: str) -> list[EngineEvent]:
        """A request's prompt: what is not cached along its path becomes a new run."""
        parent, pos = self._walk(self.cache(rank, medium), tokens, ns)
        return self._run(rank, medium, parent, tokens[pos:], ns)

    def extend(self, rank: int, medium: str, parent: int, tokens: list[int]) -> list[EngineEvent]:
        """A run chained to a resident block whose ancestors may be gone: a running request
        whose early blocks a sliding window or an offload tier already dropped."""
        return self._run(rank, medium, parent, tokens, "")

    def _run(
        self, rank: int, medium: str, parent: int | None, tokens: list[int], ns: str
    ) -> list[EngineEvent]:
        size = self.engine_bs
        end = len(tokens) if self.partial_pages else len(tokens) // size * size
        hashes, previous, cached = [], parent, self.cache(rank, medium)
        for start in range(0, end, size):
            chunk = tuple(tokens[start : min(start + size, end)])
            h = block_hash(previous, chunk, ns)
            self.registry[h] = Block(previous, chunk, ns)
            cached.add(h)
            hashes.append(h)
            previous = h
        if not hashes:
            return []
        run_ns = ns if parent is None else ""
        return [
            BlockStored(tuple(hashes), parent, tuple(tokens[:end]), size, medium, namespace=run_ns)
        ]

    def remove(self, rank: int, medium: str, victims: list[int]) -> list[EngineEvent]:
        cached = self.cache(rank, medium)
        gone = [h for h in dict.fromkeys(victims) if h in cached]
        cached.difference_update(gone)
        return [BlockRemoved(tuple(gone), medium)] if gone else []

    def clear(self, rank: int) -> list[EngineEvent]:
        for medium in MEDIA:
            self.cache(rank, medium).clear()
        return [AllBlocksCleared()]

    # -- what the router may believe ------------------------------------------------
    def backed(self, rank: int, router_bs: int) -> set[tuple[str, int]]:
        """Router keys whose every contributing engine block is resident in ``rank`` (on
        that medium): the engine would serve all of their tokens from its cache."""
        out: set[tuple[str, int]] = set()
        for (cached_rank, medium), cached in self.resident.items():
            if cached_rank == rank:
                for h in cached:
                    for key, contributors in self._completed_in(h, router_bs):
                        if cached.issuperset(contributors):
                            out.add((medium, key))
        return out

    def path(self, h: int) -> list[int]:
        """The blocks from the root down to ``h``, resident or not."""
        path: list[int] = []
        current: int | None = h
        while current is not None:
            path.append(current)
            current = self.registry[current].parent
        return path[::-1]

    def _completed_in(self, h: int, router_bs: int) -> list[tuple[int, tuple[int, ...]]]:
        """The router keys completed inside block ``h``, each with the engine blocks that
        hold its tokens (fixed by content, so remembered)."""
        if h in self.completed:
            return self.completed[h]
        path = self.path(h)
        spans, tokens = [], []
        for b in path:
            spans.append((len(tokens), len(tokens) + len(self.registry[b].tokens), b))
            tokens.extend(self.registry[b].tokens)
        ns = self.registry[path[0]].namespace
        keys = block_keys(tokens, model=MODEL, namespace=ns, block_size=router_bs)
        start = spans[-1][0]
        self.completed[h] = [
            (key, tuple(b for s, e, b in spans if s < (j + 1) * router_bs and e > j * router_bs))
            for j, key in enumerate(keys)
            if start < (j + 1) * router_bs
        ]
        return self.completed[h]


class ResidencyMachine(RuleBasedStateMachine):
    """One engine (1 or 2 data-parallel ranks) and its sidecar, stepped together."""

    def __init__(self) -> None:
        super().__init__()
        self.epochs = iter(range(1, 10_000))

    @initialize(
        combo=st.sampled_from(COMBOS), ranks=st.sampled_from([1, 2]), seed=st.integers(0, 999)
    )
    def start(self, combo: tuple[str, int, int], ranks: int, seed: int) -> None:
        self.fmt, engine_bs, self.router_bs = combo
        self.ranks = ranks
        sglang = FORMATS[self.fmt].engine == "sglang"
        self.engine = EngineModel(engine_bs, partial_pages=sglang and engine_bs > 1)
        rng = self.rng = random.Random(seed)
        unit = max(engine_bs, self.router_bs) // 2
        self.segments = [[rng.randrange(6) for _ in range(unit)] for _ in range(3)]
        self.prompts: list[tuple[list[int], str]] = []
        self.history: list[list[Frame]] = [[] for _ in range(ranks)]
        self.lost = [False] * ranks
        self.mirror = ResidencyMirror()
        self.pipeline = self._new_pipeline()

    def _new_pipeline(self) -> Pipeline:
        outbox = Outbox(OutboxConfig(replica_id="r", pool="p"), epoch=next(self.epochs))
        outbox.needs_snapshot = True  # as on every NATS connection
        return Pipeline(
            adapter=adapter_for(FORMATS[self.fmt].engine),
            model=MODEL,
            router_block_size=self.router_bs,
            outbox=outbox,
            new_epoch=lambda: next(self.epochs),
            ranks=self.ranks,
        )

    # -- engine operations -------------------------------------------------------------
    def _emit(self, rank: int, events: list[EngineEvent], deliver: bool = True) -> None:
        if not events:
            return
        seq = len(self.history[rank])
        frame = Frame(b"", seq, encode_batch(events, self.fmt, rank=rank), 0)
        self.history[rank].append(frame)
        if deliver:
            self.pipeline.handle(frame, rank)
            self._publish()

    def _prompt(self, data: st.DataObject, again: bool = False) -> tuple[list[int], str]:
        """A new prompt sharing segments with others or, ``again``, a prefix of one sent
        before, so that evicted blocks are computed and stored again."""
        if again and self.prompts:
            tokens, ns = data.draw(st.sampled_from(self.prompts))
            return tokens[: data.draw(st.integers(1, len(tokens)))], ns
        picks = data.draw(st.lists(st.integers(0, 2), min_size=1, max_size=6))
        tokens = [t for i in picks for t in self.segments[i]]
        tokens += data.draw(st.lists(st.integers(0, 5), max_size=self.engine.engine_bs))
        ns = data.draw(st.sampled_from(["", "", "tenant"]))
        self.prompts.append((tokens, ns))
        return tokens, ns

    def _operation(self, data: st.DataObject, rank: int) -> list[EngineEvent]:
        kind = data.draw(st.sampled_from(["store", "store", "remove", "clear"]))
        medium = data.draw(st.sampled_from(MEDIA))
        if kind == "store":
            tokens, ns = self._prompt(data)
            return self.engine.store(rank, medium, tokens, ns)
        if kind == "remove":
            cached = sorted(self.engine.cache(rank, medium))
            if not cached:
                return []
            victims = data.draw(st.lists(st.sampled_from(cached), min_size=1, max_size=3))
            return self.engine.remove(rank, medium, victims)
        return self.engine.clear(rank)

    # Stores and removals are the common steps; the rarer ones (clears, losses,
    # restarts) act only when ``now`` is 0, so that caches grow between them.
    @rule(data=st.data(), count=st.integers(1, 3))
    def store(self, data: st.DataObject, count: int) -> None:
        for _ in range(count):
            rank = data.draw(st.integers(0, self.ranks - 1))
            tokens, ns = self._prompt(data)
            medium = data.draw(st.sampled_from(MEDIA))
            self._emit(rank, self.engine.store(rank, medium, tokens, ns))

    @rule(data=st.data(), count=st.integers(1, 3))
    def store_again(self, data: st.DataObject, count: int) -> None:
        for _ in range(count):
            rank = data.draw(st.integers(0, self.ranks - 1))
            tokens, ns = self._prompt(data, again=True)
            medium = data.draw(st.sampled_from(MEDIA))
            self._emit(rank, self.engine.store(rank, medium, tokens, ns))

    @rule(data=st.data())
    def extend(self, data: st.DataObject) -> None:
        rank = data.draw(st.integers(0, self.ranks - 1))
        medium = data.draw(st.sampled_from(MEDIA))
        cached = self.engine.cache(rank, medium)
        holed = [h for h in sorted(cached) if not cached.issuperset(self.engine.path(h))]
        choices = holed if holed and data.draw(st.booleans()) else sorted(cached)
        if choices:
            parent = data.draw(st.sampled_from(choices))
            length = data.draw(st.integers(1, 2 * self.router_bs))
            tokens = [self.rng.randrange(6) for _ in range(length)]
            self._emit(rank, self.engine.extend(rank, medium, parent, tokens))

    @rule(data=st.data(), count=st.integers(1, 3))
    def remove(self, data: st.DataObject, count: int) -> None:
        for _ in range(count):
            rank = data.draw(st.integers(0, self.ranks - 1))
            medium = data.draw(st.sampled_from(MEDIA))
            cached = sorted(self.engine.cache(rank, medium))
            if cached:
                victims = data.draw(st.lists(st.sampled_from(cached), min_size=1, max_size=3))
                self._emit(rank, self.engine.remove(rank, medium, victims))

    @rule(data=st.data(), now=RARELY)
    def clear(self, data: st.DataObject, now: int) -> None:
        rank = data.draw(st.integers(0, self.ranks - 1))
        if now:
            return
        self._emit(rank, self.engine.clear(rank))
        self.lost[rank] = False

    @rule(data=st.data(), usable_history=st.booleans(), now=RARELY)
    def lose_a_range(self, data: st.DataObject, usable_history: bool, now: int) -> None:
        """Batches never reach the sidecar; replay either rebuilds from the engine's whole
        history or cannot (buffer too short, or no replay endpoint)."""
        if now:
            return
        rank = data.draw(st.integers(0, self.ranks - 1))
        first = len(self.history[rank])
        for _ in range(data.draw(st.integers(1, 4))):
            self._emit(rank, self._operation(data, rank), deliver=False)
        if len(self.history[rank]) == first:
            return
        self.pipeline.handle(FramesLost(first, len(self.history[rank]) - 1), rank)
        self._publish()
        if usable_history:
            self._rebuild(rank)
        else:
            self.lost[rank] = True

    def _rebuild(self, rank: int) -> None:
        list(self.pipeline.rebuild_steps(HistoryReplay(tuple(self.history[rank])), rank))
        self.lost[rank] = False
        self._publish()

    @rule(data=st.data(), now=RARELY)
    def restart_engine(self, data: st.DataObject, now: int) -> None:
        if now:
            return
        rank = data.draw(st.integers(0, self.ranks - 1))
        self.engine.clear(rank)
        seq = len(self.history[rank])
        self.history[rank] = []
        self.pipeline.handle(EngineRestarted(seq), rank)
        self.lost[rank] = False
        self._publish()

    @rule(usable_history=st.booleans(), now=RARELY)
    def restart_sidecar(self, usable_history: bool, now: int) -> None:
        if now:
            return
        self.pipeline = self._new_pipeline()
        for rank in range(self.ranks):
            if usable_history and self.history[rank]:
                self._rebuild(rank)
            elif self.history[rank]:  # live from the next batch on: all before is lost
                self.pipeline.handle(FramesLost(0, len(self.history[rank]) - 1), rank)
                self.lost[rank] = True
        self._publish()

    # -- publishing, as the service does -----------------------------------------------
    def _publish(self) -> None:
        outbox = self.pipeline.outbox
        if outbox.needs_snapshot:
            for batch in outbox.snapshot(self.pipeline.mapper.held(), 0):
                self.mirror.apply(batch.payload)
        while (batch := outbox.take_batch()) is not None:
            self.mirror.apply(batch.payload)

    # -- what must hold after every step ----------------------------------------------
    @invariant()
    def published_keys_are_backed_and_none_is_missing_unless_events_were_lost(self) -> None:
        self._publish()
        published = self.mirror.keys
        backed = [self.engine.backed(rank, self.router_bs) for rank in range(self.ranks)]
        wrong = published.difference(*backed)
        assert not wrong, f"{len(wrong)} published keys the engine cannot serve"
        for rank in range(self.ranks):
            missing = backed[rank] - published if not self.lost[rank] else set()
            assert not missing, f"{len(missing)} backed keys missing though nothing was lost"

    @invariant()
    def published_state_is_the_sidecars_own_listed_parents_first(self) -> None:
        held = list(self.pipeline.mapper.held())
        keys = {(medium, key) for medium, key, _ in held}
        assert keys == self.mirror.keys
        listed: set[tuple[str, int]] = set()
        for medium, key, parent in held:
            if (medium, parent) in keys:
                assert (medium, parent) in listed, "a key listed before its parent"
            listed.add((medium, key))

    @invariant()
    def incomplete_exactly_when_events_were_lost(self) -> None:
        assert self.pipeline.state_incomplete == any(self.lost)


ResidencyMachine.TestCase.settings = settings(
    max_examples=120, stateful_step_count=30, deadline=None
)
TestResidencyModel = ResidencyMachine.TestCase
