"""The timing model: how long one scheduler step of the simulated engine takes.

The engine runs continuous batching (``scheduler.py``): every step admits waiting
requests (up to ``max_num_seqs`` running, and only while KV blocks are free), prefills
them, and produces one token for every running request. A step lasts::

    step = Σ_admitted prefill_i  +  decode(batch)          (0 when there is nothing to do)
    prefill_i = prefill_overhead + uncached_i / prefill_rate
                + prefill_quadratic · uncached_i · prompt_len_i
    decode(batch) = decode_base + decode_per_seq · batch      (batch = running requests)

``uncached_i`` is the prompt length minus the cached prefix, so a cache hit shortens
the time to first token exactly by the prefill of its blocks; the quadratic term (off by
default) models attention cost growing with context; the inter-token latency grows
linearly with the batch. The defaults are of the order of an 8B model on one
H100-class GPU:

| parameter | flag | default |
|---|---|---|
| prefill_rate | ``--prefill-rate`` (tokens/s) | 10,000 |
| prefill_overhead | ``--prefill-overhead-ms`` | 5 ms |
| prefill_quadratic | ``--prefill-quadratic`` (s/token²) | 0 |
| decode_base | ``--decode-base-ms`` | 10 ms |
| decode_per_seq | ``--decode-per-seq-ms`` | 0.2 ms |

Wall-clock time is ``step * time_scale * slowdown + delay`` (``--time-scale 0.1`` runs
ten times faster than real time; ``slowdown`` and ``delay`` are faults). With
``--instant`` steps take no modelled time at all: the engine still batches, caches and
publishes exactly the same, which is what functional tests and the capacity benchmark
want.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TimingModel:
    prefill_rate: float = 10_000.0
    prefill_overhead_s: float = 0.005
    prefill_quadratic_s: float = 0.0
    decode_base_s: float = 0.010
    decode_per_seq_s: float = 0.0002

    def prefill_seconds(self, prompt_len: int, cached: int) -> float:
        uncached = prompt_len - cached
        return (
            self.prefill_overhead_s
            + uncached / self.prefill_rate
            + self.prefill_quadratic_s * uncached * prompt_len
        )

    def decode_seconds(self, batch: int) -> float:
        return self.decode_base_s + self.decode_per_seq_s * batch if batch else 0.0

    def step_seconds(self, prefills: list[tuple[int, int]], batch: int) -> float:
        """``prefills`` holds ``(prompt_len, cached_tokens)`` for each admitted request."""
        prefill = sum(self.prefill_seconds(n, cached) for n, cached in prefills)
        return prefill + self.decode_seconds(batch)
