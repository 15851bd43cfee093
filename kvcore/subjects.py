"""NATS subjects and etcd keys: the one place that builds and parses them.

Every id that becomes a subject token or a key segment (pool, replica, workload, shard)
must match ``[A-Za-z0-9_-]+``: NATS gives ``.``, ``*`` and ``>`` meaning and etcd keys
are matched by prefix, so an id like ``a.b`` or ``a/b`` would silently address something
else. Builders raise :class:`InvalidName` instead.

Subjects (core NATS)::

    kvroute.v1.announce.<pool>            ReplicaAnnounce
    kvroute.v1.events.<pool>.<replica>    KvEventBatch
    kvroute.v1.load.<pool>.<replica>      LoadReport
    kvroute.v1.resync.<pool>.<replica>    ResyncRequest -> ResyncReply

etcd keys, below a configurable prefix (default ``/kvroute/v1/``)::

    workloads/<name>                      workload policy (JSON)
    models/<name>                         model entry (JSON: tokenizer, block size, pool)
    rules                                 classification rules and default workload (JSON)
    api-keys/<id>                         a hashed inference API key (JSON)
    pools/<pool>/replicas/<replica>       membership, on the leader's lease
    pools/<pool>/shard                    which shard serves the pool
    shards/<shard>/leader                 leader election
    shards/<shard>/proxies/<n>            a watching proxy's place (its id), on its
                                          control plane's lease
    draining/<pool>/<replica>             an operator drained the replica (no lease)
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import StrEnum

SUBJECT_ROOT = "kvroute.v1"
DEFAULT_ETCD_PREFIX = "/kvroute/v1/"
MAX_NAME_LENGTH = 128
PROXY_PLACE_METADATA = "kvroute-proxy-place"
"""gRPC initial metadata of a ``RoutingState.Watch`` stream: the watching proxy's place
(``0``, ``1``, ...) among the proxies of the shard, when the control plane could give one."""
_NAME = re.compile(r"[A-Za-z0-9_-]+\Z")


class InvalidName(ValueError):
    """An id that cannot be used as a subject token or key segment."""


class SubjectKind(StrEnum):
    ANNOUNCE = "announce"
    EVENTS = "events"
    LOAD = "load"
    RESYNC = "resync"


def check_name(what: str, value: str) -> str:
    """Return ``value`` if it is a valid id, else raise :class:`InvalidName` naming ``what``."""
    if not isinstance(value, str) or not _NAME.match(value):
        raise InvalidName(f"{what} {value!r} must be non-empty and use only A-Z a-z 0-9 _ -")
    if len(value) > MAX_NAME_LENGTH:
        raise InvalidName(f"{what} {value!r} is longer than {MAX_NAME_LENGTH} characters")
    return value


def announce_subject(pool: str) -> str:
    return f"{SUBJECT_ROOT}.announce.{check_name('pool', pool)}"


def _replica_subject(kind: SubjectKind, pool: str, replica: str) -> str:
    return f"{SUBJECT_ROOT}.{kind}.{check_name('pool', pool)}.{check_name('replica', replica)}"


def events_subject(pool: str, replica: str) -> str:
    return _replica_subject(SubjectKind.EVENTS, pool, replica)


def load_subject(pool: str, replica: str) -> str:
    return _replica_subject(SubjectKind.LOAD, pool, replica)


def resync_subject(pool: str, replica: str) -> str:
    return _replica_subject(SubjectKind.RESYNC, pool, replica)


def pool_subscriptions(pool: str | None) -> tuple[str, ...]:
    """What a control plane subscribes to for one pool, or for every pool (``None``).

    The resync subjects are excluded: the control plane asks them, sidecars answer.
    """
    if pool is None:
        return tuple(f"{SUBJECT_ROOT}.{k}.>" for k in SubjectKind if k is not SubjectKind.RESYNC)
    check_name("pool", pool)
    return (
        announce_subject(pool),
        f"{SUBJECT_ROOT}.{SubjectKind.EVENTS}.{pool}.*",
        f"{SUBJECT_ROOT}.{SubjectKind.LOAD}.{pool}.*",
    )


@dataclass(frozen=True, slots=True)
class Subject:
    kind: SubjectKind
    pool: str
    replica: str | None


def parse_subject(subject: str) -> Subject:
    """Split a kvroute subject into its parts; raise :class:`InvalidName` if it is not one."""
    parts = subject.split(".")
    root = ".".join(parts[:2])
    if root != SUBJECT_ROOT or len(parts) < 4:
        raise InvalidName(f"subject {subject!r} is not a kvroute.v1 subject")
    try:
        kind = SubjectKind(parts[2])
    except ValueError:
        raise InvalidName(f"subject {subject!r} has unknown kind {parts[2]!r}") from None
    expected = 4 if kind is SubjectKind.ANNOUNCE else 5
    if len(parts) != expected:
        raise InvalidName(f"subject {subject!r} should have {expected} tokens")
    pool = check_name("pool", parts[3])
    replica = check_name("replica", parts[4]) if expected == 5 else None
    return Subject(kind, pool, replica)


@dataclass(frozen=True, slots=True)
class EtcdKeys:
    """Builds the etcd keys under one prefix (``/kvroute/v1/`` unless configured)."""

    prefix: str = DEFAULT_ETCD_PREFIX

    def __post_init__(self) -> None:
        if not (self.prefix.startswith("/") and self.prefix.endswith("/")):
            raise InvalidName(f"etcd prefix {self.prefix!r} must start and end with '/'")

    def workloads_prefix(self) -> str:
        return f"{self.prefix}workloads/"

    def workload(self, name: str) -> str:
        return f"{self.workloads_prefix()}{check_name('workload', name)}"

    def models_prefix(self) -> str:
        return f"{self.prefix}models/"

    def model(self, name: str) -> str:
        return f"{self.models_prefix()}{check_name('model', name)}"

    def rules(self) -> str:
        return f"{self.prefix}rules"

    def api_keys_prefix(self) -> str:
        return f"{self.prefix}api-keys/"

    def api_key(self, key_id: str) -> str:
        return f"{self.api_keys_prefix()}{check_name('api key id', key_id)}"

    def replicas_prefix(self, pool: str) -> str:
        return f"{self.prefix}pools/{check_name('pool', pool)}/replicas/"

    def replica(self, pool: str, replica: str) -> str:
        return f"{self.replicas_prefix(pool)}{check_name('replica', replica)}"

    def pool_shard(self, pool: str) -> str:
        return f"{self.prefix}pools/{check_name('pool', pool)}/shard"

    def shard_leader(self, shard: str) -> str:
        return f"{self.prefix}shards/{check_name('shard', shard)}/leader"

    def proxy_places_prefix(self, shard: str) -> str:
        return f"{self.prefix}shards/{check_name('shard', shard)}/proxies/"

    def drains_prefix(self) -> str:
        return f"{self.prefix}draining/"

    def replica_drain(self, pool: str, replica: str) -> str:
        return self._pool_replica(self.drains_prefix(), pool, replica)

    def drain_parts(self, key: str) -> tuple[str, str]:
        """``(pool, replica)`` of a key made by :meth:`replica_drain`."""
        return self._pool_replica_parts(key, self.drains_prefix())

    def warming_prefix(self) -> str:
        return f"{self.prefix}warming/"

    def replica_warming(self, pool: str, replica: str) -> str:
        return self._pool_replica(self.warming_prefix(), pool, replica)

    def warming_parts(self, key: str) -> tuple[str, str]:
        """``(pool, replica)`` of a key made by :meth:`replica_warming`."""
        return self._pool_replica_parts(key, self.warming_prefix())

    @staticmethod
    def _pool_replica(prefix: str, pool: str, replica: str) -> str:
        return f"{prefix}{check_name('pool', pool)}/{check_name('replica', replica)}"

    def _pool_replica_parts(self, key: str, prefix: str) -> tuple[str, str]:
        pool, _, replica = self.name_in_path(key, prefix).partition("/")
        return check_name("pool", pool), check_name("replica", replica)

    def name_in_path(self, key: str, prefix: str) -> str:
        if not key.startswith(prefix):
            raise InvalidName(f"etcd key {key!r} is not below {prefix!r}")
        return key[len(prefix) :]

    def name_in(self, key: str, prefix: str) -> str:
        """The trailing id of ``key`` below ``prefix``, validated."""
        if not key.startswith(prefix):
            raise InvalidName(f"etcd key {key!r} is not below {prefix!r}")
        return check_name("key segment", key[len(prefix) :])
