"""The engine core: continuous batching over a KV cache manager, one step at a time.

Synchronous and free of I/O, so it is tested directly; ``engine.py`` drives it from the
event loop and turns steps into wall-clock time. The KV cache is the engine's own
manager (``kv_manager.py``: vLLM's in ``blockpool.py``); this module only decides which
requests run. One ``step()`` follows vLLM v1's ``Scheduler.schedule`` and
``update_from_output``, first come first served:

1. every running request, in order, gets room for the token it computes this step (its
   last sampled one); when the cache is full, the last running request is preempted
   (its blocks freed, back at the head of the waiting queue, to recompute its prompt and
   output when admitted again) until the request fits or was itself preempted;
2. if nothing was preempted, waiting requests are admitted in order while fewer than
   ``max_num_seqs`` run and the manager finds room; admission takes the cached prefix and
   caches the prompt's full blocks before the forward pass, so a request admitted later
   in the same step hits them (the ``n`` samples of one prompt share its prefill);
3. the forward pass: every scheduled request samples one token (a request of
   ``max_tokens`` 0 samples none: a prefill only, SGLang's warm-up of ``n > 1``);
   requests that reached ``max_tokens`` finish and release their blocks, in the order
   they were scheduled.

With ``max_loras`` set, admission skips a LoRA request whose adapter would make more
adapters run at once than that (vLLM's ``scheduled_loras`` check); it stays at the head
of the queue.

Differences from vLLM, on purpose: prefill is not chunked and there is no token budget
per step; scheduling is synchronous (no async scheduling's one-step overlap);
generation always runs to ``max_tokens`` (filler tokens, no EOS).
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from enginesim.errors import RequestRejected
from enginesim.hashing import BlockHasher, prompt_digests
from enginesim.kv_manager import KVCacheManager
from enginesim.lora import WarmAdapters
from enginesim.request import LoraTag, SimRequest
from enginesim.timing import TimingModel

DEFAULT_FILLER = tuple(range(1000, 1064))


@dataclass
class StepOutput:
    duration: float = 0.0
    admitted: list[SimRequest] = field(default_factory=list)  # first admissions
    resumed: list[SimRequest] = field(default_factory=list)  # preempted, admitted again
    preempted: list[SimRequest] = field(default_factory=list)
    sampled: list[SimRequest] = field(default_factory=list)
    finished: list[SimRequest] = field(default_factory=list)


@dataclass(frozen=True)
class CoreLimits:
    block_size: int
    num_blocks: int
    max_num_seqs: int
    max_model_len: int
    max_loras: int = 0  # most adapters among running requests (vLLM's --max-loras); 0: any


class EngineCore:
    def __init__(
        self,
        limits: CoreLimits,
        hasher: BlockHasher,
        timing: TimingModel,
        kv: KVCacheManager,
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
        self.kv = kv
        self.waiting: deque[SimRequest] = deque()
        self.running: list[SimRequest] = []
        self._ids = itertools.count()
        # vLLM's CPU cache of adapters' weights; a cold adapter's load adds to the step
        self.warm: WarmAdapters | None = None
        self.lora_load_s = 0.0

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def blocks_needed(self, prompt_len: int, max_tokens: int) -> int:
        """Blocks a request holds at its longest: the prompt, then every sampled token
        but the last (a prefill only, ``max_tokens`` 0, still holds its whole prompt)."""
        computed = prompt_len + max(max_tokens - 1, 0)
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
        needed, capacity = self.blocks_needed(prompt_len, max_tokens), self.kv.capacity_blocks
        if needed > capacity:
            raise RequestRejected(
                f"The request needs {needed} KV blocks but the engine has {capacity}."
            )

    def prompt_digests(self, req: SimRequest) -> list[bytes]:
        """The digests of ``req``'s full prompt blocks (pure; safe to run in a thread)."""
        return prompt_digests(self.hasher, req.prompt, self.limits.block_size, req.salt, req.lora)

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
            self.kv.finish(req)
        elif req in self.waiting:
            self.waiting.remove(req)

    def abort_all(self) -> list[SimRequest]:
        dropped = [*self.running, *self.waiting]
        for req in dropped:
            self.abort(req)
        return dropped

    def step(self) -> StepOutput:
        out = StepOutput()
        decoding = self._schedule_running(out)
        admitted = [] if out.preempted else self._admit(out)
        self.kv.after_forward(admitted)
        for req in decoding:
            self._sample(req, out)
        prefills = [self._prefill(req, out) for req in admitted]
        self._finish_done(out)
        out.duration = self.timing.step_seconds(prefills, len(decoding))
        out.duration += self._adapter_loads(admitted) * self.lora_load_s
        return out

    def warm_adapter(self, lora: LoraTag) -> None:
        """An adapter loaded through the API: its weights are in memory."""
        if self.warm is not None:
            self.warm.touch(lora.int_id)

    def _adapter_loads(self, admitted: Sequence[SimRequest]) -> int:
        """Adapters the step's admissions had to load into memory first."""
        warm = self.warm
        if warm is None:
            return 0
        return sum(1 for req in admitted if req.lora is not None and warm.touch(req.lora.int_id))

    def _schedule_running(self, out: StepOutput) -> list[SimRequest]:
        """Room for every running request's next token, in order (a preemption takes
        the last running request, so those given room are always the first ones)."""
        running, given = self.running, 0
        while given < len(running):
            if not self._make_room(running[given], out):
                break
            given += 1
        return running[:given]

    def _make_room(self, req: SimRequest, out: StepOutput) -> bool:
        """Grow ``req``, preempting the last running request until it fits; ``False``
        when ``req`` itself was preempted."""
        while not self.kv.grow(req):
            victim = self.running.pop()
            self._preempt(victim, out)
            if victim is req:
                return False
        return True

    def _preempt(self, req: SimRequest, out: StepOutput) -> None:
        self.kv.preempt(req)
        req.num_preemptions += 1
        self.waiting.appendleft(req)
        out.preempted.append(req)

    def _admit(self, out: StepOutput) -> list[SimRequest]:
        """Waiting requests in order while there is room; a LoRA request whose adapter
        would exceed ``max_loras`` adapters among the running ones is skipped and keeps
        its place at the head of the queue, as vLLM's scheduler skips it."""
        admitted: list[SimRequest] = []
        skipped: list[SimRequest] = []
        loras = self._running_loras()
        while self.waiting and len(self.running) < self.limits.max_num_seqs:
            req = self.waiting[0]
            if self._over_loras(req, loras):
                skipped.append(self.waiting.popleft())
                continue
            if not self.kv.admit(req):
                break
            self.waiting.popleft()
            self.running.append(req)
            admitted.append(req)
            if loras is not None and req.lora is not None:
                loras.add(req.lora.int_id)
            if req.num_preemptions:
                out.resumed.append(req)
            else:
                req.num_cached_tokens = reported_cached(req)
        self.waiting.extendleft(reversed(skipped))
        return admitted

    def _over_loras(self, req: SimRequest, loras: set[int] | None) -> bool:
        """Whether admitting ``req`` would run more adapters than ``max_loras``."""
        if loras is None or req.lora is None or req.lora.int_id in loras:
            return False
        return len(loras) >= self.limits.max_loras

    def _running_loras(self) -> set[int] | None:
        """The adapters of the running requests; None when adapters are not bounded."""
        if not self.limits.max_loras:
            return None
        return {req.lora.int_id for req in self.running if req.lora is not None}

    def _prefill(self, req: SimRequest, out: StepOutput) -> tuple[int, int]:
        """Sample ``req``'s first token (or its next, when resumed); returns the tokens
        the prefill covers and those of them found cached, for the timing model."""
        computed = req.num_tokens
        if req.max_tokens:  # else a prefill only (SGLang's n > 1 warm-up): no token
            self._sample(req, out)
        if not req.num_preemptions:
            out.admitted.append(req)
        return computed, found_tokens(req)

    def _sample(self, req: SimRequest, out: StepOutput) -> None:
        filler = self.filler
        req.output.append(filler[len(req.output) % len(filler)])
        self._hash_full_blocks(req)
        out.sampled.append(req)

    def _hash_full_blocks(self, req: SimRequest) -> None:
        """Extend ``req.digests`` to every full block of its tokens, as vLLM's
        ``Request`` does when a token is appended."""
        bs = self.limits.block_size
        k = len(req.digests)
        if req.num_tokens < (k + 1) * bs:
            return
        tokens = req.tokens
        parent = req.digests[-1] if k else None
        salt = req.salt if k == 0 else None
        block = tokens[k * bs : (k + 1) * bs]
        req.digests.append(self.hasher.block_digest(parent, block, salt, req.lora))

    def _finish_done(self, out: StepOutput) -> None:
        done = [r for r in self.running if len(r.output) >= r.max_tokens]
        if not done:
            return
        self.running = [r for r in self.running if len(r.output) < r.max_tokens]
        for req in done:
            req.finished = True
            if not req.hold_kv:  # else held until ``release``
                self.kv.finish(req)
        out.finished.extend(done)

    def release(self, req: SimRequest) -> None:
        """Free the blocks of a finished request that kept them (``hold_kv``)."""
        self.kv.finish(req)

    def restart(self) -> list[SimRequest]:
        """Drop every request and the whole cache silently: an engine restart."""
        dropped = self.abort_all()
        self.kv.reset()
        return dropped


def found_tokens(req: SimRequest) -> int:
    """The prompt tokens ``req``'s admission does not compute: its cache hit and, on its
    first admission, what a P/D decode read from its prefill engine (``LoadedKV``); vLLM
    computes the last prompt token again when every one is there (``num_computed_tokens``
    is the prompt less one after ``_update_waiting_for_remote_kv``). A preempted decode
    recomputes what its cache no longer holds, as any request."""
    loaded = req.loaded
    if loaded is None or req.num_preemptions:
        return req.hit_tokens
    found = min(len(req.prompt), req.hit_tokens + loaded.tokens)
    return found - 1 if loaded.last_recomputed and found == len(req.prompt) else found


def reported_cached(req: SimRequest) -> int:
    """``req``'s ``num_cached_tokens`` (its answer's ``cached_tokens``), set at its first
    admission: vLLM's scheduler takes the tokens computed before its first step; SGLang's
    decode the count its prefill server sent, plus what its own radix hit adds beyond it
    (``prepare_for_prebuilt``: ``max(0, pre_len - already_computed)``; no hit with the
    decode's default disabled tree)."""
    loaded = req.loaded
    if loaded is not None and loaded.reported is not None:
        return max(loaded.reported, req.hit_tokens)
    return found_tokens(req)
