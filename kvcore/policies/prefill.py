"""The prefill work a proxy has queued on each replica: ``ReplicaState.queued_prefill_tokens``.

Time to first token on a replica is the prefill work ahead of a request plus its own
uncached tokens, at the replica's prefill rate. A proxy knows its own part of that work
exactly and without delay: every request it sent and whose first token has not come
back is still to prefill, for its prompt tokens minus the cached prefix the residency
map showed when it was routed. The engine's load report says only how many requests
wait, is up to a heartbeat old, and leaves out the prefill in progress, which for long
prompts is most of the wait (Dynamo's router keeps the same books for the same reason).

Tokens sent are not all still ahead: the replica has been prefilling since its queue
last moved. When a first token comes back, the replica has just finished a prefill and
everything still pending starts from there, so that moment *anchors* the queue; between
anchors the replica works through it at ``rate`` tokens per second::

    queued(r, now) = max(0, pending(r) - rate * (now - anchor(r)))

An idle replica (nothing pending) anchors at the next send, and a send never inherits
more work done than was pending (a replica slower than ``rate``, whose estimate reached
zero before its first token, still owes the new request all of it). ``rate`` is only
used to age the queue between first tokens; an error in it is corrected at the next one.

A request can also leave the books without a first token the router saw, and then the
queue is taken to be worked first come, first served (``ahead``: the tokens of this
router's requests sent before it and still pending):

- :meth:`~PrefillLedger.prefilled`: its prefill finished at some time before ``at`` (a
  whole non-streamed answer came back): at least ``ahead`` + its own tokens are done;
- :meth:`~PrefillLedger.dropped`: it ended with no first token (refused, failed,
  cancelled, retried elsewhere): work assumed done on it was wasted, not done on the
  requests behind it.

:class:`PrefillLedger`: ``ticket = sent(r, tokens, at)`` when a request goes upstream,
``first_token(r, ticket, at)`` when its first token arrives, or ``prefilled``/``dropped``
(a second settlement of a ticket is ignored), ``queued_tokens(r, now)`` for the routing
state. O(1) each, except ``prefilled``/``dropped``: O(this router's requests pending on r).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import count


@dataclass(slots=True)
class _Queue:
    pending: dict[int, float] = field(default_factory=dict)  # ticket -> uncached tokens
    tokens: float = 0.0  # sum of pending
    anchor: float = 0.0  # when the replica last started on its pending work


class PrefillLedger:
    """Per replica ordinal: this proxy's requests still waiting for their first token."""

    __slots__ = ("_queues", "_tickets", "rate")

    def __init__(self, prefill_tokens_per_s: float) -> None:
        if prefill_tokens_per_s <= 0:
            raise ValueError("prefill_tokens_per_s must be positive")
        self.rate = prefill_tokens_per_s
        self._queues: dict[int, _Queue] = {}
        self._tickets = count(1)

    def sent(self, replica: int, uncached_tokens: float, at: float) -> int:
        """A request with ``uncached_tokens`` to prefill went to ``replica`` at ``at``;
        returns the ticket for :meth:`first_token`."""
        queue = self._queues.get(replica)
        if queue is None:
            queue = self._queues[replica] = _Queue()
        if not queue.pending:
            queue.anchor = at  # idle: the replica starts on it now
        else:  # work beyond what it had been sent is no head start on this one
            queue.anchor = max(queue.anchor, at - queue.tokens / self.rate)
        ticket = next(self._tickets)
        tokens = max(float(uncached_tokens), 0.0)
        queue.pending[ticket] = tokens
        queue.tokens += tokens
        return ticket

    def first_token(self, replica: int, ticket: int, at: float) -> None:
        """The request of ``ticket`` produced its first token at ``at``."""
        queue = self._queues.get(replica)
        if queue is None or ticket not in queue.pending:
            return
        queue.tokens -= queue.pending.pop(ticket)
        if not queue.pending:
            queue.tokens = 0.0  # no drift from float sums
        queue.anchor = max(queue.anchor, at)

    def prefilled(self, replica: int, ticket: int, at: float) -> None:
        """The request of ``ticket`` was prefilled at some time before ``at`` (its whole
        answer came back at once)."""
        self._settle(replica, ticket, at, done=True)

    def dropped(self, replica: int, ticket: int, at: float) -> None:
        """The request of ``ticket`` ended at ``at`` without a first token."""
        self._settle(replica, ticket, at, done=False)

    def _settle(self, replica: int, ticket: int, at: float, *, done: bool) -> None:
        queue = self._queues.get(replica)
        if queue is None or ticket not in queue.pending:
            return
        ahead = 0.0
        for other, pending in queue.pending.items():
            if other == ticket:
                break
            ahead += pending
        tokens = queue.pending.pop(ticket)
        at = max(at, queue.anchor)
        drained = self.rate * (at - queue.anchor)  # work the replica has done since
        if done:
            drained = max(drained, ahead + tokens)
        drained -= min(max(drained - ahead, 0.0), tokens)  # of which on the others
        queue.tokens = queue.tokens - tokens if queue.pending else 0.0
        queue.anchor = at - drained / self.rate

    def queued_tokens(self, replica: int, now: float) -> float:
        """Prompt tokens of this proxy's requests ``replica`` has still to prefill."""
        queue = self._queues.get(replica)
        if queue is None or not queue.pending:
            return 0.0
        return max(0.0, queue.tokens - self.rate * max(0.0, now - queue.anchor))

    def pending(self, replica: int) -> int:
        """This proxy's requests on ``replica`` still waiting for their first token."""
        queue = self._queues.get(replica)
        return 0 if queue is None else len(queue.pending)

    def forget(self, replica: int) -> None:
        """Drop ``replica``'s books (it left the fleet; its ordinal may be reused)."""
        self._queues.pop(replica, None)
