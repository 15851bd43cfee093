"""A multi-turn chat workload: each conversation's next turn carries its whole history.

Every conversation opens with a system prompt all of them share and a long first
message of its own (a pasted document), then asks short follow-ups; turn ``t + 1`` is
sent only once turn ``t`` has answered, and its prompt is turn ``t``'s plus a reply and
the new question. A router that keeps a conversation on the replica that served its
last turn finds the history cached there; one that loses track recomputes it.

The reply in the history is a fixed text, not what the engine answered: every router is
sent byte-for-byte the same prompts, and a hit is what the engine cached of the turns
before (its own output tokens are not part of it).
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import aiohttp

from kvroute.demo import PhaseResult, send_one, words

REPLY = "Noted; here is what I make of it."


@dataclass(frozen=True)
class ChatWorkload:
    """48 conversations of 5 turns over 8 clients, as issue #39's many-proxies test."""

    conversations: int = 48
    turns: int = 5
    system_tokens: int = 200  # shared by every conversation
    opening_tokens: int = 600  # each conversation's first message, its own
    followup_tokens: int = 60
    max_tokens: int = 8
    concurrency: int = 8  # conversations under way at once
    seed: int = 20261206

    def conversation_turns(self, model: str) -> list[list[dict[str, Any]]]:
        """Each conversation's request bodies, turn by turn."""
        rng = random.Random(self.seed)
        system = "You are a careful assistant. " + words(rng, self.system_tokens)
        found = []
        for conversation in range(self.conversations):
            messages = [{"role": "system", "content": system}]
            bodies = []
            for turn in range(self.turns):
                size = self.opening_tokens if turn == 0 else self.followup_tokens
                ask = f"Conversation {conversation}, turn {turn}: " + words(rng, size)
                messages = [*messages, {"role": "user", "content": ask}]
                bodies.append(_body(model, messages, self.max_tokens))
                messages = [*messages, {"role": "assistant", "content": REPLY}]
            found.append(bodies)
        return found

    def request_count(self) -> int:
        return self.conversations * self.turns

    def request_groups(self) -> list[int]:
        """The conversation of each request, by its index (``conversation * turns + turn``)."""
        return [c for c in range(self.conversations) for _ in range(self.turns)]


def _body(model: str, messages: list[dict[str, str]], max_tokens: int) -> dict[str, Any]:
    return {
        "model": model,
        "messages": messages,
        "max_tokens": max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


async def run_conversations(
    session: aiohttp.ClientSession,
    url: str,
    workload: ChatWorkload,
    model: str,
    result: PhaseResult,
    on_done: Callable[[], None],
) -> None:
    """Every conversation, ``workload.concurrency`` at a time, each turn after the last."""
    queue: asyncio.Queue[int] = asyncio.Queue()
    conversations = workload.conversation_turns(model)
    for index in range(len(conversations)):
        queue.put_nowait(index)

    async def client() -> None:
        while not queue.empty():
            conversation = queue.get_nowait()
            for turn, body in enumerate(conversations[conversation]):
                await send_one(session, url, body, result, conversation * workload.turns + turn)
                on_done()

    await asyncio.gather(*(client() for _ in range(workload.concurrency)))
