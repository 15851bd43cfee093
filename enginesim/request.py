"""One request as the engine core and its KV cache manager both see it.

Its own module so that the scheduler (which runs requests) and the cache managers
(which read their tokens and record their hits) share the type without importing each
other.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class LoraTag:
    """The LoRA adapter a request runs with, as the engine keys its blocks by it: vLLM's
    ``LoRARequest`` (``lora_name``, ``lora_int_id``, ``lora_path``); SGLang's ``LoRARef``
    (its ``lora_id`` is the simulator's ``int_id`` as text)."""

    name: str
    int_id: int
    path: str


@dataclass(frozen=True, slots=True)
class LoadedKV:
    """A decode's prompt KV read from its prefill engine (``pd.py``), as its engine counts
    it: vLLM's NIXL connector reads the prompt beyond the leading blocks the decode's cache
    holds and computes the last prompt token again for its logits
    (``_update_waiting_for_remote_kv``); SGLang's decode reads every token (or, with its
    radix cache enabled, those beyond its match), computes none and answers the cached
    tokens its prefill server found (the metadata buffer's)."""

    tokens: int  # prompt tokens read (vLLM's connector hits)
    last_recomputed: bool  # vLLM: the last prompt token is computed again
    reported: int | None = None  # SGLang: the prefill's cached_tokens, which its answer gives


@dataclass(eq=False)
class SimRequest:
    request_id: str
    prompt: list[int]
    max_tokens: int
    salt: str | None = None
    arrival: float = 0.0
    digests: list[bytes] = field(default_factory=list)  # of every full block of ``tokens``
    hit_tokens: int = 0  # the tokens the last admission found cached (set by the manager)
    num_cached_tokens: int = 0  # ``hit_tokens`` of the first admission: what clients see
    num_preemptions: int = 0
    hold_kv: bool = False  # a prefill for another engine: keep the blocks when done (pd.py)
    loaded: LoadedKV | None = None  # a P/D decode's prompt read from its prefill engine
    bootstrap_room: int | None = None  # SGLang's P/D: the room its prefill's KV is held in
    output: list[int] = field(default_factory=list)
    finished: bool = False
    lora: LoraTag | None = None  # the adapter it runs with; its blocks are keyed by it

    @property
    def num_tokens(self) -> int:
        return len(self.prompt) + len(self.output)

    @property
    def tokens(self) -> list[int]:
        """The prompt and every sampled token."""
        return self.prompt + self.output if self.output else self.prompt
