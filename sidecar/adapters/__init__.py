"""Engine adapters: one per engine family, each decoding raw msgpack into kvcore events.

An adapter knows one engine's wire layouts and nothing else: no sockets, no keys, no
NATS. :func:`adapter_for` is the one way to get one.
"""

from __future__ import annotations

from typing import Protocol

from kvcore.engine_events import EngineEventBatch
from sidecar.adapters import sglang, vllm
from sidecar.errors import ConfigError


class EngineAdapter(Protocol):
    @property
    def engine_kind(self) -> str: ...

    def decode(self, payload: bytes) -> EngineEventBatch:
        """Decode one payload; raises ``FrameError`` when the batch itself is unusable."""
        ...


_ADAPTERS: dict[str, EngineAdapter] = {"vllm": vllm.ADAPTER, "sglang": sglang.ADAPTER}


def adapter_for(engine_kind: str) -> EngineAdapter:
    try:
        return _ADAPTERS[engine_kind]
    except KeyError:
        raise ConfigError(
            f"unknown engine kind {engine_kind!r}; use one of {sorted(_ADAPTERS)}"
        ) from None
