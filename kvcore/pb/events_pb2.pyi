from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class EngineKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ENGINE_KIND_UNSPECIFIED: _ClassVar[EngineKind]
    ENGINE_KIND_VLLM: _ClassVar[EngineKind]
    ENGINE_KIND_SGLANG: _ClassVar[EngineKind]

class ReplicaRole(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    REPLICA_ROLE_BOTH: _ClassVar[ReplicaRole]
    REPLICA_ROLE_PREFILL: _ClassVar[ReplicaRole]
    REPLICA_ROLE_DECODE: _ClassVar[ReplicaRole]

class Medium(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    MEDIUM_GPU: _ClassVar[Medium]
    MEDIUM_CPU: _ClassVar[Medium]
    MEDIUM_DISK: _ClassVar[Medium]
    MEDIUM_OTHER: _ClassVar[Medium]
ENGINE_KIND_UNSPECIFIED: EngineKind
ENGINE_KIND_VLLM: EngineKind
ENGINE_KIND_SGLANG: EngineKind
REPLICA_ROLE_BOTH: ReplicaRole
REPLICA_ROLE_PREFILL: ReplicaRole
REPLICA_ROLE_DECODE: ReplicaRole
MEDIUM_GPU: Medium
MEDIUM_CPU: Medium
MEDIUM_DISK: Medium
MEDIUM_OTHER: Medium

class ReplicaAnnounce(_message.Message):
    __slots__ = ("replica_id", "pool", "base_url", "model", "served_names", "engine_kind", "block_size", "engine_block_size", "capacity_blocks", "sidecar_epoch", "labels", "draining", "state_incomplete", "ts", "role", "bootstrap_port", "lora_adapters")
    class LabelsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    class LoraAdaptersEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    POOL_FIELD_NUMBER: _ClassVar[int]
    BASE_URL_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    SERVED_NAMES_FIELD_NUMBER: _ClassVar[int]
    ENGINE_KIND_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    ENGINE_BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    SIDECAR_EPOCH_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    STATE_INCOMPLETE_FIELD_NUMBER: _ClassVar[int]
    TS_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    BOOTSTRAP_PORT_FIELD_NUMBER: _ClassVar[int]
    LORA_ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    replica_id: str
    pool: str
    base_url: str
    model: str
    served_names: _containers.RepeatedScalarFieldContainer[str]
    engine_kind: EngineKind
    block_size: int
    engine_block_size: int
    capacity_blocks: int
    sidecar_epoch: int
    labels: _containers.ScalarMap[str, str]
    draining: bool
    state_incomplete: bool
    ts: float
    role: ReplicaRole
    bootstrap_port: int
    lora_adapters: _containers.ScalarMap[str, str]
    def __init__(self, replica_id: _Optional[str] = ..., pool: _Optional[str] = ..., base_url: _Optional[str] = ..., model: _Optional[str] = ..., served_names: _Optional[_Iterable[str]] = ..., engine_kind: _Optional[_Union[EngineKind, str]] = ..., block_size: _Optional[int] = ..., engine_block_size: _Optional[int] = ..., capacity_blocks: _Optional[int] = ..., sidecar_epoch: _Optional[int] = ..., labels: _Optional[_Mapping[str, str]] = ..., draining: _Optional[bool] = ..., state_incomplete: _Optional[bool] = ..., ts: _Optional[float] = ..., role: _Optional[_Union[ReplicaRole, str]] = ..., bootstrap_port: _Optional[int] = ..., lora_adapters: _Optional[_Mapping[str, str]] = ...) -> None: ...

class BlocksStored(_message.Message):
    __slots__ = ("parent_key", "keys", "medium")
    PARENT_KEY_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    MEDIUM_FIELD_NUMBER: _ClassVar[int]
    parent_key: int
    keys: _containers.RepeatedScalarFieldContainer[int]
    medium: Medium
    def __init__(self, parent_key: _Optional[int] = ..., keys: _Optional[_Iterable[int]] = ..., medium: _Optional[_Union[Medium, str]] = ...) -> None: ...

class BlocksRemoved(_message.Message):
    __slots__ = ("keys", "medium")
    KEYS_FIELD_NUMBER: _ClassVar[int]
    MEDIUM_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedScalarFieldContainer[int]
    medium: Medium
    def __init__(self, keys: _Optional[_Iterable[int]] = ..., medium: _Optional[_Union[Medium, str]] = ...) -> None: ...

class AllBlocksCleared(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class KvEvent(_message.Message):
    __slots__ = ("stored", "removed", "cleared")
    STORED_FIELD_NUMBER: _ClassVar[int]
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    CLEARED_FIELD_NUMBER: _ClassVar[int]
    stored: BlocksStored
    removed: BlocksRemoved
    cleared: AllBlocksCleared
    def __init__(self, stored: _Optional[_Union[BlocksStored, _Mapping]] = ..., removed: _Optional[_Union[BlocksRemoved, _Mapping]] = ..., cleared: _Optional[_Union[AllBlocksCleared, _Mapping]] = ...) -> None: ...

class KvEventBatch(_message.Message):
    __slots__ = ("replica_id", "pool", "epoch", "seq", "events", "snapshot", "snapshot_done", "snapshot_id", "ts")
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    POOL_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_DONE_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_ID_FIELD_NUMBER: _ClassVar[int]
    TS_FIELD_NUMBER: _ClassVar[int]
    replica_id: str
    pool: str
    epoch: int
    seq: int
    events: _containers.RepeatedCompositeFieldContainer[KvEvent]
    snapshot: bool
    snapshot_done: bool
    snapshot_id: int
    ts: float
    def __init__(self, replica_id: _Optional[str] = ..., pool: _Optional[str] = ..., epoch: _Optional[int] = ..., seq: _Optional[int] = ..., events: _Optional[_Iterable[_Union[KvEvent, _Mapping]]] = ..., snapshot: _Optional[bool] = ..., snapshot_done: _Optional[bool] = ..., snapshot_id: _Optional[int] = ..., ts: _Optional[float] = ...) -> None: ...

class LoadReport(_message.Message):
    __slots__ = ("replica_id", "pool", "epoch", "running", "waiting", "kv_usage", "prefix_cache_queries", "prefix_cache_hits", "engine_up", "ts", "prefill_requests", "prefill_seconds", "prefill_computed_tokens", "queue_seconds")
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    POOL_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    WAITING_FIELD_NUMBER: _ClassVar[int]
    KV_USAGE_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_QUERIES_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_HITS_FIELD_NUMBER: _ClassVar[int]
    ENGINE_UP_FIELD_NUMBER: _ClassVar[int]
    TS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_COMPUTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    QUEUE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    replica_id: str
    pool: str
    epoch: int
    running: int
    waiting: int
    kv_usage: float
    prefix_cache_queries: int
    prefix_cache_hits: int
    engine_up: bool
    ts: float
    prefill_requests: int
    prefill_seconds: float
    prefill_computed_tokens: int
    queue_seconds: float
    def __init__(self, replica_id: _Optional[str] = ..., pool: _Optional[str] = ..., epoch: _Optional[int] = ..., running: _Optional[int] = ..., waiting: _Optional[int] = ..., kv_usage: _Optional[float] = ..., prefix_cache_queries: _Optional[int] = ..., prefix_cache_hits: _Optional[int] = ..., engine_up: _Optional[bool] = ..., ts: _Optional[float] = ..., prefill_requests: _Optional[int] = ..., prefill_seconds: _Optional[float] = ..., prefill_computed_tokens: _Optional[int] = ..., queue_seconds: _Optional[float] = ...) -> None: ...

class ResyncRequest(_message.Message):
    __slots__ = ("requester", "reason", "snapshot_id")
    REQUESTER_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_ID_FIELD_NUMBER: _ClassVar[int]
    requester: str
    reason: str
    snapshot_id: int
    def __init__(self, requester: _Optional[str] = ..., reason: _Optional[str] = ..., snapshot_id: _Optional[int] = ...) -> None: ...

class ResyncReply(_message.Message):
    __slots__ = ("accepted", "epoch", "first_seq", "error")
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    FIRST_SEQ_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    accepted: bool
    epoch: int
    first_seq: int
    error: str
    def __init__(self, accepted: _Optional[bool] = ..., epoch: _Optional[int] = ..., first_seq: _Optional[int] = ..., error: _Optional[str] = ...) -> None: ...
