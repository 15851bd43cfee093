"""Tenant cache namespaces: the tenant is who the router knows the client to be, never
what the client says; what the client sends only subdivides its tenant's namespace.

An engine shares cached blocks between requests whose ``cache_salt`` is equal, and a
cache hit is a timing side channel (a hit answers several times faster than a
recompute). So the salt an engine sees for a tenant's request is always
:func:`tenant_salt` of (tenant, the client's own value), a one-way function of the pair:
no value a client sends (another tenant's name, its salt, or the salt derived for it)
lands it in another tenant's namespace. The same string is the block keys' namespace,
since the sidecar keys the engine's blocks under the salt it saw.

- the client's own value (:func:`own_namespace`) is its ``cache_salt`` with SGLang's
  ``extra_key`` appended (SGLang appends it to the salt), else, when the workload
  isolates tenants, its ``prompt_cache_key``;
- with an own value, or with a tenant on a workload that isolates tenants, the namespace
  is ``tenant_salt(tenant or "", own)``; otherwise it is empty (shared).
"""

from __future__ import annotations

import functools
import hashlib
import json
from collections.abc import Mapping
from typing import Any


@functools.lru_cache(maxsize=4096)
def tenant_salt(tenant: str, own: str | None) -> str:
    """The salt of ``tenant``'s requests carrying the client's own value ``own`` (None:
    none): 32 hex digits, within every engine's salt rules, injective on the pair (a
    JSON array is hashed)."""
    pair = json.dumps([tenant, own]).encode()  # ASCII: any str, lone surrogates too
    return hashlib.blake2b(pair, digest_size=16, person=b"kvroute-tenant").hexdigest()


def own_namespace(body: Mapping[str, Any], isolating: bool) -> str | None:
    """The client's own namespace value in a request ``body``, or None when it names
    none (see the module's docstring)."""
    salt, extra = body.get("cache_salt"), body.get("extra_key")
    own = salt if isinstance(salt, str) else None
    if isinstance(extra, str) and extra:
        own = (own or "") + extra
    if own is None and isolating:
        key = body.get("prompt_cache_key")
        own = key if isinstance(key, str) else None
    return own


def cache_namespace(body: Mapping[str, Any], *, tenant: str | None, isolating: bool) -> str:
    """The namespace (and upstream ``cache_salt``; "" for none) of a request ``body``
    from ``tenant`` on a workload that isolates tenants or not."""
    own = own_namespace(body, isolating)
    if own is None and (tenant is None or not isolating):
        return ""
    return tenant_salt(tenant or "", own)
