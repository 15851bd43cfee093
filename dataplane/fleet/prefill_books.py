"""This proxy's prefill books: what each replica still has to prefill for it, for kv_cost.

``kv_cost`` ranks replicas by predicted time to first token, and for a long prompt most
of that time is the prefill queued ahead of it, which no load report shows
(:mod:`kvcore.policies.prefill`). So the proxy keeps books of its own requests:

- sent: a request going upstream is booked on its replica for its uncached tokens, the
  prompt's tokens less the cached tokens its decision predicted on that replica; a
  completion batch's later prompts are booked on a ticket of their own, behind it;
- answered: its first response bytes settle the ticket. vLLM and SGLang send a stream's
  first event with the first token, so a streamed answer is a first token now; a whole
  (non-streamed) answer says its prefill was done some time before; an error status says
  it was never prefilled. A stream's first event is a batch's first prompt's first
  token only: its later prompts' ticket waits for the request's end;
- ended: an attempt that fails, is refused, is cancelled or is retried elsewhere before
  its first bytes drops its ticket (whatever ends a request settles it: no tokens leak).

The figure reaches ``kv_cost`` as ``ReplicaState.queued_prefill_tokens``.

Who pays: books are kept only while the routing config has a ``kv_cost`` workload, at
its ``prefill_tokens_per_s`` (the lowest, if several differ). Every request sent is then
booked, whatever its workload, since each takes prefill time on its replica. Without a
``kv_cost`` workload a send and a settlement cost one test each, states carry ``None``
and nothing is re-aged.

Time: a queue drains with time, but the proxy's replica states are cached between
changes (``dataplane.fleet``). A send or a settlement rebuilds its replica's state
at once. The states of replicas still draining (an estimate above zero, :attr:`draining`)
are re-aged when routing reads the fleet and ``step_s`` has passed since the last time
(:meth:`PrefillBooks.due`). So an estimate is never low and at most ``step_s`` of
prefill high (50 tokens at the default 5 ms and 10,000 tokens/s), and re-aging costs one
state rebuild per draining replica at most once per step, whatever the request rate.

Each proxy counts only the requests it sent (proxies share no state, by design): behind
N proxies a replica's queue as one proxy sees it is its own share of the real queue.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from kvcore.pb.events_pb2 import LoadReport
from kvcore.policies import PrefillLedger
from kvcore.workload import KvCostWorkload, RoutingConfig

DEFAULT_STEP_S = 0.005


class PrefillBooks:
    """Prefill tickets per replica ledger key (see the module docstring); ``draining``
    holds the ordinals whose last state showed queued prefill above zero."""

    __slots__ = ("_aged_at", "_clock", "_ledger", "draining", "on", "step_s")

    def __init__(self, clock: Callable[[], float], step_s: float = DEFAULT_STEP_S) -> None:
        self._clock = clock
        self.step_s = step_s
        self._ledger: PrefillLedger | None = None  # made when a kv_cost workload appears
        self.on = False
        self.draining: set[int] = set()
        self._aged_at = -math.inf

    def configure(self, routing: RoutingConfig) -> None:
        """Keep books while ``routing`` has a kv_cost workload; call before rebuilding
        every state (which refills :attr:`draining`)."""
        costed = [w for w in routing.workloads if isinstance(w, KvCostWorkload)]
        rates = [w.prefill_tokens_per_s for w in costed]
        self.on = bool(rates)
        if rates:
            engine = any(w.engine_prefill_rates for w in costed)
            if self._ledger is None:
                self._ledger = PrefillLedger(min(rates), engine_rates=engine)
            self._ledger.rate = min(rates)
            self._ledger.rates.keep_engine(on=engine)
        self.draining.clear()

    def reported(self, key: int, load: LoadReport) -> None:
        """The replica's engine reported its load: the totals of its own prefill timing
        (``LoadReport.prefill_*``) tell how fast it prefills at least
        (:class:`kvcore.policies.engine_rates.EngineRates`)."""
        ledger = self._ledger
        if self.on and ledger is not None and load.prefill_requests:
            ledger.rates.engine_report(
                key, load.prefill_requests, load.prefill_seconds,
                load.prefill_computed_tokens, load.ts,
            )  # fmt: skip

    def sent(self, key: int, uncached_tokens: int) -> int:
        """Book a request sent now; its ticket (0: not booked)."""
        if not self.on:
            return 0
        assert self._ledger is not None
        return self._ledger.sent(key, uncached_tokens, self._clock())

    def answered(self, key: int, ticket: int, status: int, streaming: bool) -> None:
        """The request's first response bytes arrived now, with ``status``."""
        ledger = self._ledger
        if not ticket or ledger is None:
            return
        now = self._clock()
        if status >= 400:
            ledger.dropped(key, ticket, now)
        elif streaming:
            ledger.first_token(key, ticket, now)
        else:
            ledger.prefilled(key, ticket, now)

    def ended(self, key: int, ticket: int) -> None:
        """The request ended; a ticket still open had no first bytes (a second
        settlement of a ticket is ignored)."""
        if ticket and self._ledger is not None:
            self._ledger.dropped(key, ticket, self._clock())

    def queued(self, ordinal: int, key: int) -> float | None:
        """``queued_prefill_tokens`` of the replica now (``None``: no books kept)."""
        if not self.on:
            return None
        assert self._ledger is not None
        queued = self._ledger.queued_tokens(key, self._clock())
        if queued > 0:
            self.draining.add(ordinal)
        else:
            self.draining.discard(ordinal)
        return queued

    def rate(self, key: int) -> float | None:
        """The replica's prefill tokens per second as learned from its first tokens (the
        fleet's median, or the configured rate, until it has a history; ``None``: no
        books kept)."""
        if not self.on:
            return None
        assert self._ledger is not None
        return self._ledger.rates.rate(key)

    def extra_step(self, key: int) -> float:
        """How much longer than the fleet's typical replica's each prefill's step takes
        on the replica, as learned from its first tokens (0: as typical, or no books)."""
        ledger = self._ledger
        return ledger.rates.step_s(key) if self.on and ledger is not None else 0.0

    def learned(
        self, key: int
    ) -> tuple[float, tuple[float, float] | None, float | None, float | None] | None:
        """What the replica's timings have taught: (the rate routing ranks it at, its own
        line (fixed seconds, tokens per second) or ``None``, its slowness against the
        fleet's typical replica or ``None``, the rate its engine's own timing shows it
        prefills at least or ``None``); ``None`` while none is known."""
        if not self.on:
            return None
        assert self._ledger is not None
        rates = self._ledger.rates
        line, slower, engine = rates.line(key), rates.slower(key), rates.engine_rate(key)
        if line is None and slower is None and engine is None:
            return None
        return rates.rate(key), line, slower, engine

    def due(self) -> bool:
        """Whether the draining replicas' states are a step old (if so, a new step
        starts now: rebuild them)."""
        now = self._clock()
        if now - self._aged_at < self.step_s:
            return False
        self._aged_at = now
        return True

    def pending(self, key: int) -> int:
        """Tickets still open on the replica (requests without their first bytes)."""
        return 0 if self._ledger is None else self._ledger.pending(key)

    def forget_rate(self, key: int) -> None:
        """The replica's warm-up ended: the first tokens it gave while warming waited
        behind the warm-up's prefills, so its learned rate starts over."""
        if self._ledger is not None:
            self._ledger.rates.forget(key)

    def forget(self, key: int) -> None:
        """The replica left the fleet."""
        if self._ledger is not None:
            self._ledger.forget(key)
