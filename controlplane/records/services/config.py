"""Changing the live config: etcd first (compare-and-swap), then SQL, never out of step.

Every change follows one path (:meth:`ConfigWriter.write`):

1. read the key's current value and mod revision from etcd;
2. check the caller's ``If-Match`` against that revision (412 on mismatch);
3. write with a transaction that compares the mod revision read in 1 (so a concurrent
   writer makes this one fail: 412 with ``If-Match``, else 409);
4. only then add the config revision and the audit entry and commit them together; if
   that commit fails, the etcd write is undone with the same compare-and-swap.

Refused writes are audited too (result ``precondition_failed``, ``conflict``...), so the
audit log shows both admins when two race with the same ETag.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from typing import Any

from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.ext.asyncio import AsyncSession

from controlplane.records.config_store import (
    DEFAULT_WORKLOAD,
    EtcdConfigStore,
    Kind,
    Stored,
    parse_value,
)
from controlplane.records.db.models import ConfigRevision
from controlplane.records.db.repositories import AuditRepository, RevisionRepository
from controlplane.records.errors import (
    Conflict,
    InvalidInput,
    NotFound,
    PreconditionFailed,
    Unavailable,
)

log = logging.getLogger(__name__)


def etag(mod_revision: int) -> str:
    return f'"{mod_revision}"'


def etag_matches(if_match: str, current: Stored | None) -> bool:
    """Whether an ``If-Match`` header value admits ``current``."""
    if current is None:
        return False
    for candidate in if_match.split(","):
        tag = candidate.strip().removeprefix("W/")
        if tag == "*" or tag == etag(current.mod_revision):
            return True
    return False


@dataclass(frozen=True, slots=True)
class Written:
    """The outcome of a write: the new value (``None``: deleted) and its revision."""

    value: str | None
    mod_revision: int
    created: bool


class ConfigWriter:
    """Writes one config key for one actor, within one SQL session."""

    def __init__(self, store: EtcdConfigStore, session: AsyncSession, actor: str) -> None:
        self.store = store
        self.session = session
        self.actor = actor
        self.audit = AuditRepository(session)

    async def write(
        self,
        kind: Kind,
        name: str,
        value: str | None,
        *,
        if_match: str | None,
        action: str,
    ) -> Written:
        current = await self.store.read(kind, name)
        target = f"{kind}/{name}" if name else str(kind)
        if if_match is not None and not etag_matches(if_match, current):
            await self._refused(target, action, "precondition_failed", current, value)
            raise PreconditionFailed(f"{target} is not at the version If-Match names")
        if value is None and current is None:
            raise NotFound(f"no {kind} {name!r}")
        expect = 0 if current is None else current.mod_revision
        try:
            revision = await self.store.swap(kind, name, value, expect)
        except Conflict:
            result = "precondition_failed" if if_match is not None else "conflict"
            await self._refused(target, action, result, current, value)
            if if_match is not None:
                raise PreconditionFailed(f"{target} changed while this write was made") from None
            raise
        await self._record(kind, name, action, revision, current, value, target)
        return Written(value, revision, created=current is None)

    async def _record(
        self,
        kind: Kind,
        name: str,
        action: str,
        revision: int,
        current: Stored | None,
        value: str | None,
        target: str,
    ) -> None:
        before = None if current is None else current.value
        if kind is not Kind.API_KEY:
            RevisionRepository(self.session).add(
                ConfigRevision(
                    kind=str(kind),
                    name=name,
                    action=action,
                    etcd_revision=revision,
                    before=before,
                    after=value,
                    actor=self.actor,
                    at=time.time(),
                )
            )
        self.audit.add(
            actor=self.actor, action=action, target=target, result="ok", before=before, after=value
        )
        try:
            await self.session.commit()
        except SQLAlchemyError:
            await self._undo(kind, name, revision, before)
            raise Unavailable("the database refused the change; it was undone in etcd") from None

    async def _undo(self, kind: Kind, name: str, revision: int, before: str | None) -> None:
        try:
            await self.store.swap(kind, name, before, revision)
        except Exception:  # someone wrote on top meanwhile: theirs stands, and is recorded
            log.exception("could not undo %s/%s at revision %d", kind, name, revision)

    async def _refused(
        self, target: str, action: str, result: str, current: Stored | None, value: str | None
    ) -> None:
        before = None if current is None else current.value
        self.audit.add(
            actor=self.actor,
            action=action,
            target=target,
            result=result,
            before=before,
            after=value,
        )
        await self.session.commit()


def validated_json(kind: Kind, document: Any, field: str = "body") -> str:
    """``document`` as the JSON to store, after the same validation readers apply."""
    try:
        text = json.dumps(document, allow_nan=False, separators=(",", ":"))
    except ValueError:
        raise InvalidInput(field, "numbers must be finite") from None
    try:
        parsed = parse_value(kind, text)
    except ValueError as exc:
        raise InvalidInput(field, str(exc)) from None
    return str(parsed.model_dump_json())


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386 JSON merge patch."""
    if not isinstance(patch, dict):
        return patch
    result = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = merge_patch(result.get(key), value)
    return result


async def check_deletable(store: EtcdConfigStore, name: str) -> None:
    if name == DEFAULT_WORKLOAD:
        raise Conflict("the default workload cannot be deleted (change it instead)")
    stored = await store.read(Kind.RULES)
    rules = store.rules() if stored is None else parse_value(Kind.RULES, stored.value)
    used = [r for r in rules.rules if r.workload == name]
    if used or rules.default_workload == name:
        raise Conflict(f"workload {name!r} is named by the classification rules")
