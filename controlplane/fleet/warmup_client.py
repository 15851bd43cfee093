"""The warm-up's one request: a prefix as a ``max_tokens`` 1 completion by token ids.

vLLM's and SGLang's OpenAI servers (and enginesim) take ``prompt`` as a list of token
ids, so the engine prefills exactly the tokens the proxies saw and caches their blocks
as it would for a client's request. An answer of 4xx is a refusal (the warm-up ends);
a connection failure, a timeout or a 5xx is a failure (counted, not retried).
"""

from __future__ import annotations

from typing import Any

import aiohttp

from controlplane.fleet.warmup import WarmupFailed, WarmupRefused


class EngineCompletions:
    """Sends warm-up completions over one keep-alive session."""

    def __init__(self, timeout_s: float = 60.0) -> None:
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._session: aiohttp.ClientSession | None = None

    async def send(self, base_url: str, model: str, token_ids: list[int]) -> None:
        await self.complete(base_url, one_token(model, token_ids))

    async def complete(self, base_url: str, body: dict[str, Any]) -> bytes:
        """POST ``body`` to the engine's ``/v1/completions``; its answer's body, or
        :class:`WarmupRefused` (4xx) / :class:`WarmupFailed` (anything else)."""
        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=self._timeout)
        url = base_url.rstrip("/") + "/v1/completions"
        try:
            async with self._session.post(url, json=body) as response:
                answer = await response.read()
                status = response.status
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise WarmupFailed(f"{url}: {type(exc).__name__}") from None
        if 400 <= status < 500:
            raise WarmupRefused(f"{url} answered {status}")
        if status >= 500:
            raise WarmupFailed(f"{url} answered {status}")
        return answer

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None


def one_token(model: str, token_ids: list[int]) -> dict[str, Any]:
    """A ``max_tokens`` 1 completion of ``token_ids``, greedy."""
    return {"model": model, "prompt": token_ids, "max_tokens": 1, "temperature": 0}
