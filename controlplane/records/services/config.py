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
from typing import Any, get_args

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
from kvcore.workload import Workload

log = logging.getLogger(__name__)
# each strategy's workload model, by strategy name
STRATEGY_MODELS = {
    model.model_fields["strategy"].default: model for model in get_args(get_args(Workload)[0])
}


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
        detail: str = "",
    ) -> Written:
        """Write ``value`` (None: delete) as the steps above; ``detail`` goes to the
        audit entry."""
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
        await self._record(kind, name, action, revision, current, value, target, detail)
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
        detail: str,
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
            actor=self.actor,
            action=action,
            target=target,
            result="ok",
            before=before,
            after=value,
            detail=detail,
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


@dataclass(frozen=True, slots=True)
class Patched:
    """A workload after a merge patch: its document, and what a change of strategy
    dropped (settings the old strategy had, set off its default, the new one has not)."""

    document: Any
    dropped: dict[str, Any]
    change: str = ""  # "kv_aware -> least_load" when the strategy changed

    def detail(self) -> str:
        """The audit's words for what the change of strategy did."""
        if not self.change:
            return ""
        gone = ", ".join(f"{k}={json.dumps(v)}" for k, v in sorted(self.dropped.items()))
        return f"strategy {self.change}" + (f": dropped {gone}" if gone else "")


def merge_workload(stored: Any, patch: dict[str, Any]) -> Patched:
    """RFC 7386 merge of ``patch`` into a stored workload. A patch that changes the
    strategy first keeps of the stored settings those the new strategy has too, unless
    they are at the old strategy's default (then the new one's applies); the others
    are dropped, and said (the patch's own fields are the caller's: validation judges
    them)."""
    old = stored.get("strategy") if isinstance(stored, dict) else None
    new = patch.get("strategy")
    if old == new or old not in STRATEGY_MODELS or new not in STRATEGY_MODELS:
        return Patched(merge_patch(stored, patch), {})
    before, after = STRATEGY_MODELS[old].model_fields, STRATEGY_MODELS[new].model_fields
    kept: dict[str, Any] = {}
    dropped: dict[str, Any] = {}
    for key, value in stored.items():
        if key in before and before[key].default == value:
            continue  # the old strategy's default: the new one's applies
        if key in after:
            kept[key] = value
        elif key not in patch:
            dropped[key] = value
    return Patched(merge_patch(kept, patch), dropped, f"{old} -> {new}")


async def check_deletable(store: EtcdConfigStore, name: str) -> None:
    if name == DEFAULT_WORKLOAD:
        raise Conflict("the default workload cannot be deleted (change it instead)")
    stored = await store.read(Kind.RULES)
    rules = store.rules() if stored is None else parse_value(Kind.RULES, stored.value)
    used = [r for r in rules.rules if r.workload == name]
    if used or rules.default_workload == name:
        raise Conflict(f"workload {name!r} is named by the classification rules")
