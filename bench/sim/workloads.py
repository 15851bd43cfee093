"""The request streams the simulator replays, as router block keys rather than text.

A simulated prompt is its list of full-block router keys plus its length in tokens: two
prompts share cache exactly for their leading run of equal keys, which is all that
routing and the engines' prefix caches can observe. Keys are built so that equal
prefixes give equal keys and anything after a divergence is unique (a key stands for
its whole prefix, as ``kvcore.keys`` chains do), without hashing token ids.

Workloads (parameters in ``/work/shared/reference/peers-and-workloads.md``):

- ``shared_prefix``: G groups x P prompts, a system prompt of S tokens per group, a
  question of Q tokens, O output tokens, prompts shuffled, Poisson arrivals;
- ``multi_turn``: chat sessions whose every turn re-sends the whole history (the
  previous answers included) plus a new message, the next turn sent a think time after
  the answer (closed loop); turn lengths from the ShareGPT file when given, else synthetic;
- ``rag``: a shared system prompt, k documents drawn with Zipf popularity from a corpus
  of D, then a unique question;
- ``mooncake``: a hash-id trace (``timestamp`` ms, ``input_length``, ``output_length``,
  ``hash_ids``: one id per 512-token block, chained) replayed with each id a fixed run of
  keys, time optionally compressed;
- ``no_reuse``: unique prompts, the negative control.
"""

from __future__ import annotations

import bisect
import itertools
import json
import math
import random
import struct
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import xxhash

_MASK = (1 << 64) - 1
_PACK = struct.Struct("<QQ")
NAN = float("nan")


@dataclass(slots=True, eq=False)
class Request:
    """One request of a stream; the simulator fills in the outcome fields."""

    rid: int
    arrival: float
    keys: Sequence[int]  # the prompt's full-block router keys
    prompt_tokens: int
    output_tokens: int
    session: str | None = None
    seq_keys: Sequence[int] = ()  # full-block keys of prompt + answer (multi-turn history)
    turn: int = 0
    client: int | None = None  # the client connection it came on (None: a request of its own)
    # outcome
    replica: int = -1
    cached_tokens: int = 0
    first_token_at: float = NAN
    finished_at: float = NAN

    @property
    def ttft(self) -> float:
        return self.first_token_at - self.arrival


class Workload(Protocol):
    """A request stream: open-loop arrivals, plus follow-ups for closed-loop sessions."""

    name: str

    def arrivals(self) -> Iterator[Request]:
        """Requests in arrival order."""
        ...

    def follow_up(self, done: Request, now: float) -> Request | None:
        """The request ``done``'s answer causes (the next chat turn), if any."""
        ...


class KeySpace:
    """Fresh, never-repeating keys for unique content."""

    def __init__(self, seed: int) -> None:
        self._next = itertools.count((seed & 0xFFFF) << 44 | 1 << 63)

    def fresh(self, n: int) -> list[int]:
        return [next(self._next) for _ in range(n)]


def chained(parent: int, tag: int, n: int) -> list[int]:
    """``n`` keys continuing the chain from ``parent`` with content ``tag``."""
    keys = []
    for i in range(n):
        parent = xxhash.xxh3_64_intdigest(_PACK.pack(parent, (tag << 20 | i) & _MASK))
        keys.append(parent)
    return keys


def poisson_times(rate: float, rng: random.Random) -> Iterator[float]:
    now = 0.0
    while True:
        yield now
        now += rng.expovariate(rate)


class _OpenLoop:
    """Base of the workloads without follow-ups."""

    name = "open"

    def follow_up(self, done: Request, now: float) -> Request | None:
        del done, now
        return None


@dataclass
class SharedPrefix(_OpenLoop):
    """G groups x P prompts sharing a per-group system prompt (SGLang's defaults)."""

    groups: int = 64
    prompts_per_group: int = 16
    system_tokens: int = 2048
    question_tokens: int = 128
    output_tokens: int = 256
    rate: float = 10.0
    block_size: int = 16
    seed: int = 1
    name: str = "shared_prefix"

    def arrivals(self) -> Iterator[Request]:
        rng = random.Random(self.seed)
        space = KeySpace(self.seed)
        bs = self.block_size
        prompt = self.system_tokens + self.question_tokens
        sys_full = self.system_tokens // bs
        prefixes = [chained(self.seed, g, sys_full) for g in range(self.groups)]
        order = [g for g in range(self.groups) for _ in range(self.prompts_per_group)]
        rng.shuffle(order)
        times = poisson_times(self.rate, rng)
        for rid, (group, at) in enumerate(zip(order, times, strict=False)):
            keys = prefixes[group] + space.fresh(prompt // bs - sys_full)
            yield Request(rid, at, keys, prompt, self.output_tokens)


@dataclass
class NoReuse(_OpenLoop):
    """Unique prompts: nothing to gain from a cache, nothing a router may lose."""

    requests: int = 2000
    prompt_tokens: int = 1024
    output_tokens: int = 128
    rate: float = 10.0
    block_size: int = 16
    seed: int = 1
    name: str = "no_reuse"

    def arrivals(self) -> Iterator[Request]:
        rng = random.Random(self.seed)
        space = KeySpace(self.seed)
        full = self.prompt_tokens // self.block_size
        times = poisson_times(self.rate, rng)
        for rid, at in zip(range(self.requests), times, strict=False):
            yield Request(rid, at, space.fresh(full), self.prompt_tokens, self.output_tokens)


class Zipf:
    """Ranks 0..n-1 drawn with probability proportional to 1 / (rank + 1) ** s."""

    def __init__(self, n: int, s: float) -> None:
        weights = [1.0 / (i + 1) ** s for i in range(n)]
        total = sum(weights)
        self._cdf = list(itertools.accumulate(w / total for w in weights))

    def draw(self, rng: random.Random) -> int:
        return min(bisect.bisect_left(self._cdf, rng.random()), len(self._cdf) - 1)


@dataclass
class Rag(_OpenLoop):
    """A system prompt, k Zipf-popular documents out of D, then a unique question."""

    requests: int = 2000
    documents: int = 1000
    docs_per_prompt: int = 3
    zipf_s: float = 1.1
    system_tokens: int = 512
    document_tokens: int = 1024
    question_tokens: int = 64
    output_tokens: int = 128
    rate: float = 10.0
    block_size: int = 16
    seed: int = 1
    name: str = "rag"

    def arrivals(self) -> Iterator[Request]:
        rng = random.Random(self.seed)
        space = KeySpace(self.seed)
        zipf = Zipf(self.documents, self.zipf_s)
        bs = self.block_size
        system = chained(self.seed, 1 << 40, self.system_tokens // bs)
        doc_blocks = self.document_tokens // bs
        prompt = self.system_tokens + self.docs_per_prompt * self.document_tokens
        prompt += self.question_tokens
        times = poisson_times(self.rate, rng)
        for rid, at in zip(range(self.requests), times, strict=False):
            keys = list(system)
            docs: list[int] = []
            while len(docs) < min(self.docs_per_prompt, self.documents):
                doc = zipf.draw(rng)
                if doc not in docs:
                    docs.append(doc)
                    keys += chained(keys[-1] if keys else self.seed, doc, doc_blocks)
            keys += space.fresh(prompt // bs - len(keys))
            yield Request(rid, at, keys, prompt, self.output_tokens)


@dataclass
class Conversation:
    """A chat session's turn lengths, in tokens: (user, assistant) pairs."""

    turns: list[tuple[int, int]]


def sharegpt_conversations(path: Path, *, chars_per_token: float = 4.0) -> list[Conversation]:
    """ShareGPT turn lengths (characters) as token-length turn pairs; human then gpt."""
    conversations = []
    with path.open() as f:
        for line in f:
            turns = json.loads(line).get("turns", [])
            pairs = []
            for (role_a, len_a), (role_b, len_b) in itertools.pairwise(turns):
                if role_a == "human" and role_b == "gpt":
                    user = max(1, round(len_a / chars_per_token))
                    pairs.append((user, max(1, round(len_b / chars_per_token))))
            if pairs:
                conversations.append(Conversation(pairs))
    return conversations


def synthetic_conversations(n: int, rng: random.Random) -> list[Conversation]:
    """Chats of ShareGPT's shape, drawn, not copied: heavy-tailed messages (median ~20
    tokens, one in ten over ~150 and one in a hundred over ~1,300: a pasted document or
    program), answers of ~300 tokens (one in ten over ~650), and a quarter of the chats
    one turn long, with a tail to a dozen turns and more (``1 + geometric``, mean 3.5).
    The tail is what matters to routing: a chat whose first message is long holds that
    much history on the replica that served it, and its next turns stick there."""

    def length(median: float, sigma: float, cap: int) -> int:
        return max(1, min(cap, round(rng.lognormvariate(math.log(median), sigma))))

    def turns() -> int:
        count = 1
        while rng.random() < 0.72 and count < 40:
            count += 1
        return count

    return [
        Conversation([(length(20.0, 1.7, 8000), length(300.0, 0.6, 4000)) for _ in range(turns())])
        for _ in range(n)
    ]


@dataclass
class _Session:
    sid: str
    conversation: Conversation
    history_tokens: int = 0
    keys: list[int] = field(default_factory=list)  # full blocks of the history so far


@dataclass
class MultiTurn:
    """Chat sessions, each turn the whole history plus a new message (closed loop)."""

    sessions: int = 400
    rate: float = 2.0  # session starts per second
    think_s: float = 5.0  # mean think time between an answer and the next turn
    max_output_tokens: int = 1024
    max_context_tokens: int = 16_000
    data: Path | None = None
    block_size: int = 16
    seed: int = 1
    system_tokens: int = 0  # a system prompt every session starts with (one app's chats)
    turns: int | None = None  # every session this many turns (cycling its own), not its own count
    name: str = "multi_turn"
    _rng: random.Random = field(init=False, repr=False)
    _space: KeySpace = field(init=False, repr=False)
    _live: dict[str, _Session] = field(init=False, repr=False)
    _rids: Iterator[int] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self._rng = random.Random(self.seed)
        self._space = KeySpace(self.seed)
        self._live = {}
        self._rids = itertools.count()

    def conversations(self) -> list[Conversation]:
        if self.data is not None and self.data.exists():
            pool = sharegpt_conversations(self.data)
        else:
            pool = synthetic_conversations(max(self.sessions, 1000), self._rng)
        return [self._rng.choice(pool) for _ in range(self.sessions)]

    def arrivals(self) -> Iterator[Request]:
        times = poisson_times(self.rate, self._rng)
        bs, system = self.block_size, self.system_tokens
        shared = chained(self.seed, 1 << 41, system // bs)
        for i, (conv, at) in enumerate(zip(self.conversations(), times, strict=False)):
            if self.turns is not None:
                conv = Conversation([conv.turns[t % len(conv.turns)] for t in range(self.turns)])
            session = _Session(f"s{i}", conv, system, list(shared))
            self._live[session.sid] = session
            request = self._turn(session, 0, at)
            if request is not None:
                yield request

    def follow_up(self, done: Request, now: float) -> Request | None:
        session = self._live.get(done.session or "")
        if session is None:
            return None
        session.keys = list(done.seq_keys)
        session.history_tokens = done.prompt_tokens + done.output_tokens
        think = self._rng.expovariate(1 / self.think_s) if self.think_s > 0 else 0.0
        return self._turn(session, done.turn + 1, now + think)

    def _turn(self, session: _Session, turn: int, at: float) -> Request | None:
        turns = session.conversation.turns
        if turn >= len(turns):
            self._live.pop(session.sid, None)
            return None
        user, answer = turns[turn]
        answer = min(answer, self.max_output_tokens)
        prompt = session.history_tokens + user
        if prompt + answer > self.max_context_tokens:
            self._live.pop(session.sid, None)
            return None
        bs = self.block_size
        keys = session.keys + self._space.fresh(prompt // bs - len(session.keys))
        seq_keys = keys + self._space.fresh((prompt + answer) // bs - len(keys))
        rid = next(self._rids)
        return Request(rid, at, keys, prompt, answer, session.sid, seq_keys, turn)


@dataclass
class MooncakeTrace(_OpenLoop):
    """A hash-id trace: each id a fixed run of keys, the last block cut to the length."""

    path: Path = Path("mooncake_conversation_trace.jsonl")
    speedup: float = 1.0  # arrival times divided by this
    limit: int | None = None
    hash_block_tokens: int = 512
    block_size: int = 16
    name: str = "mooncake"

    def arrivals(self) -> Iterator[Request]:
        per_id = self.hash_block_tokens // self.block_size
        shift = max(per_id - 1, 1).bit_length()
        with self.path.open() as f:
            for rid, line in enumerate(f):
                if self.limit is not None and rid >= self.limit:
                    return
                row = json.loads(line)
                prompt = int(row["input_length"])
                ids = row["hash_ids"]
                full = min(prompt // self.block_size, len(ids) * per_id)
                keys = [1 << 62 | ids[i // per_id] << shift | i % per_id for i in range(full)]
                at = float(row["timestamp"]) / 1000.0 / self.speedup
                yield Request(rid, at, keys, prompt, max(1, int(row["output_length"])))


def oracle_hit_rate(requests: Sequence[Request], block_size: int) -> float:
    """The hit rate of one unlimited cache that sees every request in arrival order:
    the share of prompt tokens in a prefix seen before (capped, as in the engines, at
    ``prompt_tokens - 1``). No router can beat it."""
    seen: set[int] = set()
    hit = total = 0
    for req in sorted(requests, key=lambda r: r.arrival):
        cap = (req.prompt_tokens - 1) // block_size
        run = 0
        for key in req.keys[:cap]:
            if key not in seen:
                break
            run += 1
        hit += run * block_size
        total += req.prompt_tokens
        seen.update(req.seq_keys or req.keys)
    return hit / total if total else 0.0


def first_sends(clients: int, first: Callable[[int, float], Request | None]) -> Iterator[Request]:
    """Each of ``clients`` closed-loop clients' first request, all sent at time 0."""
    for client in range(clients):
        request = first(client, 0.0)
        if request is not None:
            yield request


@dataclass
class ChatClients:
    """``bench.e2e``'s chat workload (:class:`bench.e2e.chat.ChatWorkload`) as its clients
    send it: ``clients`` clients, each on one keep-alive connection, take conversations
    from one queue; a conversation's next turn is sent the moment its last answered, and
    a client starts its next conversation the moment its last ends. Every conversation
    opens with one shared system prompt and a long first message of its own, then asks
    short follow-ups, each prompt the whole history. Requests carry their client, so a
    balancer in front of several routers keeps each client on one router
    (:class:`~bench.sim.simulator.Simulation`), as an L4 balancer keeps a connection."""

    conversations: int = 48
    turns: int = 5
    clients: int = 8
    system_tokens: int = 208  # the e2e's ~200-token system prompt as the template makes it
    opening_tokens: int = 608
    followup_tokens: int = 72  # the new question and the fixed reply before it
    output_tokens: int = 8
    pause_s: float = 0.0  # mean (exponential) between an answer and the client's next send
    block_size: int = 16
    seed: int = 1
    name: str = "chat_clients"
    _rng: random.Random = field(init=False, repr=False)
    _space: KeySpace = field(init=False, repr=False)
    _queue: Iterator[int] = field(init=False, repr=False)
    _rids: Iterator[int] = field(init=False, repr=False)
    _system: list[int] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self._rng = random.Random(self.seed)
        self._space = KeySpace(self.seed)
        self._queue = iter(range(self.conversations))
        self._rids = itertools.count()
        self._system = chained(self.seed, 1 << 42, self.system_tokens // self.block_size)

    def arrivals(self) -> Iterator[Request]:
        return first_sends(self.clients, self._open)

    def follow_up(self, done: Request, now: float) -> Request | None:
        assert done.client is not None and done.session is not None
        if self.pause_s > 0:
            now += self._rng.expovariate(1 / self.pause_s)
        if done.turn + 1 >= self.turns:
            return self._open(done.client, now)
        prompt = done.prompt_tokens + done.output_tokens + self.followup_tokens
        return self._request(done.client, done.session, done.turn + 1, now, done.seq_keys, prompt)

    def _open(self, client: int, at: float) -> Request | None:
        conversation = next(self._queue, None)
        if conversation is None:
            return None
        prompt = self.system_tokens + self.opening_tokens
        return self._request(client, f"c{conversation}", 0, at, self._system, prompt)

    def _request(
        self, client: int, session: str, turn: int, at: float, history: Sequence[int], prompt: int
    ) -> Request:
        bs = self.block_size
        keys = list(history) + self._space.fresh(prompt // bs - len(history))
        seq_keys = keys + self._space.fresh((prompt + self.output_tokens) // bs - len(keys))
        rid = next(self._rids)
        return Request(rid, at, keys, prompt, self.output_tokens, session, seq_keys, turn, client)


@dataclass
class PrefixClients:
    """``bench.e2e``'s shared-prefix workload (:class:`kvroute.demo.DemoWorkload`) as its
    clients send it: ``groups`` x ``prompts_per_group`` prompts (a group's system prompt
    and a question of its own), shuffled into one list that ``clients`` clients, each on
    one keep-alive connection (and so on one router behind a balancer), take from, each
    sending its next prompt the moment its last one's answer ends."""

    groups: int = 16
    prompts_per_group: int = 16
    clients: int = 8
    system_tokens: int = 2000
    question_tokens: int = 80
    output_tokens: int = 8
    block_size: int = 16
    seed: int = 1
    name: str = "prefix_clients"
    _queue: Iterator[Request] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        stream = SharedPrefix(
            groups=self.groups,
            prompts_per_group=self.prompts_per_group,
            system_tokens=self.system_tokens,
            question_tokens=self.question_tokens,
            output_tokens=self.output_tokens,
            block_size=self.block_size,
            seed=self.seed,
        )
        self._queue = stream.arrivals()  # its order; the clients set the times

    def arrivals(self) -> Iterator[Request]:
        return first_sends(self.clients, self._next)

    def follow_up(self, done: Request, now: float) -> Request | None:
        assert done.client is not None
        return self._next(done.client, now)

    def _next(self, client: int, at: float) -> Request | None:
        request = next(self._queue, None)
        if request is None:
            return None
        request.arrival, request.client = at, client
        return request
