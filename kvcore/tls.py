"""The CA bundles kvroute's processes trust for the HTTPS servers they call."""

from __future__ import annotations

import ssl
from pathlib import Path


def ca_context(path: Path | str) -> ssl.SSLContext:
    """A client context trusting only the PEM bundle at ``path`` (hosts and certificates
    checked); ``ValueError`` saying why when the file is no PEM CA bundle, so that a
    setting can refuse it at start-up with one line."""
    try:
        return ssl.create_default_context(cafile=str(path))
    except ssl.SSLError as exc:
        raise ValueError(f"not a PEM CA bundle: {exc.reason or exc}") from None
