"""The simulator's replica model against enginesim's own engine core, request for request.

``bench.sim.engine.ReplicaModel`` jumps over decode-only steps instead of running them one
by one; driven with the same requests, it must give the same first-token times, finish
times and cache hits as ``enginesim.scheduler.EngineCore`` stepped back to back, with the
cache rule the model keeps: a request's whole sequence reserved at admission (enginesim
itself allocates as vLLM does, a block at a time, and preempts when the cache is full).
"""

from __future__ import annotations

import math
import random

import pytest

from bench.sim.engine import EngineShape, ReplicaModel
from bench.sim.workloads import Request
from enginesim.blockpool import RequestBlocks, VllmKVCacheManager
from enginesim.hashing import VllmSha256CborHasher
from enginesim.request import SimRequest
from enginesim.scheduler import CoreLimits, EngineCore
from enginesim.timing import TimingModel
from kvcore.keys import block_keys

BLOCK = 16


def _stream(rng: random.Random, n: int) -> list[tuple[float, list[int], int]]:
    """(arrival, prompt tokens, max tokens): 4 shared prefixes, unique tails."""
    prefixes = [[rng.randrange(50_000) for _ in range(rng.choice((40, 64, 100)))] for _ in range(4)]
    now, stream = 0.0, []
    for _ in range(n):
        now += rng.expovariate(15.0)
        tail = [rng.randrange(50_000) for _ in range(rng.randrange(1, 40))]
        stream.append((now, rng.choice(prefixes) + tail, rng.randrange(1, 30)))
    return stream


class _ReservingKVCacheManager(VllmKVCacheManager):
    """vLLM's cache as ``ReplicaModel`` models it: the whole sequence's blocks taken at
    admission (a running request never runs out of blocks), and only the prompt's
    blocks cached (these requests have no answer keys)."""

    def _admission_tokens(self, req: SimRequest) -> int:
        return len(req.prompt) + req.max_tokens - 1

    def _cache_full_blocks(self, req: SimRequest, held: RequestBlocks) -> None:
        if not req.output:
            super()._cache_full_blocks(req, held)


def _reference(stream, limits: CoreLimits, timing: TimingModel) -> list[tuple[float, float, int]]:
    """EngineCore stepped back to back in virtual time, as enginesim's engine drives it."""
    kv = _ReservingKVCacheManager(limits.num_blocks, limits.block_size)
    core = EngineCore(limits, VllmSha256CborHasher(), timing, kv)
    reqs = [
        SimRequest(str(i), prompt, max_tokens) for i, (_, prompt, max_tokens) in enumerate(stream)
    ]
    first: dict[str, float] = {}
    done: dict[str, float] = {}
    now, i = 0.0, 0
    while i < len(stream) or core.has_work:
        if not core.has_work:
            now = max(now, stream[i][0])
        while i < len(stream) and stream[i][0] <= now:
            core.add(reqs[i])
            i += 1
        out = core.step()
        now += out.duration
        for req in out.admitted:
            first[req.request_id] = now
        for req in out.finished:
            done[req.request_id] = now
    return [(first[r.request_id], done[r.request_id], r.num_cached_tokens) for r in reqs]


def _model(stream, shape: EngineShape) -> list[tuple[float, float, int]]:
    """The same requests through ReplicaModel and a tiny event loop."""
    wakes: list[tuple[float, int, int]] = []
    replica = ReplicaModel(
        0, shape, lambda at, r, step, v: wakes.append((at, step, v)), lambda r, events, at: None
    )
    requests = [
        Request(i, at, block_keys(prompt, model="m"), len(prompt), max_tokens)
        for i, (at, prompt, max_tokens) in enumerate(stream)
    ]
    pending = list(requests)
    while pending or wakes:
        live = [w for w in wakes if w[2] == replica.version]
        wake = min(live, default=None)
        wakes.clear()
        if wake is not None:
            wakes.append(wake)
        if pending and (wake is None or pending[0].arrival < wake[0]):
            req = pending.pop(0)
            replica.arrive(req, req.arrival)
        elif wake is not None:
            wakes.clear()
            replica.wake(wake[0], wake[1])
    return [(r.first_token_at, r.finished_at, r.cached_tokens) for r in requests]


@pytest.mark.parametrize(("num_blocks", "max_num_seqs"), [(4096, 64), (40, 4)])
def test_replica_model_matches_the_engine_core(num_blocks: int, max_num_seqs: int) -> None:
    timing = TimingModel()
    stream = _stream(random.Random(num_blocks), 150)
    limits = CoreLimits(BLOCK, num_blocks, max_num_seqs, max_model_len=10_000)
    want = _reference(stream, limits, timing)
    got = _model(stream, EngineShape(num_blocks, BLOCK, max_num_seqs, timing))
    assert [cached for _, _, cached in got] == [cached for _, _, cached in want]
    assert sum(cached for _, _, cached in got) > 0  # the stream does reuse prefixes
    for (first, done, _), (want_first, want_done, _) in zip(got, want, strict=True):
        assert math.isclose(first, want_first, rel_tol=1e-9, abs_tol=1e-9)
        assert math.isclose(done, want_done, rel_tol=1e-9, abs_tol=1e-9)
