from kvcore.pb import events_pb2 as _events_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ReplicaStatus(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    REPLICA_STATUS_UNSPECIFIED: _ClassVar[ReplicaStatus]
    REPLICA_STATUS_HEALTHY: _ClassVar[ReplicaStatus]
    REPLICA_STATUS_DRAINING: _ClassVar[ReplicaStatus]
    REPLICA_STATUS_UNHEALTHY: _ClassVar[ReplicaStatus]
REPLICA_STATUS_UNSPECIFIED: ReplicaStatus
REPLICA_STATUS_HEALTHY: ReplicaStatus
REPLICA_STATUS_DRAINING: ReplicaStatus
REPLICA_STATUS_UNHEALTHY: ReplicaStatus

class WatchRequest(_message.Message):
    __slots__ = ("proxy_id", "pools", "have_epoch", "have_version", "residency_columns")
    PROXY_ID_FIELD_NUMBER: _ClassVar[int]
    POOLS_FIELD_NUMBER: _ClassVar[int]
    HAVE_EPOCH_FIELD_NUMBER: _ClassVar[int]
    HAVE_VERSION_FIELD_NUMBER: _ClassVar[int]
    RESIDENCY_COLUMNS_FIELD_NUMBER: _ClassVar[int]
    proxy_id: str
    pools: _containers.RepeatedScalarFieldContainer[str]
    have_epoch: int
    have_version: int
    residency_columns: bool
    def __init__(self, proxy_id: _Optional[str] = ..., pools: _Optional[_Iterable[str]] = ..., have_epoch: _Optional[int] = ..., have_version: _Optional[int] = ..., residency_columns: _Optional[bool] = ...) -> None: ...

class Workload(_message.Message):
    __slots__ = ("name", "policy_json", "mod_revision")
    NAME_FIELD_NUMBER: _ClassVar[int]
    POLICY_JSON_FIELD_NUMBER: _ClassVar[int]
    MOD_REVISION_FIELD_NUMBER: _ClassVar[int]
    name: str
    policy_json: str
    mod_revision: int
    def __init__(self, name: _Optional[str] = ..., policy_json: _Optional[str] = ..., mod_revision: _Optional[int] = ...) -> None: ...

class ApiKey(_message.Message):
    __slots__ = ("key_sha256", "tenant", "default_workload", "scopes")
    KEY_SHA256_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_WORKLOAD_FIELD_NUMBER: _ClassVar[int]
    SCOPES_FIELD_NUMBER: _ClassVar[int]
    key_sha256: str
    tenant: str
    default_workload: str
    scopes: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, key_sha256: _Optional[str] = ..., tenant: _Optional[str] = ..., default_workload: _Optional[str] = ..., scopes: _Optional[_Iterable[str]] = ...) -> None: ...

class Model(_message.Message):
    __slots__ = ("name", "tokenizer", "block_size", "pool", "model_json", "mod_revision")
    NAME_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    POOL_FIELD_NUMBER: _ClassVar[int]
    MODEL_JSON_FIELD_NUMBER: _ClassVar[int]
    MOD_REVISION_FIELD_NUMBER: _ClassVar[int]
    name: str
    tokenizer: str
    block_size: int
    pool: str
    model_json: str
    mod_revision: int
    def __init__(self, name: _Optional[str] = ..., tokenizer: _Optional[str] = ..., block_size: _Optional[int] = ..., pool: _Optional[str] = ..., model_json: _Optional[str] = ..., mod_revision: _Optional[int] = ...) -> None: ...

class RoutingConfig(_message.Message):
    __slots__ = ("revision", "workloads", "api_keys", "models", "rules_json")
    REVISION_FIELD_NUMBER: _ClassVar[int]
    WORKLOADS_FIELD_NUMBER: _ClassVar[int]
    API_KEYS_FIELD_NUMBER: _ClassVar[int]
    MODELS_FIELD_NUMBER: _ClassVar[int]
    RULES_JSON_FIELD_NUMBER: _ClassVar[int]
    revision: int
    workloads: _containers.RepeatedCompositeFieldContainer[Workload]
    api_keys: _containers.RepeatedCompositeFieldContainer[ApiKey]
    models: _containers.RepeatedCompositeFieldContainer[Model]
    rules_json: str
    def __init__(self, revision: _Optional[int] = ..., workloads: _Optional[_Iterable[_Union[Workload, _Mapping]]] = ..., api_keys: _Optional[_Iterable[_Union[ApiKey, _Mapping]]] = ..., models: _Optional[_Iterable[_Union[Model, _Mapping]]] = ..., rules_json: _Optional[str] = ...) -> None: ...

class Replica(_message.Message):
    __slots__ = ("ordinal", "replica_id", "pool", "base_url", "model", "served_names", "engine_kind", "block_size", "status", "load", "labels", "capacity_seqs", "state_incomplete", "engine_block_size", "role", "bootstrap_port", "warmup", "lora_adapters")
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
    ORDINAL_FIELD_NUMBER: _ClassVar[int]
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    POOL_FIELD_NUMBER: _ClassVar[int]
    BASE_URL_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    SERVED_NAMES_FIELD_NUMBER: _ClassVar[int]
    ENGINE_KIND_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_SEQS_FIELD_NUMBER: _ClassVar[int]
    STATE_INCOMPLETE_FIELD_NUMBER: _ClassVar[int]
    ENGINE_BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    BOOTSTRAP_PORT_FIELD_NUMBER: _ClassVar[int]
    WARMUP_FIELD_NUMBER: _ClassVar[int]
    LORA_ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    ordinal: int
    replica_id: str
    pool: str
    base_url: str
    model: str
    served_names: _containers.RepeatedScalarFieldContainer[str]
    engine_kind: _events_pb2.EngineKind
    block_size: int
    status: ReplicaStatus
    load: _events_pb2.LoadReport
    labels: _containers.ScalarMap[str, str]
    capacity_seqs: int
    state_incomplete: bool
    engine_block_size: int
    role: _events_pb2.ReplicaRole
    bootstrap_port: int
    warmup: WarmupState
    lora_adapters: _containers.ScalarMap[str, str]
    def __init__(self, ordinal: _Optional[int] = ..., replica_id: _Optional[str] = ..., pool: _Optional[str] = ..., base_url: _Optional[str] = ..., model: _Optional[str] = ..., served_names: _Optional[_Iterable[str]] = ..., engine_kind: _Optional[_Union[_events_pb2.EngineKind, str]] = ..., block_size: _Optional[int] = ..., status: _Optional[_Union[ReplicaStatus, str]] = ..., load: _Optional[_Union[_events_pb2.LoadReport, _Mapping]] = ..., labels: _Optional[_Mapping[str, str]] = ..., capacity_seqs: _Optional[int] = ..., state_incomplete: _Optional[bool] = ..., engine_block_size: _Optional[int] = ..., role: _Optional[_Union[_events_pb2.ReplicaRole, str]] = ..., bootstrap_port: _Optional[int] = ..., warmup: _Optional[_Union[WarmupState, _Mapping]] = ..., lora_adapters: _Optional[_Mapping[str, str]] = ...) -> None: ...

class WarmupState(_message.Message):
    __slots__ = ("warming", "pending_keys")
    WARMING_FIELD_NUMBER: _ClassVar[int]
    PENDING_KEYS_FIELD_NUMBER: _ClassVar[int]
    warming: bool
    pending_keys: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, warming: _Optional[bool] = ..., pending_keys: _Optional[_Iterable[int]] = ...) -> None: ...

class ReplicaBlocks(_message.Message):
    __slots__ = ("ordinal", "keys")
    ORDINAL_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    ordinal: int
    keys: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ordinal: _Optional[int] = ..., keys: _Optional[_Iterable[int]] = ...) -> None: ...

class ResidencyChange(_message.Message):
    __slots__ = ("ordinal", "cleared", "added", "removed")
    ORDINAL_FIELD_NUMBER: _ClassVar[int]
    CLEARED_FIELD_NUMBER: _ClassVar[int]
    ADDED_FIELD_NUMBER: _ClassVar[int]
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    ordinal: int
    cleared: bool
    added: _containers.RepeatedScalarFieldContainer[int]
    removed: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ordinal: _Optional[int] = ..., cleared: _Optional[bool] = ..., added: _Optional[_Iterable[int]] = ..., removed: _Optional[_Iterable[int]] = ...) -> None: ...

class ResidencyColumns(_message.Message):
    __slots__ = ("count", "words", "keys", "masks", "total_rows")
    COUNT_FIELD_NUMBER: _ClassVar[int]
    WORDS_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    MASKS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_ROWS_FIELD_NUMBER: _ClassVar[int]
    count: int
    words: int
    keys: bytes
    masks: bytes
    total_rows: int
    def __init__(self, count: _Optional[int] = ..., words: _Optional[int] = ..., keys: _Optional[bytes] = ..., masks: _Optional[bytes] = ..., total_rows: _Optional[int] = ...) -> None: ...

class PoolShard(_message.Message):
    __slots__ = ("pool", "shard", "leader_instance")
    POOL_FIELD_NUMBER: _ClassVar[int]
    SHARD_FIELD_NUMBER: _ClassVar[int]
    LEADER_INSTANCE_FIELD_NUMBER: _ClassVar[int]
    pool: str
    shard: str
    leader_instance: str
    def __init__(self, pool: _Optional[str] = ..., shard: _Optional[str] = ..., leader_instance: _Optional[str] = ...) -> None: ...

class SnapshotChunk(_message.Message):
    __slots__ = ("chunk_index", "last_chunk", "config", "replicas", "shards", "residency", "residency_columns")
    CHUNK_INDEX_FIELD_NUMBER: _ClassVar[int]
    LAST_CHUNK_FIELD_NUMBER: _ClassVar[int]
    CONFIG_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    SHARDS_FIELD_NUMBER: _ClassVar[int]
    RESIDENCY_FIELD_NUMBER: _ClassVar[int]
    RESIDENCY_COLUMNS_FIELD_NUMBER: _ClassVar[int]
    chunk_index: int
    last_chunk: bool
    config: RoutingConfig
    replicas: _containers.RepeatedCompositeFieldContainer[Replica]
    shards: _containers.RepeatedCompositeFieldContainer[PoolShard]
    residency: _containers.RepeatedCompositeFieldContainer[ReplicaBlocks]
    residency_columns: ResidencyColumns
    def __init__(self, chunk_index: _Optional[int] = ..., last_chunk: _Optional[bool] = ..., config: _Optional[_Union[RoutingConfig, _Mapping]] = ..., replicas: _Optional[_Iterable[_Union[Replica, _Mapping]]] = ..., shards: _Optional[_Iterable[_Union[PoolShard, _Mapping]]] = ..., residency: _Optional[_Iterable[_Union[ReplicaBlocks, _Mapping]]] = ..., residency_columns: _Optional[_Union[ResidencyColumns, _Mapping]] = ...) -> None: ...

class Delta(_message.Message):
    __slots__ = ("config", "replicas_upserted", "replicas_removed", "residency", "loads")
    CONFIG_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_UPSERTED_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_REMOVED_FIELD_NUMBER: _ClassVar[int]
    RESIDENCY_FIELD_NUMBER: _ClassVar[int]
    LOADS_FIELD_NUMBER: _ClassVar[int]
    config: RoutingConfig
    replicas_upserted: _containers.RepeatedCompositeFieldContainer[Replica]
    replicas_removed: _containers.RepeatedScalarFieldContainer[int]
    residency: _containers.RepeatedCompositeFieldContainer[ResidencyChange]
    loads: _containers.RepeatedCompositeFieldContainer[LoadUpdate]
    def __init__(self, config: _Optional[_Union[RoutingConfig, _Mapping]] = ..., replicas_upserted: _Optional[_Iterable[_Union[Replica, _Mapping]]] = ..., replicas_removed: _Optional[_Iterable[int]] = ..., residency: _Optional[_Iterable[_Union[ResidencyChange, _Mapping]]] = ..., loads: _Optional[_Iterable[_Union[LoadUpdate, _Mapping]]] = ...) -> None: ...

class LoadUpdate(_message.Message):
    __slots__ = ("ordinal", "load")
    ORDINAL_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    ordinal: int
    load: _events_pb2.LoadReport
    def __init__(self, ordinal: _Optional[int] = ..., load: _Optional[_Union[_events_pb2.LoadReport, _Mapping]] = ...) -> None: ...

class StateUpdate(_message.Message):
    __slots__ = ("epoch", "version", "snapshot", "delta")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_FIELD_NUMBER: _ClassVar[int]
    DELTA_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    version: int
    snapshot: SnapshotChunk
    delta: Delta
    def __init__(self, epoch: _Optional[int] = ..., version: _Optional[int] = ..., snapshot: _Optional[_Union[SnapshotChunk, _Mapping]] = ..., delta: _Optional[_Union[Delta, _Mapping]] = ...) -> None: ...

class UsageCounters(_message.Message):
    __slots__ = ("requests", "prompt_tokens", "predicted_cached_tokens", "measured_cached_tokens", "measured_requests", "errors")
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MEASURED_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MEASURED_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    ERRORS_FIELD_NUMBER: _ClassVar[int]
    requests: int
    prompt_tokens: int
    predicted_cached_tokens: int
    measured_cached_tokens: int
    measured_requests: int
    errors: int
    def __init__(self, requests: _Optional[int] = ..., prompt_tokens: _Optional[int] = ..., predicted_cached_tokens: _Optional[int] = ..., measured_cached_tokens: _Optional[int] = ..., measured_requests: _Optional[int] = ..., errors: _Optional[int] = ...) -> None: ...

class ReportRow(_message.Message):
    __slots__ = ("workload", "pool", "replica_id", "counters")
    WORKLOAD_FIELD_NUMBER: _ClassVar[int]
    POOL_FIELD_NUMBER: _ClassVar[int]
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    COUNTERS_FIELD_NUMBER: _ClassVar[int]
    workload: str
    pool: str
    replica_id: str
    counters: UsageCounters
    def __init__(self, workload: _Optional[str] = ..., pool: _Optional[str] = ..., replica_id: _Optional[str] = ..., counters: _Optional[_Union[UsageCounters, _Mapping]] = ...) -> None: ...

class ModelHealth(_message.Message):
    __slots__ = ("model", "tokenizer_mismatch", "detail")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_MISMATCH_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    model: str
    tokenizer_mismatch: bool
    detail: str
    def __init__(self, model: _Optional[str] = ..., tokenizer_mismatch: _Optional[bool] = ..., detail: _Optional[str] = ...) -> None: ...

class ProxyReport(_message.Message):
    __slots__ = ("proxy_id", "ts", "interval_s", "rows", "models", "hot_prefixes", "learned_rates")
    PROXY_ID_FIELD_NUMBER: _ClassVar[int]
    TS_FIELD_NUMBER: _ClassVar[int]
    INTERVAL_S_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    MODELS_FIELD_NUMBER: _ClassVar[int]
    HOT_PREFIXES_FIELD_NUMBER: _ClassVar[int]
    LEARNED_RATES_FIELD_NUMBER: _ClassVar[int]
    proxy_id: str
    ts: float
    interval_s: float
    rows: _containers.RepeatedCompositeFieldContainer[ReportRow]
    models: _containers.RepeatedCompositeFieldContainer[ModelHealth]
    hot_prefixes: _containers.RepeatedCompositeFieldContainer[HotPrefix]
    learned_rates: _containers.RepeatedCompositeFieldContainer[LearnedRate]
    def __init__(self, proxy_id: _Optional[str] = ..., ts: _Optional[float] = ..., interval_s: _Optional[float] = ..., rows: _Optional[_Iterable[_Union[ReportRow, _Mapping]]] = ..., models: _Optional[_Iterable[_Union[ModelHealth, _Mapping]]] = ..., hot_prefixes: _Optional[_Iterable[_Union[HotPrefix, _Mapping]]] = ..., learned_rates: _Optional[_Iterable[_Union[LearnedRate, _Mapping]]] = ...) -> None: ...

class LearnedRate(_message.Message):
    __slots__ = ("replica_id", "prefill_tokens_per_s", "line_tokens_per_s", "line_fixed_s", "slowness", "engine_tokens_per_s")
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    PREFILL_TOKENS_PER_S_FIELD_NUMBER: _ClassVar[int]
    LINE_TOKENS_PER_S_FIELD_NUMBER: _ClassVar[int]
    LINE_FIXED_S_FIELD_NUMBER: _ClassVar[int]
    SLOWNESS_FIELD_NUMBER: _ClassVar[int]
    ENGINE_TOKENS_PER_S_FIELD_NUMBER: _ClassVar[int]
    replica_id: str
    prefill_tokens_per_s: float
    line_tokens_per_s: float
    line_fixed_s: float
    slowness: float
    engine_tokens_per_s: float
    def __init__(self, replica_id: _Optional[str] = ..., prefill_tokens_per_s: _Optional[float] = ..., line_tokens_per_s: _Optional[float] = ..., line_fixed_s: _Optional[float] = ..., slowness: _Optional[float] = ..., engine_tokens_per_s: _Optional[float] = ...) -> None: ...

class HotPrefix(_message.Message):
    __slots__ = ("workload", "model", "token_ids", "key", "requests_per_s", "block_size")
    WORKLOAD_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_PER_S_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    workload: str
    model: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    key: int
    requests_per_s: float
    block_size: int
    def __init__(self, workload: _Optional[str] = ..., model: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., key: _Optional[int] = ..., requests_per_s: _Optional[float] = ..., block_size: _Optional[int] = ...) -> None: ...

class ReportAck(_message.Message):
    __slots__ = ("reports",)
    REPORTS_FIELD_NUMBER: _ClassVar[int]
    reports: int
    def __init__(self, reports: _Optional[int] = ...) -> None: ...
