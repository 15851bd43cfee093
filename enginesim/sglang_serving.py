"""The inference routes in SGLang mode (``--event-format sglang``): SGLang's checks in its
order, its engine requests for ``n`` and batches, and its answers (``sglang_api.py``).

The HTTP app (``http.py``) decodes the body and hands it here; prompts are tokenized by
the app's own helpers, so both modes read prompts and chat templates alike. What SGLang
does, and where that was read, is in ``sglang_api``'s docstring, and for the ids a
client names its requests by, in ``sglang_rids``'s. SGLang's native ``/generate``
(``sglang_generate``) runs its engine requests through :meth:`SglangServing.start` too.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, Protocol

from enginesim import protocol as p
from enginesim import sglang_api as sg
from enginesim import sglang_rids as sr
from enginesim.choices import Choices
from enginesim.engine import Engine
from enginesim.errors import RequestRejected
from enginesim.pd import Bootstrap, KvLoadFailed
from enginesim.radix_cache import SglangRadixCache
from enginesim.request import LoadedKV, LoraTag, SimRequest
from enginesim.settings import SimSettings
from enginesim.tokens import PromptTokenizer

Answer = dict[str, Any] | tuple[AsyncIterator[bytes], Choices]
"""A whole answer's body, or a stream's chunks and the requests they come from."""


@dataclass(frozen=True, slots=True)
class Sampling:
    """What SGLang's engine requests of one request take from its body, whichever route
    it came by (an OpenAI route's body, or ``/generate``'s ``sampling_params``)."""

    max_tokens: int | None  # ``max_new_tokens``; None: bounded by the context only
    temperature: float | None
    stream: bool
    salt: str | None  # ``cache_salt``; SGLang takes "" for none
    model: str | None = None  # an OpenAI request's model name, which may name a LoRA adapter
    bootstrap: Bootstrap | None = None  # P/D: where the prefill's KV is read (``pd.py``)
    lora_path: str | None = None  # ``/generate``'s adapter name (a model name's wins)

    @classmethod
    def of(cls, body: p._Sampling) -> Sampling:
        salt = body.cache_salt or None
        bootstrap = Bootstrap.of(body.bootstrap_host, body.bootstrap_port, body.bootstrap_room)
        return cls(body.max_tokens, body.temperature, body.stream, salt, body.model, bootstrap)


class ServingApp(Protocol):
    """What SGLang's routes take from the HTTP app (``http.SimApp``), which owns them:
    its settings, engine and tokenizer, and its prompt readers, so that both modes read
    prompts and chat templates alike."""

    settings: SimSettings
    engine: Engine
    tokenizer: PromptTokenizer

    async def prompt_ids(self, given: list[str | list[int]]) -> list[list[int]]: ...

    async def chat_prompt_ids(
        self, messages: list[dict[str, Any]], tools: Any, add_generation_prompt: bool
    ) -> list[int]: ...

    def sglang_adapter(self, name: str) -> LoraTag: ...


class SglangServing:
    def __init__(self, app: ServingApp) -> None:
        self.app = app
        self.rids = sr.RidsInFlight()

    async def completions(self, body: p.CompletionRequest | p.CompletionBatchRequest) -> Answer:
        usage = sg.stream_usage(body)  # fields of the body: validated first
        given_rid = sr.body_rid(body.rid)
        sg.check_prompt(body.prompt)
        given = p.completion_prompts(body)
        prompts = await self.app.prompt_ids(given)
        if body.max_tokens is None:  # SGLang's completion request: ``max_tokens: int = 16``
            body.max_tokens = p.DEFAULT_MAX_TOKENS
        batch, ids = isinstance(body, p.CompletionBatchRequest), isinstance(given[0], list)
        n = body.n
        rids = sr.plan(given_rid, len(prompts), n, batch=batch)
        ask = Sampling.of(body)
        choices = await self.start(rids, prompts, ask, n, batch=batch, ids_given=ids)
        model, text_of = _model(body), self.app.tokenizer.text_of
        if body.stream:
            return sg.completion_chunks(choices, n, model, text_of, usage), choices
        await self.until_done(choices)
        return sg.completion_body(choices, n, model, text_of)

    async def chat(self, body: sg.ChatRequest, override_rid: str | None = None) -> Answer:
        """``override_rid``: the request's ``x-override-rid`` header, if it has one."""
        usage = sg.stream_usage(body)  # fields of the body: validated first
        given_rid = sr.body_rid(body.rid)
        n = sg.check_n(body.n)
        sg.check_messages(body.messages)
        prompt = await self.app.chat_prompt_ids(
            body.messages, body.tools, body.add_generation_prompt
        )
        if override_rid is not None and self.app.settings.request_header_overrides:
            given_rid = override_rid  # ``apply_header_overrides``, on the request built
        body.max_tokens = body.max_completion_tokens or body.max_tokens  # SGLang's preference
        rids = sr.plan(given_rid, 1, n, batch=False)
        choices = await self.start(rids, [prompt], Sampling.of(body), n)
        model, text_of = _model(body), self.app.tokenizer.text_of
        if body.stream:
            return sg.chat_chunks(choices, n, model, text_of, usage), choices
        await self.until_done(choices)
        return sg.chat_body(choices, n, model, text_of)

    async def until_done(self, choices: Choices) -> None:
        """Until the answer is whole: a P/D prefill's once its decode server has read
        the KV (SGLang answers the prefill when the transfer is done), or 500 after the
        waiting timeout."""
        await choices.until_done()
        req = choices.handles[0].req if choices.handles else None
        if req is None or not req.hold_kv:
            return
        engine = self.app.engine
        if not await engine.transfers.until_read(req):
            raise p.ApiError(
                f"Prefill transfer failed for request {req.request_id=} {req.bootstrap_room=}"
            )

    async def start(
        self,
        rids: sr.Rids,
        prompts: list[list[int]],
        ask: Sampling,
        n: int,
        *,
        batch: bool = False,
        ids_given: bool = False,
    ) -> Choices:
        """The tokenizer manager's part: the client's rids taken (``_init_req_state``),
        then the LoRA check, then the engine requests; the rids given back if it fails."""
        self.rids.reserve(rids.held)
        try:
            adapter = sg.adapter_named(ask.model, self.app.settings.model) or ask.lora_path
            lora = self.app.sglang_adapter(adapter) if adapter else None
            return await self._submit(
                rids, prompts, ask, n, batch=batch, ids_given=ids_given, lora=lora
            )
        except BaseException:
            self.rids.release(rids.held)
            raise

    async def _submit(
        self,
        rids: sr.Rids,
        prompts: list[list[int]],
        ask: Sampling,
        n: int,
        *,
        batch: bool,
        ids_given: bool,
        lora: LoraTag | None = None,
    ) -> Choices:
        """SGLang's engine requests: one per prompt, or for ``n > 1`` a warm-up per prompt
        (``max_tokens`` 0, awaited in turn) and then ``n`` samples each; checked in
        SGLang's order: the batch's form, then per prompt its length and the sampling.
        Each has an id of its own (uuid hex), whatever the client named it."""
        app, engine = self.app, self.app.engine
        if batch and n < 1:  # the batch expanded n times over is empty: obj[i] fails
            raise p.ApiError("Internal server error: list index out of range")
        context = app.settings.model_len
        try:
            for prompt in prompts:
                sg.check_length(len(prompt), ask.max_tokens, context)
                if ids_given:
                    sg.check_token_ids(prompt)
                sg.check_temperature(ask.temperature)
                sg.check_max_new_tokens(ask.max_tokens)
                engine.check(len(prompt), _max_tokens(ask, len(prompt), context))
        except RequestRejected as exc:
            raise p.BadRequest(str(exc), sglang_type="BadRequestError") from exc
        if engine.faults.should_fail():
            raise p.InjectedFailure("Injected failure (kvroute-sim fault).")
        salt, mode = ask.salt, app.settings.disaggregation_mode
        prefill_cached, held = 0, [0] * len(prompts)
        if mode == "decode" and ask.bootstrap is not None:
            held = [self._held(prompt, salt, lora) for prompt in prompts]
            prefill_cached = await self._read_prefill(ask.bootstrap, prompts, held)
        if n > 1:
            for prompt in prompts:  # ``_handle_batch_request``: cache the common prefix
                warm = SimRequest(sg.request_id(), prompt, 0, salt, lora=lora)
                handle = await engine.submit(warm, stream=False)
                await Choices(warm.request_id, [handle]).until_done()
            self.rids.release(rids.held)  # the samples are named anew
        reqs = [
            SimRequest(
                sg.request_id(), prompt, _max_tokens(ask, len(prompt), context), salt, lora=lora
            )
            for prompt in prompts
            for _ in range(max(n, 1))
        ]
        if ask.bootstrap is not None and mode != "null":
            held_each = [h for h in held for _ in range(max(n, 1))]
            _pair(reqs, ask.bootstrap.room, mode, prefill_cached, held_each)
        handles = await engine.submit_all(reqs, stream=ask.stream)
        names = rids.names
        reports = not app.settings.no_cache_report
        if names is None:
            return Choices(reqs[0].request_id, handles, max(n, 1), reports_cached=reports)
        self.rids.hold(rids.held, handles)
        return Choices(names[0], handles, max(n, 1), names, reports_cached=reports)

    def _held(self, prompt: list[int], salt: str | None, lora: LoraTag | None) -> int:
        """The prompt's leading tokens this decode server's cache holds: none by default
        (its tree is disabled); with ``--disaggregation-decode-enable-radix-cache`` its
        radix match, which SGLang sends the prefill as ``decode_prefix_len`` so that only
        the rest is transferred."""
        kv = self.app.engine.core.kv
        assert isinstance(kv, SglangRadixCache)  # SGLang mode's manager
        return kv.cached_prefix_tokens(SimRequest("", prompt, 0, salt, lora=lora))

    async def _read_prefill(
        self, bootstrap: Bootstrap, prompts: list[list[int]], held: list[int]
    ) -> int:
        """The decode server's handshake and transfer of the prompt blocks it does not
        hold (all of them by default: its radix cache is off unless started with
        ``--disaggregation-decode-enable-radix-cache``); the cached tokens the prefill
        server reported. Fails as SGLang aborts it."""
        bs = self.app.settings.block_size
        pairs = zip(prompts, held, strict=True)
        blocks = sum(-(-len(prompt) // bs) - h // bs for prompt, h in pairs)
        try:
            return await self.app.engine.transfers.pull(bootstrap, blocks)
        except KvLoadFailed as exc:
            raise p.ApiError(
                f"Decode handshake failed for request bootstrap_room={bootstrap.room}: {exc.reason}"
            ) from exc


def _pair(
    reqs: list[SimRequest], room: int, mode: str, prefill_cached: int, held: list[int]
) -> None:
    """P/D: a prefill computes one token and keeps its blocks in ``room``; a decode has
    the prompt it does not hold (``held``, each request's) loaded and answers the cached
    tokens its prefill reported (``_commit_transfer_to_req``: ``cached_tokens`` from the
    metadata buffer), or its own radix hit where that is longer
    (``scheduler.reported_cached``)."""
    for req, h in zip(reqs, held, strict=True):
        req.bootstrap_room = room
        if mode == "prefill":
            req.max_tokens, req.hold_kv = 1, True
        else:
            tokens = len(req.prompt) - h
            req.loaded = LoadedKV(tokens, last_recomputed=False, reported=prefill_cached)


def _model(body: p._Sampling) -> str:
    """SGLang checks no model name: an answer names the request's ``model``, or
    ``"default"`` (``protocol.DEFAULT_MODEL_NAME``) when it has none."""
    return body.model if body.model is not None else sg.DEFAULT_MODEL_NAME


def _max_tokens(ask: Sampling, prompt_len: int, context: int) -> int:
    """The output of one SGLang request: ``max_tokens``, or without it (a chat, or a
    ``/generate`` whose ``max_new_tokens`` is null) the simulator's default bounded by
    the context, as SGLang bounds it."""
    if ask.max_tokens is not None:
        return ask.max_tokens
    return max(1, min(p.DEFAULT_MAX_TOKENS, context - prompt_len))
