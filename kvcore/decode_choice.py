"""Which decode replica generates a disaggregated request: the proxy's and the simulator's rule.

A decode replica's work is generation: its load (seats taken, or KV in use, whichever
is higher) decides the inter-token latency of everything it runs, so the least loaded
replica is the base choice. Where decode replicas report residency (an engine that
caches the KV it read and publishes it: vLLM's, and SGLang's only when started with
``--disaggregation-decode-enable-radix-cache``), part of the prompt may already be there:
the decode then reads only the blocks it lacks, so holding the prompt shortens the
transfer. Holding it is worth a little load, not a lot: among the replicas within
:data:`LOAD_SLACK` of the least loaded, the one holding the longest leading run of the
prompt wins; then the lower load, then the more KV headroom, then the lower ordinal (a
stable order, so a choice is reproducible). SGLang's decode at its defaults keeps no
prefix cache and publishes nothing: every candidate's ``resident_blocks`` is 0 and the
choice is by load and KV headroom alone.
The slack is measured: in ``kvroute bench sim --scenario pd_shared_prefix`` an eighth of
the seats took 7-8% off the mean time to first token against a sixteenth (the holder's
prompt is read, or shared, instead of sent again) at the same inter-token latency, and a
quarter or more added nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

LOAD_SLACK = 1 / 8  # of a replica's seats: how much more loaded a holder may be


@dataclass(frozen=True, slots=True)
class DecodeCandidate:
    """A decode replica as the choice sees it."""

    ordinal: int
    load: float  # ``ReplicaState.load``: seats taken (or KV in use), plus the queue
    kv_usage: float  # 0-1
    resident_blocks: int = 0  # the prompt's leading blocks it holds (0: it reports none)


def choose_decode(
    candidates: Sequence[DecodeCandidate], *, load_slack: float = LOAD_SLACK
) -> int | None:
    """The ordinal of the decode replica to use, or ``None`` when there is none."""
    if not candidates:
        return None
    floor = min(c.load for c in candidates)
    near = [c for c in candidates if c.load <= floor + load_slack]
    best = min(near, key=lambda c: (-c.resident_blocks, c.load, c.kv_usage, c.ordinal))
    return best.ordinal
