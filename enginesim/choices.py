"""One OpenAI request, many engine requests: a batch of prompts and ``n`` samples each.

vLLM's OpenAI server turns a completion whose ``prompt`` is a list of prompts into one
engine request per prompt (``{id}-{i}``), and its v1 engine fans a request with ``n > 1``
out into ``n`` child requests (``{j}_{id}``, ``ParentRequest``), each scheduled on its
own: the prompt's blocks are looked up once per child and, cached at allocation, hit
from the second child on. ``Choices`` holds those engine requests in choice order
(prompt ``i``, sample ``j`` is choice ``i * n + j``), waits for them together and says
what vLLM's ``usage`` says of them:

- ``prompt_tokens`` counts each prompt once (not ``n`` times), summed over the batch;
  ``completion_tokens`` sums every choice's tokens;
- ``prompt_tokens_details.cached_tokens`` is *one* engine request's count, not a sum:
  the last request's when the answer is whole (``request_output_to_completion_response``
  takes the last prompt's ``RequestOutput``, and with ``n > 1`` that output carries the
  count of the child whose end completed it, the last sample), the first output's when
  streaming (``num_cached_tokens`` of the first ``RequestOutput`` the stream sees).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from enginesim import protocol as p
from enginesim.engine import RequestHandle
from enginesim.errors import EngineRestarted

DISCONNECTED = "client disconnected"


Delta = tuple[int, list[str], bool]
"""New output of one choice: its index, one text piece per token, whether it ended."""


@dataclass(eq=False, slots=True)  # slots: fewer objects for the collector per request
class Choices:
    """The engine requests of one OpenAI request (``request_id``), in choice order."""

    request_id: str
    handles: list[RequestHandle]
    n: int = 1
    answer_ids: list[str] | None = None  # SGLang mode: the ids a client named them by
    reports_cached: bool = True  # false: usage tells no cached tokens (``--no-cache-report``)
    first_cached: int | None = field(default=None, init=False)

    @property
    def done(self) -> bool:
        return all(handle.done for handle in self.handles)

    async def wait(self) -> None:
        """Until any choice has something new (the handles share one event)."""
        progress = self.handles[0].progress
        await progress.wait()
        progress.clear()
        self._raise_failure()

    def _raise_failure(self) -> None:
        for handle in self.handles:
            if handle.error is not None:
                raise EngineRestarted(handle.error)

    async def until_done(self) -> None:
        try:
            while not self.done:
                await self.wait()
            self._raise_failure()
        except EngineRestarted as exc:
            raise p.InjectedFailure(f"The request failed: {exc}.") from exc

    def usage(self, cached: int) -> dict[str, Any]:
        prompts = completions = 0
        for k, handle in enumerate(self.handles):
            completions += len(handle.req.output)
            if k % self.n == 0:  # each prompt once
                prompts += len(handle.req.prompt)
        return p.usage(prompts, completions, self.reported(cached))

    def reported(self, cached: int) -> int:
        """The cached tokens a usage tells: ``cached``, or 0 (no details) when the
        engine reports none."""
        return cached if self.reports_cached else 0

    def final_usage(self) -> dict[str, Any]:
        """``usage`` of a whole answer: the last engine request's cached tokens."""
        return self.usage(self.handles[-1].req.num_cached_tokens)

    def stream_usage(self) -> dict[str, Any]:
        """``usage`` of a stream: the first output's cached tokens."""
        first = self.first_cached
        return self.usage(self.handles[0].req.num_cached_tokens if first is None else first)

    def texts(self, text_of: Callable[[list[int]], str]) -> list[str]:
        return [text_of(h.req.output) for h in self.handles]

    async def deltas(self, text_of: Callable[[list[int]], str]) -> AsyncIterator[Delta | None]:
        """Each choice's new tokens as the engine delivers them, in choice order within a
        step; one ``None`` if the engine failed the requests (not if the client left)."""
        handles = self.handles
        progress = handles[0].progress
        sent = [0] * len(handles)
        ended = [False] * len(handles)  # those that asked for no tokens, once ended
        unfinished = len(handles)
        while unfinished:
            await progress.wait()
            progress.clear()
            for k, handle in enumerate(handles):
                if handle.error is not None:
                    if handle.error != DISCONNECTED:
                        yield None
                    return
                req = handle.req
                new = req.output[sent[k] :]
                if not new:
                    if req.max_tokens or ended[k] or not handle.done:
                        continue
                    ended[k] = True  # asked for no tokens (SGLang serves that): ended, empty
                if self.first_cached is None:  # the first output seen, lowest choice first
                    self.first_cached = req.num_cached_tokens
                sent[k] += len(new)
                last = sent[k] >= req.max_tokens
                unfinished -= last
                yield k, [text_of([t]) for t in new], last
