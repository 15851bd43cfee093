"""Bearer tokens: who is calling and what they may do.

Tokens are stored as the SHA-256 of their secret (a secret is 32 random bytes, so a
fast hash is enough). The bootstrap admin token (``KVROUTE_ADMIN_TOKEN`` or its file)
is compared in constant time and never stored. Scopes: ``read`` (every GET), ``admin``
(everything), ``inference`` (proxy clients: no access to this API).
"""

from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass
from typing import Annotated

from fastapi import Depends, HTTPException
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from controlplane.records.api.deps import Context, Session
from controlplane.records.db.repositories import TokenRepository

BOOTSTRAP_ACTOR = "bootstrap-admin"
bearer = HTTPBearer(auto_error=False, description="An API token with scope read or admin.")


def token_sha256(secret: str) -> str:
    return hashlib.sha256(secret.encode("utf-8", "surrogatepass")).hexdigest()


@dataclass(frozen=True, slots=True)
class Principal:
    actor: str  # "bootstrap-admin" or "token:<id>"
    scopes: frozenset[str]

    def may(self, scope: str) -> bool:
        return "admin" in self.scopes or scope in self.scopes


def _unauthorized(message: str) -> HTTPException:
    return HTTPException(401, message, headers={"WWW-Authenticate": "Bearer"})


async def authenticate(
    context: Context,
    session: Session,
    credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(bearer)],
) -> Principal:
    if credentials is None or credentials.scheme.lower() != "bearer":
        raise _unauthorized("a bearer token is required")
    digest = token_sha256(credentials.credentials)
    bootstrap = context.settings.secret("admin_token")
    if bootstrap and hmac.compare_digest(digest, token_sha256(bootstrap)):
        return Principal(BOOTSTRAP_ACTOR, frozenset({"admin"}))
    token = await TokenRepository(session).by_hash(digest)
    if token is None:
        raise _unauthorized("unknown token")
    return Principal(f"token:{token.id}", frozenset(token.scopes.split(",")))


async def reader(principal: Annotated[Principal, Depends(authenticate)]) -> Principal:
    if not principal.may("read"):
        raise HTTPException(403, "this token lacks the read scope")
    return principal


async def admin(principal: Annotated[Principal, Depends(authenticate)]) -> Principal:
    if not principal.may("admin"):
        raise HTTPException(403, "this token lacks the admin scope")
    return principal


Reader = Annotated[Principal, Depends(reader)]
Admin = Annotated[Principal, Depends(admin)]
