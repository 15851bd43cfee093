"""The engine core: continuous batching over the block pool, one step at a time.

Synchronous and free of I/O, so it is tested directly; ``engine.py`` drives it from the
event loop and turns steps into wall-clock time. One ``step()``:

1. every running request computes its last sampled token and samples the next one;
   a block that becomes full is cached (``BlockStored``);
2. waiting requests are admitted first come, first served while fewer than
   ``max_num_seqs`` run and their blocks are free; admission looks up the longest cached
   prefix (capped at ``prompt_len - 1`` tokens, as vLLM recomputes at least one token),
   takes those blocks, allocates the rest (evicting LRU cached blocks) and caches the
   prompt's full blocks at once, before the step's forward pass, as vLLM v1 does
   (``KVCacheManager.allocate_slots``): a request admitted later in the same step hits
   them, which is how the ``n`` samples of one prompt share its prefill; then it
   prefills and samples the first token (none if ``max_tokens`` is 0: a prefill only,
   SGLang's warm-up of ``n > 1``, finished in the same step);
3. requests that reached ``max_tokens`` finish and release their blocks.

Differences from vLLM, on purpose: a request reserves the blocks for its whole
sequence (prompt + ``max_tokens``) at admission, so there is no preemption; prefill is
not chunked; generation always runs to ``max_tokens`` (filler tokens, no EOS).
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from enginesim.blockpool import BlockPool, KVBlock
from enginesim.errors import RequestRejected
from enginesim.hashing import BlockHasher, prompt_digests
from enginesim.timing import TimingModel

DEFAULT_FILLER = tuple(range(1000, 1064))


@dataclass(eq=False)
class SimRequest:
    request_id: str
    prompt: list[int]
    max_tokens: int
    salt: str | None = None
    arrival: float = 0.0
    digests: list[bytes] = field(default_factory=list)
    blocks: list[KVBlock] = field(default_factory=list)
    num_cached_tokens: int = 0
    num_cached_blocks: int = 0  # leading blocks known to the cache (hit or stored)
    output: list[int] = field(default_factory=list)
    finished: bool = False

    @property
    def num_computed(self) -> int:
        """Tokens whose KV exists: the prompt, then every sampled token but the last."""
        return len(self.prompt) + max(len(self.output) - 1, 0)


@dataclass
class StepOutput:
    duration: float = 0.0
    admitted: list[SimRequest] = field(default_factory=list)
    sampled: list[SimRequest] = field(default_factory=list)
    finished: list[SimRequest] = field(default_factory=list)


@dataclass(frozen=True)
class CoreLimits:
    block_size: int
    num_blocks: int
    max_num_seqs: int
    max_model_len: int


class EngineCore:
    def __init__(
        self,
        limits: CoreLimits,
        hasher: BlockHasher,
        timing: TimingModel,
        filler: Sequence[int] = DEFAULT_FILLER,
    ) -> None:
        """``filler``: the token ids sampled in turn (output position i gets
        ``filler[i % len(filler)]``)."""
        if not filler:
            raise ValueError("filler needs at least one token id")
        self.filler = tuple(filler)
        self.limits = limits
        self.hasher = hasher
        self.timing = timing
        self.pool = BlockPool(limits.num_blocks, limits.block_size)
        self.waiting: deque[SimRequest] = deque()
        self.running: list[SimRequest] = []
        self._ids = itertools.count()

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def blocks_needed(self, prompt_len: int, max_tokens: int) -> int:
        computed = prompt_len + max_tokens - 1
        return -(-computed // self.limits.block_size)

    def check(self, prompt_len: int, max_tokens: int) -> None:
        """Raise ``RequestRejected`` for a request this engine can never serve."""
        limit = self.limits.max_model_len
        if prompt_len + max_tokens > limit:
            raise RequestRejected(
                f"This model's maximum context length is {limit} tokens. However, you "
                f"requested {prompt_len + max_tokens} tokens ({prompt_len} in the messages, "
                f"{max_tokens} in the completion). Please reduce the length of the messages "
                "or completion."
            )
        if self.blocks_needed(prompt_len, max_tokens) > self.limits.num_blocks:
            raise RequestRejected(
                f"The request needs {self.blocks_needed(prompt_len, max_tokens)} KV blocks "
                f"but the engine has {self.limits.num_blocks}."
            )

    def prompt_digests(self, req: SimRequest) -> list[bytes]:
        """The digests of ``req``'s full prompt blocks (pure; safe to run in a thread)."""
        return prompt_digests(self.hasher, req.prompt, self.limits.block_size, req.salt)

    def add(self, req: SimRequest, digests: list[bytes] | None = None) -> None:
        """Queue ``req``; ``digests`` may be precomputed with ``prompt_digests``."""
        self.check(len(req.prompt), req.max_tokens)
        req.digests = self.prompt_digests(req) if digests is None else digests
        self.waiting.append(req)

    def abort(self, req: SimRequest) -> None:
        if req.finished:
            return
        req.finished = True
        if req in self.running:
            self.running.remove(req)
            self.pool.free(req.blocks)
        elif req in self.waiting:
            self.waiting.remove(req)

    def abort_all(self) -> list[SimRequest]:
        dropped = [*self.running, *self.waiting]
        for req in dropped:
            self.abort(req)
        return dropped

    def step(self) -> StepOutput:
        out = StepOutput()
        decoding = list(self.running)
        for req in decoding:
            self._sample(req, out)
        prefills = [self._prefill(req, out) for req in self._admit()]
        self._finish_done(out)
        out.duration = self.timing.step_seconds(prefills, len(decoding))
        return out

    def _admit(self) -> list[SimRequest]:
        admitted: list[SimRequest] = []
        while self.waiting and len(self.running) < self.limits.max_num_seqs:
            req = self.waiting[0]
            max_hit = (len(req.prompt) - 1) // self.limits.block_size
            hits = self.pool.longest_cached_prefix(req.digests[:max_hit])
            n_new = self.blocks_needed(len(req.prompt), req.max_tokens) - len(hits)
            if not self.pool.can_allocate(hits, n_new):
                break
            self.waiting.popleft()
            self.pool.touch(hits)
            req.blocks = [*hits, *self.pool.allocate(n_new)]
            req.num_cached_blocks = len(hits)
            req.num_cached_tokens = len(hits) * self.limits.block_size
            self._cache_full_blocks(req)  # at allocation, as vLLM v1's ``allocate_slots``
            self.running.append(req)
            admitted.append(req)
        return admitted

    def _prefill(self, req: SimRequest, out: StepOutput) -> tuple[int, int]:
        if req.max_tokens:  # else a prefill only (SGLang's n > 1 warm-up): no token
            self._sample(req, out)
        out.admitted.append(req)
        return len(req.prompt), req.num_cached_tokens

    def _sample(self, req: SimRequest, out: StepOutput) -> None:
        filler = self.filler
        req.output.append(filler[len(req.output) % len(filler)])
        self._cache_full_blocks(req)
        out.sampled.append(req)

    def _cache_full_blocks(self, req: SimRequest) -> None:
        bs = self.limits.block_size
        full = req.num_computed // bs
        start = req.num_cached_blocks
        if full <= start:
            return
        tokens = self._tokens(req)
        parent = req.digests[start - 1] if start else None
        while len(req.digests) < full:
            k = len(req.digests)
            block_tokens = tokens[k * bs : (k + 1) * bs]
            salt = req.salt if k == 0 else None
            parent_k = req.digests[-1] if k else None
            req.digests.append(self.hasher.block_digest(parent_k, block_tokens, salt))
        salt = req.salt if start == 0 else None
        self.pool.cache_run(
            req.blocks[start:full],
            req.digests[start:full],
            parent,
            tokens[start * bs : full * bs],
            salt,
        )
        req.num_cached_blocks = full

    @staticmethod
    def _tokens(req: SimRequest) -> Sequence[int]:
        return req.prompt + req.output if req.output else req.prompt

    def _finish_done(self, out: StepOutput) -> None:
        done = [r for r in self.running if len(r.output) >= r.max_tokens]
        if not done:
            return
        self.running = [r for r in self.running if len(r.output) < r.max_tokens]
        for req in done:
            req.finished = True
            self.pool.free(req.blocks)
        out.finished.extend(done)

    def restart(self) -> list[SimRequest]:
        """Drop every request and the whole cache silently: an engine restart."""
        dropped = self.abort_all()
        self.pool.reset()
        return dropped
