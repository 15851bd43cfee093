"""The live routing config in etcd: compare-and-swap writes and a watched local copy.

etcd is where what is live lives, so that both control-plane instances, and an operator
with ``etcdctl``, change the same thing. Every write is a transaction comparing the key's
mod revision with the one the writer read (0: the key must not exist), so two writers
can never both win. Each instance keeps a copy of the config section of its prefix,
loaded once and then kept current by a watch from the revision it was loaded at; after
every change it calls its subscribers (the gRPC stream to proxies) and
:meth:`EtcdConfigStore.current` answers with the new ``RoutingConfig``.

Keys (below the prefix, :class:`kvcore.subjects.EtcdKeys`)::

    workloads/<name>   kvcore workload JSON       models/<name>    kvcore ModelSpec JSON
    rules              {"rules": [...], "default_workload": "default"}
    api-keys/<id>      {"key_sha256", "tenant", "default_workload", "scopes"}

A value that does not validate (written by hand) is logged, counted and ignored: the
copy keeps the key's last good value, so a typo never takes a workload away from proxies.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

import aetcd
from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError

from controlplane.records.errors import Conflict, Unavailable
from kvcore.pb import routing_pb2
from kvcore.subjects import EtcdKeys, InvalidName
from kvcore.workload import (
    KvCostWorkload,
    MatchRule,
    ModelSpec,
    Workload,
    WorkloadError,
    parse_model,
    parse_workload,
)

log = logging.getLogger(__name__)

DEFAULT_WORKLOAD = "default"
WATCH_RETRY_MAX_S = 5.0
CLOSE_ATTEMPTS = 5
CLOSE_WAIT_S = 1.0


class Kind(StrEnum):
    WORKLOAD = "workload"
    MODEL = "model"
    RULES = "rules"
    API_KEY = "api_key"


class ApiKeyEntry(BaseModel):
    """A client API key as proxies get it: only the hash of the secret."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    key_sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    tenant: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    default_workload: str = Field(DEFAULT_WORKLOAD, pattern=r"^[A-Za-z0-9_-]{1,64}$")
    scopes: tuple[str, ...] = ("inference",)


class RulesDocument(BaseModel):
    """Classification rules and the default workload (etcd ``rules``)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    rules: tuple[MatchRule, ...] = ()
    default_workload: str = Field(DEFAULT_WORKLOAD, pattern=r"^[A-Za-z0-9_-]{1,64}$")


_RULES = TypeAdapter(RulesDocument)
_API_KEY = TypeAdapter(ApiKeyEntry)


@dataclass(frozen=True, slots=True)
class Stored:
    """A value as stored in etcd, with the mod revision a compare-and-swap compares."""

    value: str
    mod_revision: int


def default_workload_json() -> str:
    """The ``default`` workload created on first start."""
    return KvCostWorkload.model_validate({"name": DEFAULT_WORKLOAD}).model_dump_json()


def parse_value(kind: Kind, value: str | bytes) -> Any:
    """The validated model of a stored value; raises ``ValueError`` when invalid."""
    try:
        if kind is Kind.WORKLOAD:
            return parse_workload(value)
        if kind is Kind.MODEL:
            return parse_model(value)
        if kind is Kind.RULES:
            return _RULES.validate_json(value)
        return _API_KEY.validate_json(value)
    except (ValidationError, WorkloadError) as exc:
        raise ValueError(str(exc)) from None


class EtcdConfigStore:
    """The :class:`~controlplane.contracts.ConfigSource` of the records half."""

    def __init__(self, etcd: aetcd.Client, keys: EtcdKeys) -> None:
        self._etcd = etcd
        self.keys = keys
        self._prefix = keys.prefix.encode()
        self._sections: dict[Kind, dict[str, tuple[Any, Stored]]] = {k: {} for k in Kind}
        self._revision = 0
        self._subscribers: list[Callable[[], None]] = []
        self._config: routing_pb2.RoutingConfig | None = None
        self._task: asyncio.Task[None] | None = None
        self.invalid_values = 0  # values refused since start (a metric reads it)
        self.loaded = False
        self._closing = False

    # --- ConfigSource -----------------------------------------------------------------

    def current(self) -> routing_pb2.RoutingConfig:
        if self._config is None:
            self._config = self._build_config()
        return self._config

    def subscribe(self, on_change: Callable[[], None]) -> None:
        self._subscribers.append(on_change)

    # --- lifecycle ----------------------------------------------------------------------

    async def start(self) -> None:
        """Create ``default`` if absent, load the config, then follow it."""
        await self._ensure_default()
        await self._load()
        self._task = asyncio.create_task(self._follow(), name="config-watch")

    async def aclose(self) -> None:
        task, self._task = self._task, None
        if task is None:
            return
        self._closing = True
        # aetcd's watch set-up can swallow a cancellation (asyncio.wait_for on 3.11), so
        # cancel until the task has really ended rather than awaiting it unbounded
        for _ in range(CLOSE_ATTEMPTS):
            task.cancel()
            done, _pending = await asyncio.wait({task}, timeout=CLOSE_WAIT_S)
            if done:
                return
        log.warning("the config watch did not stop")

    # --- reads and compare-and-swap writes (the admin API) -------------------------------

    def key(self, kind: Kind, name: str) -> str:
        if kind is Kind.WORKLOAD:
            return self.keys.workload(name)
        if kind is Kind.MODEL:
            return self.keys.model(name)
        if kind is Kind.API_KEY:
            return self.keys.api_key(name)
        return self.keys.rules()

    def _section_prefix(self, kind: Kind) -> str:
        prefixes = {
            Kind.WORKLOAD: self.keys.workloads_prefix(),
            Kind.MODEL: self.keys.models_prefix(),
            Kind.API_KEY: self.keys.api_keys_prefix(),
        }
        return prefixes.get(kind, self.keys.rules())

    async def read(self, kind: Kind, name: str = "") -> Stored | None:
        """The value stored now (not the local copy), or ``None``."""
        try:
            got = await self._etcd.get(self.key(kind, name).encode())
        except aetcd.ClientError as exc:
            raise Unavailable(f"etcd: {type(exc).__name__}") from None
        return None if got is None else Stored(got.value.decode(), got.mod_revision)

    async def read_all(self, kind: Kind) -> dict[str, Stored]:
        """Every value of one section stored now, by name."""
        prefix = self._section_prefix(kind)
        try:
            got = await self._etcd.get_prefix(prefix.encode())
        except aetcd.ClientError as exc:
            raise Unavailable(f"etcd: {type(exc).__name__}") from None
        found = {}
        for kv in got:
            with contextlib.suppress(InvalidName):
                name = self.keys.name_in(kv.key.decode(), prefix)
                found[name] = Stored(kv.value.decode(), kv.mod_revision)
        return found

    async def swap(self, kind: Kind, name: str, value: str | None, expect: int) -> int:
        """Put (or delete, for ``None``) if the key's mod revision is still ``expect``
        (0: the key must not exist); the new revision, else :class:`Conflict`."""
        key = self.key(kind, name).encode()
        ops = self._etcd.transactions
        change = ops.delete(key) if value is None else ops.put(key, value.encode())
        try:
            ok, responses = await self._etcd.transaction(
                compare=[ops.mod(key) == expect], success=[change], failure=[]
            )
        except aetcd.ClientError as exc:
            raise Unavailable(f"etcd: {type(exc).__name__}") from None
        if not ok:
            raise Conflict(f"{kind} {name!r} changed concurrently (expected revision {expect})")
        response = responses[0]
        header = response.response_put if value is not None else response.response_delete_range
        return int(header.header.revision)

    # --- the local copy ------------------------------------------------------------------

    async def _ensure_default(self) -> None:
        with contextlib.suppress(Conflict):  # the other instance was first: fine
            await self.swap(Kind.WORKLOAD, DEFAULT_WORKLOAD, default_workload_json(), 0)

    async def _load(self) -> None:
        got = await self._etcd.get_prefix(self._prefix)
        for section in self._sections.values():
            section.clear()
        for kv in got:
            self._apply(kv.key.decode(), kv.value, kv.mod_revision)
        self._revision = max(self._revision, got.header.revision)
        self.loaded = True
        self._changed()

    async def _follow(self) -> None:
        delay = 0.1
        while not self._closing:
            try:
                watch = await self._etcd.watch_prefix(
                    self._prefix, start_revision=self._revision + 1
                )
                async for event in watch:
                    value = None if event.kind == aetcd.EventKind.DELETE else event.kv.value
                    if self._apply(event.kv.key.decode(), value, event.kv.mod_revision):
                        self._changed()
                    delay = 0.1
            except aetcd.RevisionCompactedError:
                log.warning("config watch fell behind a compaction; reloading")
                await self._reload_quietly()
            except Exception as exc:  # etcd restarted or unreachable: resume from revision
                log.warning("config watch interrupted (%s); retrying", type(exc).__name__)
                await asyncio.sleep(delay)
                delay = min(delay * 2, WATCH_RETRY_MAX_S)

    async def _reload_quietly(self) -> None:
        with contextlib.suppress(aetcd.ClientError):
            await self._load()

    def _locate(self, key: str) -> tuple[Kind, str] | None:
        if key == self.keys.rules():
            return Kind.RULES, ""
        for kind in (Kind.WORKLOAD, Kind.MODEL, Kind.API_KEY):
            prefix = self._section_prefix(kind)
            if key.startswith(prefix):
                try:
                    return kind, self.keys.name_in(key, prefix)
                except InvalidName:
                    return None
        return None

    def _apply(self, key: str, value: bytes | None, mod_revision: int) -> bool:
        """Apply one key's new value (``None``: deleted); whether the config changed."""
        self._revision = max(self._revision, mod_revision)
        located = self._locate(key)
        if located is None:
            return False
        kind, name = located
        section = self._sections[kind]
        if value is None:
            return section.pop(name, None) is not None
        try:
            parsed = parse_value(kind, value)
        except ValueError as exc:
            self.invalid_values += 1
            log.warning("ignoring invalid %s %r at revision %d: %s", kind, name, mod_revision, exc)
            return False
        if kind is Kind.WORKLOAD and parsed.name != name:
            parsed = parsed.model_copy(update={"name": name})
        section[name] = (parsed, Stored(value.decode(), mod_revision))
        return True

    def _changed(self) -> None:
        self._config = None
        for callback in list(self._subscribers):
            try:
                callback()
            except Exception:  # one subscriber's bug must not starve the others
                log.exception("config subscriber failed")

    # --- what proxies get ------------------------------------------------------------------

    def workloads(self) -> dict[str, Workload]:
        """The live workloads by name (``default`` always among them)."""
        live = {name: parsed for name, (parsed, _) in self._sections[Kind.WORKLOAD].items()}
        live.setdefault(DEFAULT_WORKLOAD, KvCostWorkload.model_validate({"name": DEFAULT_WORKLOAD}))
        return live

    def models(self) -> dict[str, ModelSpec]:
        return {name: parsed for name, (parsed, _) in self._sections[Kind.MODEL].items()}

    def rules(self) -> RulesDocument:
        entry = self._sections[Kind.RULES].get("")
        return RulesDocument.model_validate({}) if entry is None else entry[0]

    def _build_config(self) -> routing_pb2.RoutingConfig:
        config = routing_pb2.RoutingConfig(revision=self._revision)
        for name, (_workload, stored) in sorted(self._sections[Kind.WORKLOAD].items()):
            config.workloads.add(
                name=name, policy_json=stored.value, mod_revision=stored.mod_revision
            )
        if DEFAULT_WORKLOAD not in self._sections[Kind.WORKLOAD]:
            config.workloads.add(name=DEFAULT_WORKLOAD, policy_json=default_workload_json())
        for name, (spec, stored) in sorted(self._sections[Kind.MODEL].items()):
            config.models.add(
                name=name,
                tokenizer=spec.tokenizer,
                block_size=spec.block_size,
                pool=spec.pool,
                model_json=stored.value,
                mod_revision=stored.mod_revision,
            )
        for _, (entry, _stored) in sorted(self._sections[Kind.API_KEY].items()):
            config.api_keys.add(
                key_sha256=entry.key_sha256,
                tenant=entry.tenant,
                default_workload=entry.default_workload,
                scopes=list(entry.scopes),
            )
        rules = self._sections[Kind.RULES].get("")
        config.rules_json = "" if rules is None else rules[1].value
        return config
