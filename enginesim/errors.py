"""The one exception hierarchy of ``enginesim``, translated at each boundary.

::

    SimError
     ├── SettingsError      flags/environment describe no valid engine      -> exit 2
     ├── StartupError       tokenizer or an address refused at start        -> exit 2
     ├── RequestRejected    a request this engine can never serve           -> HTTP 400
     ├── EngineRestarted    a request dropped by an (injected) restart      -> HTTP 500
     └── PoolExhausted      more blocks asked for than are free (a bug)     -> HTTP 500

At the HTTP edge, ``protocol.ApiError`` and its subclasses carry the status code and
OpenAI's error shape; ``http.py`` translates the errors above into them.
"""

from __future__ import annotations


class SimError(Exception):
    """Base of every error the simulator raises on purpose."""


class SettingsError(SimError, ValueError):
    """The command line or environment does not describe a valid engine."""


class StartupError(SimError):
    """The engine cannot start with these settings."""


class RequestRejected(SimError, ValueError):
    """A request that can never run on this engine (too long, too many blocks)."""


class EngineRestarted(SimError):
    """The request was dropped by an (injected) engine restart or a disconnect."""


class PoolExhausted(SimError):
    """More blocks were asked for than are free: the scheduler checks first, so a bug."""
