"""What ``kv_aware`` and ``kv_cost`` share: residency lookup, the new-prompt turn, the
hot-prefix and imbalance moves, fallback and speculation.

A level-3 strategy looks up each candidate's leading run of the prompt's block keys
(confirmed plus unexpired speculative residency), scores the candidates its own way
(:meth:`KvScoringPolicy.scores`), and asks the caller to record the prompt's keys as
speculatively resident on the chosen replica for ``speculative_ttl_s`` (rounded up to
:data:`SPECULATION_TICK_S`). Around the score:

- a prompt no candidate holds a counted hit of goes to the next usable replica in turn
  (:meth:`KvScoringPolicy.without_hit`), not to the best load: loads are as stale as the
  engines' last report; several routers behind one balancer start their turns spread
  round the fleet (:meth:`KvScoringPolicy.take_place`), so their turns do not coincide;
  ``kv_cost`` sends a prompt every usable replica scores the same for (a prefix all of
  them hold, no queue this router knows of) the same way
  (:meth:`~kvcore.policies.kv_cost.KvCostPolicy.best`);
- a hot prefix leaves a holder ``hot_prefix_gap`` requests ahead of the least busy
  replica, and any choice ``max_imbalance`` requests ahead goes to that replica
  (:meth:`KvScoringPolicy.rebalance`);
- before the first engine event (no confirmed residency anywhere) a prompt no replica
  holds goes to the workload's ``fallback``, or to the turn when the fallback is
  ``least_load`` (:attr:`KvScoringPolicy.places_cold_prompts`: at a cold start the loads
  are the previous phase's last reports).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterable, Sequence
from dataclasses import replace
from math import ceil, exp, inf, log, sqrt
from typing import ClassVar

from kvcore.policies.base import (
    Decision,
    ReplicaReason,
    ReplicaState,
    RouteContext,
    SpeculativeRecord,
    StateView,
)
from kvcore.policies.board import ReplicaBoard
from kvcore.policies.fallback import fallback_policy
from kvcore.policies.preselect import Candidates, Pool, candidates, decision, next_in_turn
from kvcore.policies.screening import (
    ALL_SATURATED,
    TIE,
    Saturation,
    best,
    hard_exclusion,
)
from kvcore.workload import KvAwareWorkload, KvCostWorkload

SPECULATION_TICK_S = 1 / 64
"""Speculative residency expires at the first tick at or after ``speculative_ttl_s``
(at most 16 ms late), so that a proxy's records of one tick share one expiry and the
index keeps one record per replica per tick (``kvcore.index.bitmask``)."""
_TICKS_PER_S = round(1 / SPECULATION_TICK_S)  # a power of 2: the rounded times are exact


def configured_rate(workload: object) -> float | None:
    """The prefill rate ``workload`` assumes for a replica that reports none (kv_cost's
    ``prefill_tokens_per_s``), ``None`` for a strategy without one. Not ``getattr`` with
    a default: on a pydantic model a missing attribute goes through its ``__getattr__``,
    which raises inside, and that cost kv_aware's proxy several microseconds a request."""
    return workload.prefill_tokens_per_s if isinstance(workload, KvCostWorkload) else None


def queue_load(replica: ReplicaState) -> float:
    """0-1: the replica's requests (running, waiting, sent since its last report) over
    its capacity. KV usage is left out: a busy engine serving long prompts keeps its KV
    cache nearly full of the requests it runs, so near-full usage is its normal state,
    not a reason to send a request away from the prefix it holds (when it truly cannot
    admit, requests wait: :func:`queue_saturation`)."""
    return min(1.0, replica.requests / max(replica.capacity, 1))


def queue_saturation(replica: ReplicaState, ctx: RouteContext) -> str | None:
    """Why ``replica`` is saturated for ``kv_aware``: :func:`request_saturation`, or KV
    usage at or over ``load_threshold`` while the engine reports requests waiting (it
    cannot admit them: its cache is full of running requests, not just of cached
    prefixes)."""
    workload = ctx.workload
    requests, threshold = replica.requests, workload.load_threshold
    if (
        requests < workload.max_inflight_per_replica
        and min(1.0, requests / max(replica.capacity, 1)) < threshold  # queue_load's
        and not (replica.waiting and replica.kv_usage >= threshold)
    ):
        return None  # the usual answer, without a call (asked per replica per request)
    why = request_saturation(replica, ctx)
    if why is None and replica.waiting and replica.kv_usage >= threshold:
        return (
            f"KV usage {replica.kv_usage:.3f} >= load_threshold {threshold} "
            f"with {replica.waiting} requests waiting"
        )
    return why


def request_saturation(replica: ReplicaState, ctx: RouteContext) -> str | None:
    """Why ``replica`` is saturated by its requests: ``max_inflight_per_replica`` of
    them, or a :func:`queue_load` at or over ``load_threshold``. ``kv_cost``'s test: it
    counts a full KV cache in time (the requests waiting for room are queued work), where
    a screen read from a load report up to a heartbeat old turned the prefixes' holders
    away whenever their engines ran full, which busy engines serving long prompts do."""
    workload = ctx.workload
    if replica.requests >= workload.max_inflight_per_replica:
        limit = workload.max_inflight_per_replica
        return f"{replica.requests} requests >= max_inflight_per_replica {limit}"
    load = queue_load(replica)
    if load >= workload.load_threshold:
        return f"queue load {load:.3f} >= load_threshold {workload.load_threshold}"
    return None


def queue_usable(replica: ReplicaState, ctx: RouteContext) -> bool:
    """Whether ``replica`` is neither hard-excluded nor saturated by
    :func:`queue_saturation`: the usual answers of both in one test, their min() and
    max() spelt out in :func:`request_usable` (the two calls cost as much as the rest of
    it); asked of a replica or two per request."""
    return request_usable(replica, ctx) and not (
        replica.waiting and replica.kv_usage >= ctx.workload.load_threshold
    )


def request_usable(replica: ReplicaState, ctx: RouteContext) -> bool:
    """:func:`queue_usable` for :func:`request_saturation` (``kv_cost``): neither
    hard-excluded nor saturated by its requests."""
    models = replica.models
    if (
        not replica.healthy
        or replica.draining
        or (models and ctx.model not in models)
        or replica.ordinal in ctx.exclude
    ):
        return False  # hard_exclusion's
    workload = ctx.workload
    requests, capacity = replica.requests, replica.capacity
    queued = requests / (capacity if capacity > 1 else 1)
    return (
        requests < workload.max_inflight_per_replica
        and (queued if queued < 1.0 else 1.0) < workload.load_threshold
    )


Usable = Callable[[ReplicaState, RouteContext], bool]


def queue_screened(
    ctx: RouteContext, fleet: Iterable[ReplicaState]
) -> tuple[list[ReplicaState], str]:
    """``screen_rows(ctx, fleet, queue_saturation)``'s usable replicas and note, without
    its reasons, each replica read once (a prompt without keys is screened so on every
    request; ``test_kv_shortcuts.py`` checks the two agree)."""
    usable: list[ReplicaState] = []
    saturated: list[ReplicaState] = []  # eligible, kept until one is not saturated
    for replica in fleet:
        if queue_usable(replica, ctx):
            usable.append(replica)
        elif not usable and hard_exclusion(replica, ctx) is None:
            saturated.append(replica)
    if usable or not saturated:
        return usable, ""
    return saturated, ALL_SATURATED


HOT_REPLICAS = 2.0  # a prefix is hot when its share of requests would fill this many replicas
HOT_HALF_LIFE_S = 10.0  # how fast a prefix's share of the requests is forgotten
# routed lately (decayed) before a share counts as it is (see believed_share)
HOT_MIN_REQUESTS = 16.0
HELD = -1  # in the runs a hot target is given: the hot prefix's length, in blocks
Runs = dict[int, int]  # replica ordinal -> its leading run of the prompt, in blocks
Scores = dict[int, float]  # replica ordinal -> its score, higher is better
HOT_KEYS = 4096  # prefixes remembered at most; the more requested half is kept beyond it


class PrefixHeat:
    """How much of a router's recent traffic each prefix draws: counts of requests that
    decay by half every ``half_life_s``, of every request with block keys
    (:meth:`routed`, :meth:`lately`) and of each prefix, named by the block key its
    holder's leading run ends at (:meth:`share`). Bounded: past ``keys`` prefixes, the
    less requested half is forgotten (amortised O(log keys) a request)."""

    __slots__ = ("_at", "_counts", "_keys", "_rate", "_total")

    def __init__(self, half_life_s: float = HOT_HALF_LIFE_S, keys: int = HOT_KEYS) -> None:
        self._rate = log(2) / half_life_s
        self._keys = keys
        self._total = 0.0
        self._at = 0.0
        self._counts: dict[int, tuple[float, float]] = {}  # key -> (count, as of when)

    def _decayed(self, count: float, at: float, now: float) -> float:
        return count * exp(-self._rate * max(now - at, 0.0))

    def routed(self, now: float) -> None:
        """One more request routed at ``now``."""
        self._total = self._decayed(self._total, self._at, now) + 1.0
        self._at = now

    def share(self, key: int, now: float) -> float:
        """Count a request drawn to the prefix ``key`` at ``now`` (not yet
        :meth:`routed`) and return the prefix's share of the recent requests, this one
        included."""
        counts = self._counts
        count, at = counts.get(key, (0.0, now))
        count = self._decayed(count, at, now) + 1.0
        counts[key] = (count, now)
        if len(counts) > self._keys:
            self._forget(now)
        return count / (self._decayed(self._total, self._at, now) + 1.0)

    def lately(self, now: float) -> float:
        """Requests routed lately (decayed), the one being routed at ``now`` included."""
        return self._decayed(self._total, self._at, now) + 1.0

    def _forget(self, now: float) -> None:
        ranked = sorted(
            self._counts.items(),
            key=lambda item: self._decayed(item[1][0], item[1][1], now),
            reverse=True,
        )
        self._counts = dict(ranked[: self._keys // 2])

    def __len__(self) -> int:
        return len(self._counts)


def fleet_per_request(state: StateView, fleet: Iterable[ReplicaState]) -> float:
    """How many of the fleet's requests each of this router's stands for: the requests
    the replicas hold (the engines count every router's) over this router's own in
    flight, each counting the one being routed; at least 1. One of four routers behind a
    round-robin balancer sees a quarter of the traffic, and judged by its own count alone
    a prefix every request shares was never hot there, so the first replicas to hold it
    kept every new chat while another replica of four took none."""
    held = sum(replica.requests for replica in fleet)
    return max((held + 1) / (state.inflight() + 1), 1.0)


def believed_share(share: float, requests: float) -> float:
    """A prefix's ``share`` of the ``requests`` routed lately (the fleet's:
    :func:`fleet_per_request`), as far as they can tell it from chance: as it is from
    ``HOT_MIN_REQUESTS`` on, before that less one standard error (``sqrt(share /
    requests)``). At a cold start a system prompt every request shares is then hot among
    8 replicas at its second request and among 4 at its fourth, where a prefix 5 of 12
    requests share is not hot among 8 (42%, less 19%). With no share believed before 16
    requests, the first 16 of bench sim's ``one_system_prompt`` queued behind the
    prompt's first holder (0.2-0.4 s each, where a miss on an idle replica takes 0.22 s):
    the default's mean TTFT 1.08-1.12x round-robin's."""
    if requests >= HOT_MIN_REQUESTS:
        return share
    return share - sqrt(share / requests)


def least_busy(
    ctx: RouteContext, fleet: Iterable[ReplicaState], usable: Usable = queue_usable
) -> ReplicaState | None:
    """The ``usable`` replica with the fewest requests, then the least load, then the
    lowest ordinal (one replica, whatever the order read)."""
    return _least_busy_of(ctx, fleet, usable)[0]


def _least_busy_of(
    ctx: RouteContext, fleet: Iterable[ReplicaState], usable: Usable
) -> tuple[ReplicaState | None, int]:
    """:func:`least_busy`, and how many of ``fleet`` are usable."""
    least: ReplicaState | None = None
    count = 0
    for replica in fleet:
        if usable(replica, ctx):
            count += 1
            if least is None or (least.requests, least.load, least.ordinal) > (
                replica.requests,
                replica.load,
                replica.ordinal,
            ):
                least = replica
    return least, count


class KvScoringPolicy:
    """Base of the level-3 strategies; subclasses define :meth:`score`."""

    name: ClassVar[str] = "kv"
    reads_keys = True
    places_cold_prompts = False  # True: without_hit, not the fallback, before residency data

    def __init__(self, workload: KvAwareWorkload | KvCostWorkload, rng: random.Random) -> None:
        self.workload = workload
        self._rng = rng
        self._fallback = fallback_policy(workload, rng)
        self._heat = PrefixHeat()
        # a hit below this share of the prompt counts as none (kv_aware's min_hit)
        self.min_hit = workload.min_hit if isinstance(workload, KvAwareWorkload) else 0.0
        self._turn = rng.randrange(1 << 16)  # proxies start at different replicas
        self._place: int | None = None  # this router's place behind a balancer (take_place)
        self._last: int | None = None  # the replica of the last new prompt's turn
        self._credit: dict[int, float] = {}  # turns a slower replica has been passed over
        self.places_cold_prompts = workload.fallback == "least_load"
        # which replicas are saturated (kv_cost: by their requests alone)
        self.saturated_why: Saturation = queue_saturation
        self.usable: Usable = queue_usable

    def scores(
        self, ctx: RouteContext, replicas: list[ReplicaState], runs: dict[int, int]
    ) -> dict[int, float]:
        """Ordinal -> score (higher is better); ``runs`` holds leading runs in blocks."""
        raise NotImplementedError

    def without_hit(
        self,
        ctx: RouteContext,
        state: StateView,
        found: Candidates,
        runs: dict[int, int],
    ) -> ReplicaState | None:
        """For a prompt no candidate holds a counted hit of: the next usable replica in
        turn (ordinal order) not sent much more than the others lately, in time where
        replicas prefill at different rates (a replica ten times slower is sent a tenth
        of the new prompts); ``None`` when some candidate has a hit."""
        blocks = len(ctx.block_keys)
        floor = max(self.min_hit * blocks, 1) if blocks else 1
        if found.holders and any(runs.get(r.ordinal, 0) >= floor for r in found.holders):
            return None
        # blocks this router sent each usable replica lately (every usable replica: a
        # prompt nobody holds costs a look at each), in one pass over the fleet
        now, placed_blocks, admits = ctx.now, state.placed_blocks, found.admits
        usable: list[ReplicaState] = []
        placed: list[float] = []
        configured = configured_rate(ctx.workload)
        slowest = 1.0  # the slowest usable replica's rate over the configured one
        for replica in found.fleet:
            if admits(replica):
                usable.append(replica)
                sent = float(placed_blocks(replica.ordinal, now=now))
                rate = replica.prefill_tokens_per_s
                if configured and rate:  # in time: a slower replica's blocks count more
                    sent *= configured / rate
                    slowest = min(slowest, rate / configured)
                placed.append(sent)
        if not usable:
            return None
        if slowest < 1.0:  # rates differ: each replica's share of them at its pace
            assert configured is not None
            paces = [min((r.prefill_tokens_per_s or configured) / configured, 1.0) for r in usable]
            return self._take_paced_turn(found.fleet, usable, placed, blocks, paces)
        return self._take_turn(found.fleet, usable, placed, blocks)

    def _take_paced_turn(
        self,
        fleet: Sequence[ReplicaState],
        usable: list[ReplicaState],
        placed: list[float],
        blocks: int,
        paces: list[float],
    ) -> ReplicaState | None:
        """:meth:`_take_turn` where replicas prefill at different rates (``paces``: each
        one's rate over the configured one, at most 1): a slower one is in the turn once
        its credit, raised by its pace's share of the fleet's with every new prompt,
        reaches 1, and taking a prompt costs it 1. A replica ten times slower than three
        others so takes one new prompt in 31, as round-robin gives each one in four."""
        total = sum(paces)
        credit = self._credit
        turn: list[ReplicaState] = []
        sent: list[float] = []
        slower: set[int] = set()
        for replica, pace, count in zip(usable, paces, placed, strict=True):
            if pace < 1.0:
                ordinal = replica.ordinal
                slower.add(ordinal)
                have = credit[ordinal] = min(credit.get(ordinal, 1.0) + pace / total, 1.0)
                if have < 1.0 - 1e-9:
                    continue
            turn.append(replica)
            sent.append(count)
        chosen = self._take_turn(fleet, turn or usable, sent if turn else placed, blocks)
        if chosen is not None and chosen.ordinal in slower:
            credit[chosen.ordinal] -= 1.0
        return chosen

    def _take_turn(
        self,
        fleet: Sequence[ReplicaState],
        usable: list[ReplicaState],
        placed: Sequence[float],
        blocks: int,
    ) -> ReplicaState | None:
        """The next of ``usable`` (of ``fleet``; ``placed``: the blocks sent each lately)
        in turn, skipping any sent more than ``blocks`` beyond the least-sent one."""
        turn = usable  # usually every one is within it: all sent as much (no min, no max)
        if placed.count(placed[0]) != len(placed):
            limit = min(placed) + blocks  # within one prompt of the least-sent one
            if max(placed) > limit:
                turn = [r for r, sent in zip(usable, placed, strict=True) if sent <= limit]
        return self._next_in_turn(fleet, turn)

    def _next_in_turn(
        self, fleet: Sequence[ReplicaState], turn: Sequence[ReplicaState]
    ) -> ReplicaState | None:
        """The next of ``turn`` (of ``fleet``, both in ordinal order) in this router's
        turn: after the replica its last turn chose, or from its place."""
        place = self._place
        start = self._turn + 1 if place is None else int(spread(place) * len(fleet))
        chosen = next_in_turn(fleet, turn, self._last, start)
        if chosen is not None:
            self._last = chosen.ordinal
        return chosen

    def best(
        self,
        ctx: RouteContext,
        fleet: Sequence[ReplicaState],
        usable: Sequence[ReplicaState],
        scores: Scores,
    ) -> ReplicaState:
        """The best-scored of ``usable`` (of ``fleet``): ties to the lower load, then at
        random (:func:`~kvcore.policies.screening.best`; ``kv_cost`` gives a tie of every
        usable replica to the turn: :meth:`~kvcore.policies.kv_cost.KvCostPolicy.best`)."""
        del ctx, fleet
        return best(usable, scores, self._rng)

    def take_place(self, index: int) -> None:
        """This router is ``index`` (0, 1, 2, ...) of several routers behind one balancer:
        its turn for new prompts starts :func:`spread` ``(index)`` of the way round the
        fleet, not at a random replica.

        Routers behind a round-robin balancer each take every Nth request, so while new
        prompts arrive (a cold start, a burst of new conversations) every router moves
        one replica on in its turn per N requests: their turns advance in step, and two
        that started at the same replica send every new prompt of the burst to the same
        replica at the same moment (each sees the other's only when its prefill's blocks
        are stored, a prefill later). With four routers and eight replicas, random starts
        coincide in 59% of fleets: bench sim's ``shared_prefix_4_routers`` at seed 1 queued
        pairs of 0.22 s prefills for its first 5 s (p99 0.515 s against llm-d's modelled
        0.459 s). Spread starts make the routers' turns one turn of the whole fleet."""
        self._place = index

    def rebalance(
        self, ctx: RouteContext, state: StateView, chosen: ReplicaState, runs: dict[int, int]
    ) -> tuple[ReplicaState, str]:
        """The replica that takes a request the scores gave to ``chosen``, and why if it
        is another: the hot prefix's move (:meth:`move_hot`), else the least busy usable
        replica (fewest requests, then load, then ordinal) when ``chosen`` has more than
        ``max_imbalance`` requests beyond it. The prompt is speculated on the replica that
        takes it, so the next requests see one more holder and the scores decide."""
        fleet = state.replicas()
        moved = self.move_hot(ctx, state, chosen, runs)
        limit = self.workload.max_imbalance
        if moved is not None or limit is None or chosen.requests <= limit:
            return moved or (chosen, "")
        least = least_busy(ctx, fleet, self.usable)
        if least is None or chosen.requests - least.requests <= limit:
            return chosen, ""
        return least, (
            f"imbalance: {chosen.replica_id} had {chosen.requests} requests, "
            f"{least.replica_id} {least.requests} (max_imbalance {limit})"
        )

    def move_hot(
        self, ctx: RouteContext, state: StateView, chosen: ReplicaState, runs: dict[int, int]
    ) -> tuple[ReplicaState, str] | None:
        """Where a hot prefix goes, and why (``None``: it stays): when the prefix
        ``chosen`` holds of this prompt is hot (:class:`PrefixHeat`: its share of this
        router's recent requests, as far as the fleet's requests lately can tell it,
        :func:`believed_share`, would fill at least ``HOT_REPLICAS`` replicas' fair
        share) and ``chosen`` has more than
        ``hot_prefix_gap`` requests beyond the least busy usable replica, to
        :meth:`hot_target`. A fair share is of the fleet's speed: a holder ten times
        slower than the others (its learned prefill rate) has a tenth of their share, so
        one prompt of three is hot there among three replicas (the replica holding it
        otherwise kept its requests while its hits were as quick as a miss on a faster
        one: 10-14% of them in real processes, its share of the speed 4.8%).

        A prefix's share counts every request that contains it as far as the residency
        map shows: the prefix ``chosen`` holds, and each shorter one another replica's
        run ends at (a chat's system prompt under each conversation's history). Counted
        only where a holder's run ended, a system prompt every request starts with drew
        just the conversations' first turns, a fifth of a five-turn chat's requests, and
        was never hot: the replicas that held it first kept every new conversation."""
        gap, fleet = self.workload.hot_prefix_gap, state.replicas()
        held = runs.get(chosen.ordinal, 0)
        if gap is None or not held:
            return None
        heat, keys, now = self._heat, ctx.block_keys, ctx.now
        for shorter in {n for n in runs.values() if 0 < n < held}:
            heat.share(keys[shorter - 1], now)  # a prefix this prompt shares with others
        hot = heat.share(keys[held - 1], now)
        rate = chosen.prefill_tokens_per_s  # no rate is faster than the configured one
        fastest: float = configured_rate(ctx.workload) or rate or 1.0
        if hot * len(fleet) * (fastest / rate if rate else 1.0) < HOT_REPLICAS:
            return None  # not hot even were every replica usable and as fast as can be
        if chosen.requests <= gap:
            return None  # no gap to close
        sure = believed_share(hot, self._heat.lately(now) * fleet_per_request(state, fleet))
        least, usable = _least_busy_of(ctx, fleet, self.usable)
        if least is None or chosen.requests - least.requests <= gap:
            return None
        shares = float(usable)  # fair shares in the fleet: one a usable replica, or
        if rate:  # where rates are known, as many as the fleet's speed is chosen's
            shares = sum(r.prefill_tokens_per_s or fastest for r in fleet if self.usable(r, ctx))
            shares /= rate
        if sure * shares < HOT_REPLICAS:
            return None
        target = self.hot_target(ctx, chosen, least, fleet, {**runs, HELD: held})
        if target is chosen:
            return None
        return target, (
            f"hot prefix ({hot:.0%} of recent requests): {chosen.replica_id} had "
            f"{chosen.requests} requests, {least.replica_id} {least.requests} "
            f"(hot_prefix_gap {gap})"
        )

    def hot_target(
        self,
        ctx: RouteContext,
        chosen: ReplicaState,
        least: ReplicaState,
        fleet: Sequence[ReplicaState],
        runs: Runs,
    ) -> ReplicaState:
        """The replica a hot prefix (of ``runs[HELD]`` blocks) that ``chosen`` holds
        moves to: ``least``, the least busy usable one."""
        del ctx, chosen, fleet, runs
        return least

    def nonholders(
        self, board: ReplicaBoard, pool: Pool, runs: dict[int, int], floor: float
    ) -> list[ReplicaState]:
        """The usable replicas holding none of the prompt that could win, none if the
        best scores below ``floor`` (:mod:`kvcore.policies.preselect`)."""
        raise NotImplementedError

    def nonholder_score(self, ctx: RouteContext, replica: ReplicaState) -> float:
        """The score of ``replica`` if it holds none of the prompt."""
        return self.scores(ctx, [replica], {})[replica.ordinal]

    def select(self, ctx: RouteContext, state: StateView) -> Decision:
        """The general path: look up the holders, then the strategy's new-prompt rule or
        the scores (a subclass may take a shortcut to the same decision)."""
        runs = state.leading_runs(ctx.block_keys, now=ctx.now) if ctx.block_keys else {}
        return self.decide(ctx, state, runs)

    def select_scored(self, ctx: RouteContext, state: StateView) -> Decision:
        """The general path by name, whatever a subclass's :meth:`select` does."""
        return KvScoringPolicy.select(self, ctx, state)

    def decide(self, ctx: RouteContext, state: StateView, runs: dict[int, int]) -> Decision:
        """:meth:`select_scored` once the leading runs are known."""
        cold = not runs and not state.has_residency()
        if cold and not self.places_cold_prompts:
            return self._fall_back(ctx, state)
        found = candidates(ctx, state, runs, self.saturated_why)
        note = ""
        chosen = self.without_hit(ctx, state, found, runs)
        scores = self.scores(ctx, found.holders, runs) if found.holders else {}
        usable = found.holders
        if chosen is None:
            usable = found.usable(self.nonholders, max(scores.values(), default=-inf) - 2 * TIE)
            if usable is not found.holders:
                scores = self.scores(ctx, usable, runs)
            chosen = self.best(ctx, found.fleet, usable, scores) if usable else None
            if chosen is not None:
                chosen, note = self.rebalance(ctx, state, chosen, runs)

        def rows(replicas: list[ReplicaState]) -> list[ReplicaReason]:
            table = scores if replicas is usable else self.scores(ctx, replicas, runs)
            return [self._row(ctx, r, runs.get(r.ordinal, 0), table) for r in replicas]

        if cold:
            note = cold_note(self.name, found.note)
        speculative = self._speculate(ctx, chosen)
        return decision(self.name, found, chosen, rows, note=note, speculative=speculative)

    def _row(
        self, ctx: RouteContext, replica: ReplicaState, held: int, scores: dict[int, float]
    ) -> ReplicaReason:
        hit = held / len(ctx.block_keys) if ctx.block_keys else 0.0
        return ReplicaReason(
            replica.ordinal,
            replica.replica_id,
            replica.load,
            None,
            held,
            hit,
            scores[replica.ordinal],
        )

    def _fall_back(self, ctx: RouteContext, state: StateView) -> Decision:
        decision = self._fallback.select(ctx, state)
        note = f"no residency data: fallback {decision.strategy}"
        if decision.note:
            note += f"; {decision.note}"
        speculative = self._speculate(ctx, decision.replica)
        return replace(decision, strategy=self.name, note=note, speculative=speculative)

    def _speculate(
        self, ctx: RouteContext, chosen: ReplicaState | None
    ) -> SpeculativeRecord | None:
        if ctx.block_keys and self.workload.hot_prefix_gap is not None:
            self._heat.routed(ctx.now)  # every decision with keys ends here, on any path
        ttl = self.workload.speculative_ttl_s
        if chosen is None or ttl <= 0 or not ctx.block_keys:
            return None
        expires_at = ceil((ctx.now + ttl) * _TICKS_PER_S) / _TICKS_PER_S
        return SpeculativeRecord(chosen.ordinal, tuple(ctx.block_keys), expires_at)


def spread(index: int) -> float:
    """Where router ``index`` starts its turn, as a share of the fleet: ``index``'s bits
    mirrored after the binary point (0, 1/2, 1/4, 3/4, 1/8, 5/8, ...), so that the
    first N routers' starts are spread evenly for every N, without a router knowing N
    (a fleet of 8 proxies whose first 2 or 4 take traffic is spread as well)."""
    share, weight = 0.0, 0.5
    while index:
        share += weight * (index & 1)
        index >>= 1
        weight /= 2
    return share


def cold_note(strategy: str, note: str) -> str:
    """A decision's note when a strategy placed a prompt without residency data."""
    cold = f"no residency data: fallback {strategy}'s new-prompt rule, not stale loads"
    return f"{cold}; {note}" if note else cold
