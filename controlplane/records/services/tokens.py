"""API tokens: created with a secret shown once, stored hashed, revoked by id.

An ``inference`` token is for a proxy's clients: its hash, tenant and default workload
go to etcd (``api-keys/<id>``) so that every proxy learns it with its routing state, and
then to SQL, in the order every config change follows (etcd first, then the SQL commit,
undone in etcd if that fails).
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Sequence
from typing import Literal

from sqlalchemy.ext.asyncio import AsyncSession

from controlplane.records.api.auth import token_sha256
from controlplane.records.config_store import ApiKeyEntry, EtcdConfigStore, Kind
from controlplane.records.db.models import ApiToken
from controlplane.records.db.repositories import TokenRepository
from controlplane.records.errors import InvalidInput, NotFound
from controlplane.records.services.config import ConfigWriter

Scope = Literal["read", "admin", "inference"]
SECRET_PREFIX = "kvr_"


class TokenService:
    def __init__(self, store: EtcdConfigStore, session: AsyncSession, actor: str) -> None:
        self.store = store
        self.session = session
        self.actor = actor
        self.tokens = TokenRepository(session)

    async def create(
        self,
        *,
        name: str,
        scopes: list[Scope],
        tenant: str | None,
        default_workload: str | None,
    ) -> tuple[ApiToken, str]:
        """The stored token and its secret (the only time the secret is seen)."""
        wanted = sorted(set(scopes))
        self._check(wanted, tenant, default_workload)
        if (
            default_workload is not None
            and await self.store.read(Kind.WORKLOAD, default_workload) is None
        ):
            raise InvalidInput("body.default_workload", f"no workload {default_workload!r}")
        secret = SECRET_PREFIX + secrets.token_urlsafe(32)
        token = ApiToken(
            id=secrets.token_hex(8),
            name=name,
            key_sha256=token_sha256(secret),
            scopes=",".join(wanted),
            tenant=tenant,
            default_workload=default_workload,
            created_by=self.actor,
            created_at=time.time(),
        )
        self.tokens.add(token)
        writer = ConfigWriter(self.store, self.session, self.actor)
        if "inference" in wanted:
            entry = ApiKeyEntry(
                key_sha256=token.key_sha256,
                tenant=tenant or "",
                default_workload=default_workload or "default",
                scopes=tuple(wanted),
            )
            await writer.write(
                Kind.API_KEY, token.id, entry.model_dump_json(), if_match=None, action="create"
            )
        else:
            writer.audit.add(
                actor=self.actor, action="create", target=f"token/{token.id}", result="ok"
            )
            await self.session.commit()
        return token, secret

    def _check(
        self, scopes: Sequence[str], tenant: str | None, default_workload: str | None
    ) -> None:
        if not scopes:
            raise InvalidInput("body.scopes", "at least one scope is needed")
        if "inference" in scopes and len(scopes) > 1:
            raise InvalidInput("body.scopes", "an inference token has no other scope")
        if "inference" in scopes and tenant is None:
            raise InvalidInput("body.tenant", "an inference token needs a tenant")
        if "inference" not in scopes and (tenant or default_workload):
            raise InvalidInput("body.tenant", "only inference tokens have a tenant and workload")

    async def delete(self, token_id: str) -> None:
        token = await self.tokens.get(token_id)
        if token is None:
            raise NotFound(f"no token {token_id!r}")
        await self.tokens.delete(token)
        writer = ConfigWriter(self.store, self.session, self.actor)
        if await self.store.read(Kind.API_KEY, token.id) is not None:
            await writer.write(Kind.API_KEY, token.id, None, if_match=None, action="delete")
        else:
            writer.audit.add(
                actor=self.actor, action="delete", target=f"token/{token_id}", result="ok"
            )
            await self.session.commit()
