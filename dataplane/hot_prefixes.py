"""This proxy's hot prefixes per workload, for the control plane's warm-up of new replicas.

For each workload with ``warmup.enabled``, every keyed request in the shared namespace
(no tenant salt: a tenant's prefixes are its own and never kept) is counted by a
:class:`kvcore.warmup.HotPrefixes`; a prefix at least ``warmup.min_requests`` distinct
prompts began with keeps its token ids, and each report to the control plane carries the
workload's hottest ones (``ProxyReport.hot_prefixes``). Counting costs a few dictionary
look-ups per request (one per counted depth) and nothing for workloads without warm-up;
nothing here logs (token ids are clients' prompts).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from kvcore.pb import routing_pb2
from kvcore.warmup import HotPrefixes
from kvcore.workload import Workload

MAX_WORKLOADS = 256  # tracked workloads; past this, the book starts over


class HotPrefixBook:
    """One :class:`HotPrefixes` per workload whose warm-up is on."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._tracked: dict[str, HotPrefixes] = {}

    def observe(
        self,
        workload: Workload,
        model: str,
        keys: Sequence[int],
        tokens: Callable[[], Sequence[int]],
        block_size: int,
        prompt: int,
    ) -> None:
        """Count one request's prompt (``tokens`` is read only when a prefix turns hot;
        ``prompt`` names the whole prompt, see :meth:`HotPrefixes.observe`)."""
        settings = workload.warmup
        tracked = self._tracked.get(workload.name)
        if tracked is None or tracked.settings != settings:
            if len(self._tracked) >= MAX_WORKLOADS:
                self._tracked.clear()
            tracked = self._tracked[workload.name] = HotPrefixes(settings)
        tracked.observe(model, keys, tokens, block_size, self._clock(), prompt)

    def report(self) -> list[routing_pb2.HotPrefix]:
        """Every tracked workload's hot prefixes, as the report carries them."""
        now = self._clock()
        found = []
        for name, tracked in self._tracked.items():
            for prefix in tracked.hot(now):
                found.append(
                    routing_pb2.HotPrefix(
                        workload=name,
                        model=prefix.model,
                        token_ids=prefix.tokens,
                        key=prefix.key,
                        requests_per_s=prefix.requests_per_s,
                        block_size=prefix.block_size,
                    )
                )
        return found
