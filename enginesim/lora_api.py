"""The adapter routes of both engines and what a request's model name makes of it.

``lora.py`` holds the registry and the table of what vLLM 0.33 and SGLang 0.5.23 do;
this module answers their HTTP routes in their own shapes:

- vLLM (``serve/lora/api_router.py``, ``openai/models/serving.py``): success is 200
  with the plain text ``Success: LoRA adapter '<name>' added successfully.`` (no content
  type); a refusal is the OpenAI error body with vLLM's ``type``: ``InvalidUserInput``
  (400: a name or path missing, the base model's name, already loaded without
  ``load_inplace``), ``NotFoundError`` (404: unloading one not loaded),
  ``InternalServerError`` (500: the engine has no LoRA). The routes exist only when
  ``VLLM_ALLOW_RUNTIME_LORA_UPDATING`` is ``1``/``true`` at start.
- SGLang (``http_server.py``, ``tokenizer_control_mixin.py``): always routed; the
  answer is ``LoRAUpdateOutput`` as JSON, ``success`` and ``error_message``, with the
  loaded adapters (name -> path), 200 or 400.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import msgspec

from enginesim import protocol as p
from enginesim.lora import VLLM_ENV_GATE, AdapterRegistry, LoraModule, parse_modules
from enginesim.request import LoraTag
from enginesim.settings import SimSettings

if TYPE_CHECKING:
    from enginesim.engine import Engine

VLLM_LOAD_PATH, VLLM_UNLOAD_PATH = "/v1/load_lora_adapter", "/v1/unload_lora_adapter"
SGLANG_LOAD_PATH, SGLANG_UNLOAD_PATH = "/load_lora_adapter", "/unload_lora_adapter"
_SGLANG_DISABLED = "LoRA is not enabled. Please set `--enable-lora` to enable LoRA."
_VLLM_DISABLED = "LoRA is not enabled. Use --enable-lora to enable LoRA."


@dataclass(frozen=True, slots=True)
class LoraAnswer:
    """A route's answer; the HTTP layer sends it as it is."""

    status: int
    body: bytes
    content_type: bytes


Route = Callable[[bytes], Awaitable[LoraAnswer]]


class LoraRefused(p.ApiError):
    """vLLM's ``create_error_response`` with its own ``err_type`` and status."""

    def __init__(self, message: str, error_type: str, status: int) -> None:
        super().__init__(message)
        self.error_type, self.status = error_type, status


class _VllmLoad(msgspec.Struct, kw_only=True):
    lora_name: str
    lora_path: str
    load_inplace: bool = False
    is_3d_lora_weight: bool = False


class _VllmUnload(msgspec.Struct, kw_only=True):
    lora_name: str
    lora_int_id: int | None = None


class _SglangLoad(msgspec.Struct, kw_only=True):
    lora_name: str
    lora_path: str
    pinned: bool = False
    lora_id: str | None = None


class _SglangUnload(msgspec.Struct, kw_only=True):
    lora_name: str
    lora_id: str | None = None


def runtime_updates_allowed(environ: dict[str, str] | None = None) -> bool:
    """vLLM's env gate, read as vLLM reads it."""
    value = (environ if environ is not None else os.environ).get(VLLM_ENV_GATE, "0")
    return value.strip().lower() in ("1", "true")


class Adapters:
    """The engine's adapters: the start-up list, the routes, a request's adapter."""

    def __init__(self, settings: SimSettings, engine: Engine) -> None:
        self.settings = settings
        self.engine = engine
        self.sglang = settings.event_format == "sglang"
        self.registry = AdapterRegistry(settings.model)
        self.runtime_updates = runtime_updates_allowed()
        text = settings.lora_paths if self.sglang else settings.lora_modules
        for module in parse_modules(text, sglang=self.sglang):
            self.registry.add(module)
        self._bound_loaded()

    @property
    def enabled(self) -> bool:
        return self.settings.enable_lora

    def routes(self) -> dict[str, Route]:
        """The load and unload routes this engine serves."""
        if self.sglang:
            return {SGLANG_LOAD_PATH: self.sglang_load, SGLANG_UNLOAD_PATH: self.sglang_unload}
        if not self.runtime_updates:
            return {}
        return {VLLM_LOAD_PATH: self.vllm_load, VLLM_UNLOAD_PATH: self.vllm_unload}

    def use(self, name: str) -> LoraTag | None:
        """The adapter a request names, marked used; None if it is not loaded."""
        return self.registry.use(name) if self.enabled else None

    def cards(self, now: int) -> list[dict[str, Any]]:
        if not self.enabled:
            return []
        return self.registry.cards(now, owned_by="sglang" if self.sglang else "vllm")

    # -- vLLM ----------------------------------------------------------------------------

    async def vllm_load(self, raw: bytes) -> LoraAnswer:
        body = p.decode_body(raw, _VllmLoad)
        if not body.lora_name or not body.lora_path:
            raise _invalid("Both 'lora_name' and 'lora_path' must be provided.")
        if body.lora_name == self.settings.model:
            raise _invalid(
                f"The lora adapter '{body.lora_name}' conflicts with a served base model."
            )
        if not body.load_inplace and body.lora_name in self.registry:
            raise _invalid(
                f"The lora adapter '{body.lora_name}' has already been loaded. If you want "
                "to load the adapter in place, set 'load_inplace' to True."
            )
        if not self.enabled:
            raise LoraRefused(_VLLM_DISABLED, "InternalServerError", 500)
        tag = self.registry.add(LoraModule(body.lora_name, body.lora_path))
        await self._load_weights(tag)
        return _text(f"Success: LoRA adapter '{body.lora_name}' added successfully.")

    async def vllm_unload(self, raw: bytes) -> LoraAnswer:
        body = p.decode_body(raw, _VllmUnload)
        if not body.lora_name:
            raise _invalid("'lora_name' needs to be provided to unload a LoRA adapter.")
        if not self.registry.remove(body.lora_name):
            raise LoraRefused(
                f"The lora adapter '{body.lora_name}' cannot be found.", "NotFoundError", 404
            )
        return _text(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")

    # -- SGLang --------------------------------------------------------------------------

    async def sglang_load(self, raw: bytes) -> LoraAnswer:
        body = p.decode_body(raw, _SglangLoad)
        if not self.enabled:
            return self._sglang_answer(_SGLANG_DISABLED)
        if body.lora_name in self.registry:
            return self._sglang_answer(
                f"Failed to load LoRA adapter {body.lora_name} because it is already loaded"
            )
        tag = self.registry.add(LoraModule(body.lora_name, body.lora_path, pinned=body.pinned))
        await self._load_weights(tag)
        self._bound_loaded()
        return self._sglang_answer(None)

    async def sglang_unload(self, raw: bytes) -> LoraAnswer:
        body = p.decode_body(raw, _SglangUnload)
        if not self.enabled:
            return self._sglang_answer(_SGLANG_DISABLED)
        if not self.registry.remove(body.lora_name):
            loaded = ", ".join(self.registry.paths())
            return self._sglang_answer(
                f"LoRA with name {body.lora_name} does not exist. Loaded LoRAs: {loaded}"
            )
        return self._sglang_answer(None)

    def _sglang_answer(self, error: str | None) -> LoraAnswer:
        body = {
            "rid": None,
            "http_worker_ipc": None,
            "success": error is None,
            "error_message": error,
            "loaded_adapters": self.registry.paths() if error is None else None,
        }
        return LoraAnswer(
            200 if error is None else 400, msgspec.json.encode(body), b"application/json"
        )

    def _bound_loaded(self) -> None:
        """SGLang's ``--max-loaded-loras``: unload the least recently used unpinned."""
        bound = self.settings.max_loaded_loras
        while self.sglang and bound is not None and len(self.registry) > bound:
            name = self.registry.least_recently_used()
            if name is None:
                return
            self.registry.remove(name)

    async def _load_weights(self, tag: LoraTag) -> None:
        """The modelled load (vLLM's ``add_lora`` preloads the weights too)."""
        seconds = 0.0 if self.settings.instant else self.settings.lora_load_ms / 1000
        if seconds:
            await asyncio.sleep(seconds * self.settings.time_scale)
        self.engine.core.warm_adapter(tag)


def _invalid(message: str) -> LoraRefused:
    return LoraRefused(message, "InvalidUserInput", 400)


def _text(message: str) -> LoraAnswer:
    return LoraAnswer(200, message.encode(), b"")  # FastAPI's Response: no content type
