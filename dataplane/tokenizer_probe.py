"""Checks that this proxy tokenizes each model exactly as the engines serving it do.

A cache-aware router whose tokenizer differs from the engine's (another model's files, a
different version, a missing special token) computes block keys that never match, and
routes on noise without any error. So, at start-up and whenever a replica or model
appears, the probe tokenizes one probe prompt with the proxy's tokenizer for the model
(the registry entry's ``tokenizer``: ``builtin`` or a folder; the proxy's ``--tokenizer``
when the registry does not name the model) and asks each replica's engine to tokenize
the same prompt (``POST /tokenize``, ``{"model", "prompt", "add_special_tokens"}`` ->
``{"tokens": [...]}``, the shape of vLLM and of SGLang's ``/v1/tokenize``, tried second).
Different ids mark the model ``tokenizer_mismatch``: logged, reported to the control
plane (:meth:`TokenizerProbe.model_health`) and shown by ``/readyz``
(:meth:`TokenizerProbe.mismatches`). An engine that cannot be asked is retried later and
never counts as a mismatch.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

import aiohttp
import msgspec

from dataplane.endpoints import Endpoint
from dataplane.fleet.state import FleetState
from kvcore.pb import routing_pb2
from kvcore.tokenize import Tokenizer, TokenizerError, load_tokenizer
from kvruntime.tasks import BackgroundTasks

log = logging.getLogger("dataplane.probe")

# Words, digits, punctuation, repeated spaces, a newline, accents, CJK and an emoji:
# where tokenizers (and their versions) most often disagree.
PROBE_PROMPT = (
    "kvroute tokenizer probe: The quick brown fox jumps over the lazy dog, 1234567890 times!"
    "\n  Ünïcödé café naïve — 東京 你好 🙂 <tag attr='x'>{\"k\": [1, 2.5]}</tag>\t end."
)
TOKENIZE_PATHS = {"sglang": ("/v1/tokenize", "/tokenize"), "": ("/tokenize", "/v1/tokenize")}
Verdict = Literal["match", "mismatch", "unknown"]


@dataclass(frozen=True, slots=True)
class ProbeResult:
    """One replica's answer for one model."""

    model: str
    replica_id: str
    tokenizer: str  # the proxy's tokenizer spec it was compared with
    verdict: Verdict
    detail: str = ""


class EngineUnavailable(Exception):
    """The engine could not tokenize the probe (down, no such route, a bad answer)."""


class TokenizerProbe:
    """Probes every (replica, model) pair once per tokenizer spec; see the module
    docstring. ``load`` builds a tokenizer from a spec (pass the proxy's cache)."""

    def __init__(
        self,
        state: FleetState,
        default_tokenizer: str,
        *,
        load: Callable[[str], Tokenizer] = load_tokenizer,
        retry_s: float = 30.0,
        timeout_s: float = 5.0,
        ssl_context: ssl.SSLContext | None = None,
    ) -> None:
        self.state = state
        self._ssl = ssl_context  # for replicas named by https:// URLs
        self._default_tokenizer = default_tokenizer
        self._load = load
        self._retry_s = retry_s
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._tokenizers: dict[str, Tokenizer | str] = {}  # spec -> tokenizer or error
        self.results: dict[tuple[str, str], ProbeResult] = {}  # (replica id, model)
        self._wake = asyncio.Event()
        self._probed = asyncio.Condition()  # notified after every round
        self._session: aiohttp.ClientSession | None = None
        self._tasks = BackgroundTasks()
        state.subscribe(self._wake.set)

    async def start(self) -> None:
        if not self._tasks.running:
            self._tasks.spawn(self._run(), name="tokenizer-probe")

    async def aclose(self) -> None:
        await self._tasks.aclose()
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def wait_until(self, check: Callable[[TokenizerProbe], bool]) -> None:
        """Wait until ``check(probe)`` holds after a round (wrap in ``asyncio.timeout``)."""
        async with self._probed:
            await self._probed.wait_for(lambda: check(self))

    # -- what the proxy reads ---------------------------------------------------------

    def mismatches(self) -> dict[str, str]:
        """Model -> why it is flagged ``tokenizer_mismatch`` (for /readyz and metrics)."""
        flagged: dict[str, list[str]] = {}
        for result in self.results.values():
            if result.verdict == "mismatch":
                flagged.setdefault(result.model, []).append(result.detail)
        return {model: "; ".join(sorted(details)) for model, details in sorted(flagged.items())}

    def model_health(self) -> list[routing_pb2.ModelHealth]:
        """Every probed model's health, for ``ProxyReport.models``."""
        mismatches = self.mismatches()
        models = sorted({r.model for r in self.results.values() if r.verdict != "unknown"})
        return [
            routing_pb2.ModelHealth(
                model=model,
                tokenizer_mismatch=model in mismatches,
                detail=mismatches.get(model, ""),
            )
            for model in models
        ]

    # -- probing --------------------------------------------------------------------------

    async def _run(self) -> None:
        while True:
            self._wake.clear()
            await self.probe_pending()
            retry = self._retry_s if self._has_unknown() else None
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(retry):
                    await self._wake.wait()  # a replica or model appeared, or retry time

    async def probe_pending(self) -> list[ProbeResult]:
        """Probe every pair not yet probed with its current tokenizer spec, and pairs
        whose engine could not be asked before; forget replicas that left."""
        if self._session is None:
            connector = aiohttp.TCPConnector(ssl=self._ssl or True)
            self._session = aiohttp.ClientSession(timeout=self._timeout, connector=connector)
        targets = self._targets()
        for key in set(self.results) - set(targets):
            del self.results[key]
        probed = []
        for key, (endpoint, spec) in targets.items():
            known = self.results.get(key)
            if known is None or known.tokenizer != spec or known.verdict == "unknown":
                result = await self._probe(endpoint, key[1], spec)
                self._record(key, result)
                probed.append(result)
        async with self._probed:
            self._probed.notify_all()
        return probed

    def _targets(self) -> dict[tuple[str, str], tuple[Endpoint, str]]:
        targets = {}
        for endpoint in self.state.replicas.endpoints():
            if not endpoint.model:  # a static replica whose models are not known yet
                continue
            entry = self.state.catalogue.model_entry(endpoint.model)
            spec = entry.tokenizer if entry is not None and entry.tokenizer else None
            targets[(endpoint.replica_id, endpoint.model)] = (
                endpoint,
                spec or self._default_tokenizer,
            )
        return targets

    def _has_unknown(self) -> bool:
        return any(result.verdict == "unknown" for result in self.results.values())

    def _record(self, key: tuple[str, str], result: ProbeResult) -> None:
        before = self.results.get(key)
        self.results[key] = result
        if result.verdict == "mismatch" and (before is None or before.verdict != "mismatch"):
            log.warning("tokenizer_mismatch for model %s: %s", result.model, result.detail)
        elif result.verdict == "unknown":
            log.info("tokenizer probe deferred: %s", result.detail)

    async def _probe(self, endpoint: Endpoint, model: str, spec: str) -> ProbeResult:
        try:
            tokenizer = await self._tokenizer(spec)
            expected = await asyncio.to_thread(
                tokenizer.encode, PROBE_PROMPT, add_special_tokens=True
            )
        except TokenizerError as exc:
            detail = f"the proxy cannot load tokenizer {spec!r}: {exc}"
            return ProbeResult(model, endpoint.replica_id, spec, "mismatch", detail)
        try:
            engine = await self._engine_tokens(endpoint, model)
        except EngineUnavailable as exc:
            return ProbeResult(model, endpoint.replica_id, spec, "unknown", str(exc))
        if engine == expected:
            return ProbeResult(model, endpoint.replica_id, spec, "match")
        detail = describe_difference(endpoint.replica_id, spec, expected, engine)
        return ProbeResult(model, endpoint.replica_id, spec, "mismatch", detail)

    async def _tokenizer(self, spec: str) -> Tokenizer:
        cached = self._tokenizers.get(spec)
        if cached is None:
            try:
                cached = await asyncio.to_thread(self._load, spec)
            except TokenizerError as exc:
                cached = str(exc)
            self._tokenizers[spec] = cached
        if isinstance(cached, str):
            raise TokenizerError(cached)
        return cached

    async def _engine_tokens(self, endpoint: Endpoint, model: str) -> list[int]:
        paths = TOKENIZE_PATHS.get(endpoint.engine_kind, TOKENIZE_PATHS[""])
        body = msgspec.json.encode(
            {"model": model, "prompt": PROBE_PROMPT, "add_special_tokens": True}
        )
        problem = ""
        for path in paths:
            url = endpoint.base_url + path
            try:
                return await self._post_tokenize(url, body)
            except EngineUnavailable as exc:
                problem = str(exc)
        raise EngineUnavailable(f"replica {endpoint.replica_id}: {problem}")

    async def _post_tokenize(self, url: str, body: bytes) -> list[int]:
        assert self._session is not None  # opened by probe_pending
        headers = {"content-type": "application/json"}
        try:
            async with self._session.post(url, data=body, headers=headers) as response:
                payload = await response.read()
                status = response.status
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise EngineUnavailable(f"POST {url}: {exc or type(exc).__name__}") from None
        if status != 200:
            raise EngineUnavailable(f"POST {url}: HTTP {status}")
        return _token_ids(url, payload)


def _token_ids(url: str, payload: bytes) -> list[int]:
    try:
        tokens = msgspec.json.decode(payload).get("tokens")
    except (msgspec.DecodeError, AttributeError):
        raise EngineUnavailable(f"POST {url}: the answer is not a JSON object") from None
    if not isinstance(tokens, list) or not all(isinstance(t, int) for t in tokens):
        raise EngineUnavailable(f"POST {url}: no list of token ids in 'tokens'")
    return tokens


def describe_difference(
    replica_id: str, spec: str, proxy: Sequence[int], engine: Sequence[int]
) -> str:
    """One line saying where the proxy's and the engine's ids part."""
    first = next(
        (i for i, (a, b) in enumerate(zip(proxy, engine, strict=False)) if a != b),
        min(len(proxy), len(engine)),
    )
    return (
        f"replica {replica_id}: the engine's /tokenize gives {len(engine)} ids, the proxy's "
        f"tokenizer {spec!r} {len(proxy)}; first difference at position {first} "
        f"(engine {_id_at(engine, first)}, proxy {_id_at(proxy, first)})"
    )


def _id_at(ids: Sequence[int], position: int) -> int | str:
    return ids[position] if position < len(ids) else "end"
