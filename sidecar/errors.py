"""The sidecar's exceptions: one tree, so callers catch what they can handle.

::

    SidecarError
    ├── ConfigError          settings that cannot work (refused at start-up)
    ├── FrameError           an engine frame or batch that cannot be decoded; counted, skipped
    ├── EngineUnavailable    the engine's HTTP endpoint did not answer usefully
    └── ReplayError          the engine's replay socket did not answer usefully

Library errors (zmq, nats, aiohttp, msgspec) are translated into these where they cross
a module boundary; nothing outside the module that talks to a library catches its errors.
"""

from __future__ import annotations


class SidecarError(Exception):
    """Base of every error the sidecar raises on purpose."""


class ConfigError(SidecarError):
    """Settings that cannot work."""


class FrameError(SidecarError):
    """An engine frame or batch that cannot be decoded. ``reason`` is a short metric label."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason


class EngineUnavailable(SidecarError):
    """The engine's HTTP endpoint did not answer, or answered something unusable."""


class ReplayError(SidecarError):
    """The engine's replay socket did not answer, or answered something unusable."""
