from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Tier(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TIER_UNSPECIFIED: _ClassVar[Tier]
    TIER_GPU: _ClassVar[Tier]
    TIER_HOST: _ClassVar[Tier]
    TIER_DISK: _ClassVar[Tier]
    TIER_CLUSTER: _ClassVar[Tier]

class Transport(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TRANSPORT_UNSPECIFIED: _ClassVar[Transport]
    TRANSPORT_SHM: _ClassVar[Transport]
    TRANSPORT_STREAM: _ClassVar[Transport]

class ChecksumAlgo(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    CHECKSUM_NONE: _ClassVar[ChecksumAlgo]
    CHECKSUM_CRC32: _ClassVar[ChecksumAlgo]
    CHECKSUM_XXH3_64: _ClassVar[ChecksumAlgo]

class SessionEnd(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SESSION_END_UNSPECIFIED: _ClassVar[SessionEnd]
    SESSION_END_CLOSED: _ClassVar[SessionEnd]
    SESSION_END_EXPIRED: _ClassVar[SessionEnd]

class SlotStatus(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SLOT_STATUS_UNSPECIFIED: _ClassVar[SlotStatus]
    SLOT_RESERVED: _ClassVar[SlotStatus]
    SLOT_PRESENT: _ClassVar[SlotStatus]
    SLOT_IN_FLIGHT: _ClassVar[SlotStatus]
    SLOT_NOT_ADMITTED: _ClassVar[SlotStatus]
TIER_UNSPECIFIED: Tier
TIER_GPU: Tier
TIER_HOST: Tier
TIER_DISK: Tier
TIER_CLUSTER: Tier
TRANSPORT_UNSPECIFIED: Transport
TRANSPORT_SHM: Transport
TRANSPORT_STREAM: Transport
CHECKSUM_NONE: ChecksumAlgo
CHECKSUM_CRC32: ChecksumAlgo
CHECKSUM_XXH3_64: ChecksumAlgo
SESSION_END_UNSPECIFIED: SessionEnd
SESSION_END_CLOSED: SessionEnd
SESSION_END_EXPIRED: SessionEnd
SLOT_STATUS_UNSPECIFIED: SlotStatus
SLOT_RESERVED: SlotStatus
SLOT_PRESENT: SlotStatus
SLOT_IN_FLIGHT: SlotStatus
SLOT_NOT_ADMITTED: SlotStatus

class NamespaceDescriptor(_message.Message):
    __slots__ = ("model_id", "model_revision", "dtype", "kv_layout", "block_tokens", "block_bytes", "tp_rank", "tp_size", "cache_salt", "lora_tag")
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_REVISION_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    KV_LAYOUT_FIELD_NUMBER: _ClassVar[int]
    BLOCK_TOKENS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_BYTES_FIELD_NUMBER: _ClassVar[int]
    TP_RANK_FIELD_NUMBER: _ClassVar[int]
    TP_SIZE_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    LORA_TAG_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    model_revision: str
    dtype: str
    kv_layout: str
    block_tokens: int
    block_bytes: int
    tp_rank: int
    tp_size: int
    cache_salt: str
    lora_tag: str
    def __init__(self, model_id: _Optional[str] = ..., model_revision: _Optional[str] = ..., dtype: _Optional[str] = ..., kv_layout: _Optional[str] = ..., block_tokens: _Optional[int] = ..., block_bytes: _Optional[int] = ..., tp_rank: _Optional[int] = ..., tp_size: _Optional[int] = ..., cache_salt: _Optional[str] = ..., lora_tag: _Optional[str] = ...) -> None: ...

class ShmArena(_message.Message):
    __slots__ = ("path", "size_bytes", "page_bytes", "arena_id")
    PATH_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    PAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    ARENA_ID_FIELD_NUMBER: _ClassVar[int]
    path: str
    size_bytes: int
    page_bytes: int
    arena_id: bytes
    def __init__(self, path: _Optional[str] = ..., size_bytes: _Optional[int] = ..., page_bytes: _Optional[int] = ..., arena_id: _Optional[bytes] = ...) -> None: ...

class RegisterSessionRequest(_message.Message):
    __slots__ = ("instance_id", "namespace")
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    instance_id: str
    namespace: NamespaceDescriptor
    def __init__(self, instance_id: _Optional[str] = ..., namespace: _Optional[_Union[NamespaceDescriptor, _Mapping]] = ...) -> None: ...

class RegisterSessionResponse(_message.Message):
    __slots__ = ("session_id", "lease_ttl_seconds", "namespace_id", "arena", "key_bytes", "max_keys_per_call", "max_message_bytes")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_TTL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_ID_FIELD_NUMBER: _ClassVar[int]
    ARENA_FIELD_NUMBER: _ClassVar[int]
    KEY_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_KEYS_PER_CALL_FIELD_NUMBER: _ClassVar[int]
    MAX_MESSAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    lease_ttl_seconds: float
    namespace_id: bytes
    arena: ShmArena
    key_bytes: int
    max_keys_per_call: int
    max_message_bytes: int
    def __init__(self, session_id: _Optional[str] = ..., lease_ttl_seconds: _Optional[float] = ..., namespace_id: _Optional[bytes] = ..., arena: _Optional[_Union[ShmArena, _Mapping]] = ..., key_bytes: _Optional[int] = ..., max_keys_per_call: _Optional[int] = ..., max_message_bytes: _Optional[int] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class HeartbeatResponse(_message.Message):
    __slots__ = ("lease_ttl_seconds",)
    LEASE_TTL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    lease_ttl_seconds: float
    def __init__(self, lease_ttl_seconds: _Optional[float] = ...) -> None: ...

class CloseSessionRequest(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class CloseSessionResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WatchSessionRequest(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class SessionEvent(_message.Message):
    __slots__ = ("ended",)
    ENDED_FIELD_NUMBER: _ClassVar[int]
    ended: SessionEnd
    def __init__(self, ended: _Optional[_Union[SessionEnd, str]] = ...) -> None: ...

class MatchRequest(_message.Message):
    __slots__ = ("session_id", "keys", "lease", "blocks", "report_use", "columns")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    LEASE_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    REPORT_USE_FIELD_NUMBER: _ClassVar[int]
    COLUMNS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    lease: bool
    blocks: bool
    report_use: bool
    columns: bool
    def __init__(self, session_id: _Optional[str] = ..., keys: _Optional[_Iterable[bytes]] = ..., lease: _Optional[bool] = ..., blocks: _Optional[bool] = ..., report_use: _Optional[bool] = ..., columns: _Optional[bool] = ...) -> None: ...

class MatchResponse(_message.Message):
    __slots__ = ("matched", "tiers", "lease_id", "blocks", "gpu_matched", "gpu_engine", "columns")
    MATCHED_FIELD_NUMBER: _ClassVar[int]
    TIERS_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    GPU_MATCHED_FIELD_NUMBER: _ClassVar[int]
    GPU_ENGINE_FIELD_NUMBER: _ClassVar[int]
    COLUMNS_FIELD_NUMBER: _ClassVar[int]
    matched: int
    tiers: _containers.RepeatedScalarFieldContainer[Tier]
    lease_id: int
    blocks: _containers.RepeatedCompositeFieldContainer[BlockRef]
    gpu_matched: int
    gpu_engine: str
    columns: BlockColumns
    def __init__(self, matched: _Optional[int] = ..., tiers: _Optional[_Iterable[_Union[Tier, str]]] = ..., lease_id: _Optional[int] = ..., blocks: _Optional[_Iterable[_Union[BlockRef, _Mapping]]] = ..., gpu_matched: _Optional[int] = ..., gpu_engine: _Optional[str] = ..., columns: _Optional[_Union[BlockColumns, _Mapping]] = ...) -> None: ...

class Extent(_message.Message):
    __slots__ = ("offset", "length")
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    offset: int
    length: int
    def __init__(self, offset: _Optional[int] = ..., length: _Optional[int] = ...) -> None: ...

class BlockRef(_message.Message):
    __slots__ = ("key", "extents", "checksum_algo", "checksum")
    KEY_FIELD_NUMBER: _ClassVar[int]
    EXTENTS_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_ALGO_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    key: bytes
    extents: _containers.RepeatedCompositeFieldContainer[Extent]
    checksum_algo: ChecksumAlgo
    checksum: int
    def __init__(self, key: _Optional[bytes] = ..., extents: _Optional[_Iterable[_Union[Extent, _Mapping]]] = ..., checksum_algo: _Optional[_Union[ChecksumAlgo, str]] = ..., checksum: _Optional[int] = ...) -> None: ...

class LoadRequest(_message.Message):
    __slots__ = ("session_id", "lease_id", "pack_blocks", "keys", "report_use", "columns")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    PACK_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    REPORT_USE_FIELD_NUMBER: _ClassVar[int]
    COLUMNS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    lease_id: int
    pack_blocks: bool
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    report_use: bool
    columns: bool
    def __init__(self, session_id: _Optional[str] = ..., lease_id: _Optional[int] = ..., pack_blocks: _Optional[bool] = ..., keys: _Optional[_Iterable[bytes]] = ..., report_use: _Optional[bool] = ..., columns: _Optional[bool] = ...) -> None: ...

class LoadResponse(_message.Message):
    __slots__ = ("blocks", "columns")
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    COLUMNS_FIELD_NUMBER: _ClassVar[int]
    blocks: _containers.RepeatedCompositeFieldContainer[BlockRef]
    columns: BlockColumns
    def __init__(self, blocks: _Optional[_Iterable[_Union[BlockRef, _Mapping]]] = ..., columns: _Optional[_Union[BlockColumns, _Mapping]] = ...) -> None: ...

class BlockColumns(_message.Message):
    __slots__ = ("key", "checksum_algo", "checksum", "extent_count", "offset", "length")
    KEY_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_ALGO_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    EXTENT_COUNT_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    key: _containers.RepeatedScalarFieldContainer[bytes]
    checksum_algo: _containers.RepeatedScalarFieldContainer[ChecksumAlgo]
    checksum: _containers.RepeatedScalarFieldContainer[int]
    extent_count: _containers.RepeatedScalarFieldContainer[int]
    offset: _containers.RepeatedScalarFieldContainer[int]
    length: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, key: _Optional[_Iterable[bytes]] = ..., checksum_algo: _Optional[_Iterable[_Union[ChecksumAlgo, str]]] = ..., checksum: _Optional[_Iterable[int]] = ..., extent_count: _Optional[_Iterable[int]] = ..., offset: _Optional[_Iterable[int]] = ..., length: _Optional[_Iterable[int]] = ...) -> None: ...

class BlockChunk(_message.Message):
    __slots__ = ("index", "offset", "data", "checksum_algo", "checksum", "checksums", "lease_id", "matched")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_ALGO_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    CHECKSUMS_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    MATCHED_FIELD_NUMBER: _ClassVar[int]
    index: int
    offset: int
    data: bytes
    checksum_algo: ChecksumAlgo
    checksum: int
    checksums: _containers.RepeatedScalarFieldContainer[int]
    lease_id: int
    matched: int
    def __init__(self, index: _Optional[int] = ..., offset: _Optional[int] = ..., data: _Optional[bytes] = ..., checksum_algo: _Optional[_Union[ChecksumAlgo, str]] = ..., checksum: _Optional[int] = ..., checksums: _Optional[_Iterable[int]] = ..., lease_id: _Optional[int] = ..., matched: _Optional[int] = ...) -> None: ...

class ReserveSaveRequest(_message.Message):
    __slots__ = ("session_id", "keys", "transport", "parent_key", "columns")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    PARENT_KEY_FIELD_NUMBER: _ClassVar[int]
    COLUMNS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    transport: Transport
    parent_key: bytes
    columns: bool
    def __init__(self, session_id: _Optional[str] = ..., keys: _Optional[_Iterable[bytes]] = ..., transport: _Optional[_Union[Transport, str]] = ..., parent_key: _Optional[bytes] = ..., columns: _Optional[bool] = ...) -> None: ...

class SaveSlot(_message.Message):
    __slots__ = ("status", "extents")
    STATUS_FIELD_NUMBER: _ClassVar[int]
    EXTENTS_FIELD_NUMBER: _ClassVar[int]
    status: SlotStatus
    extents: _containers.RepeatedCompositeFieldContainer[Extent]
    def __init__(self, status: _Optional[_Union[SlotStatus, str]] = ..., extents: _Optional[_Iterable[_Union[Extent, _Mapping]]] = ...) -> None: ...

class ReserveSaveResponse(_message.Message):
    __slots__ = ("reservation_id", "slots", "expires_in_seconds", "pack_writes", "columns")
    RESERVATION_ID_FIELD_NUMBER: _ClassVar[int]
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_IN_SECONDS_FIELD_NUMBER: _ClassVar[int]
    PACK_WRITES_FIELD_NUMBER: _ClassVar[int]
    COLUMNS_FIELD_NUMBER: _ClassVar[int]
    reservation_id: int
    slots: _containers.RepeatedCompositeFieldContainer[SaveSlot]
    expires_in_seconds: float
    pack_writes: bool
    columns: SlotColumns
    def __init__(self, reservation_id: _Optional[int] = ..., slots: _Optional[_Iterable[_Union[SaveSlot, _Mapping]]] = ..., expires_in_seconds: _Optional[float] = ..., pack_writes: _Optional[bool] = ..., columns: _Optional[_Union[SlotColumns, _Mapping]] = ...) -> None: ...

class SlotColumns(_message.Message):
    __slots__ = ("status", "extent_count", "offset", "length")
    STATUS_FIELD_NUMBER: _ClassVar[int]
    EXTENT_COUNT_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    status: _containers.RepeatedScalarFieldContainer[SlotStatus]
    extent_count: _containers.RepeatedScalarFieldContainer[int]
    offset: _containers.RepeatedScalarFieldContainer[int]
    length: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, status: _Optional[_Iterable[_Union[SlotStatus, str]]] = ..., extent_count: _Optional[_Iterable[int]] = ..., offset: _Optional[_Iterable[int]] = ..., length: _Optional[_Iterable[int]] = ...) -> None: ...

class WriteChunk(_message.Message):
    __slots__ = ("session_id", "reservation_id", "index", "offset", "data")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    RESERVATION_ID_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    reservation_id: int
    index: int
    offset: int
    data: bytes
    def __init__(self, session_id: _Optional[str] = ..., reservation_id: _Optional[int] = ..., index: _Optional[int] = ..., offset: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...

class WriteBlocksResponse(_message.Message):
    __slots__ = ("bytes_written",)
    BYTES_WRITTEN_FIELD_NUMBER: _ClassVar[int]
    bytes_written: int
    def __init__(self, bytes_written: _Optional[int] = ...) -> None: ...

class CommitSaveRequest(_message.Message):
    __slots__ = ("session_id", "reservation_id", "checksum_algo", "checksums")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    RESERVATION_ID_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_ALGO_FIELD_NUMBER: _ClassVar[int]
    CHECKSUMS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    reservation_id: int
    checksum_algo: ChecksumAlgo
    checksums: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, session_id: _Optional[str] = ..., reservation_id: _Optional[int] = ..., checksum_algo: _Optional[_Union[ChecksumAlgo, str]] = ..., checksums: _Optional[_Iterable[int]] = ...) -> None: ...

class CommitSaveResponse(_message.Message):
    __slots__ = ("committed",)
    COMMITTED_FIELD_NUMBER: _ClassVar[int]
    committed: int
    def __init__(self, committed: _Optional[int] = ...) -> None: ...

class AbortSaveRequest(_message.Message):
    __slots__ = ("session_id", "reservation_id")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    RESERVATION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    reservation_id: int
    def __init__(self, session_id: _Optional[str] = ..., reservation_id: _Optional[int] = ...) -> None: ...

class AbortSaveResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("session_id", "lease_id", "discard", "discard_indices", "keep_start", "keep_blocks", "report", "last_turn")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    DISCARD_FIELD_NUMBER: _ClassVar[int]
    DISCARD_INDICES_FIELD_NUMBER: _ClassVar[int]
    KEEP_START_FIELD_NUMBER: _ClassVar[int]
    KEEP_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    REPORT_FIELD_NUMBER: _ClassVar[int]
    LAST_TURN_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    lease_id: int
    discard: bool
    discard_indices: _containers.RepeatedScalarFieldContainer[int]
    keep_start: int
    keep_blocks: int
    report: LookupReport
    last_turn: bool
    def __init__(self, session_id: _Optional[str] = ..., lease_id: _Optional[int] = ..., discard: _Optional[bool] = ..., discard_indices: _Optional[_Iterable[int]] = ..., keep_start: _Optional[int] = ..., keep_blocks: _Optional[int] = ..., report: _Optional[_Union[LookupReport, _Mapping]] = ..., last_turn: _Optional[bool] = ...) -> None: ...

class LookupReport(_message.Message):
    __slots__ = ("prompt_tokens", "prompt_blocks", "local_blocks", "loaded_blocks")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    LOCAL_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    LOADED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    prompt_blocks: int
    local_blocks: int
    loaded_blocks: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., prompt_blocks: _Optional[int] = ..., local_blocks: _Optional[int] = ..., loaded_blocks: _Optional[int] = ...) -> None: ...

class ReleaseResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class TierStats(_message.Message):
    __slots__ = ("tier", "capacity_bytes", "used_bytes", "pinned_bytes", "evictable_bytes", "capacity_pages", "used_pages", "blocks", "pending_blocks", "evictions", "hit_blocks")
    TIER_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    PINNED_BYTES_FIELD_NUMBER: _ClassVar[int]
    EVICTABLE_BYTES_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_PAGES_FIELD_NUMBER: _ClassVar[int]
    USED_PAGES_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PENDING_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    HIT_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    tier: Tier
    capacity_bytes: int
    used_bytes: int
    pinned_bytes: int
    evictable_bytes: int
    capacity_pages: int
    used_pages: int
    blocks: int
    pending_blocks: int
    evictions: int
    hit_blocks: int
    def __init__(self, tier: _Optional[_Union[Tier, str]] = ..., capacity_bytes: _Optional[int] = ..., used_bytes: _Optional[int] = ..., pinned_bytes: _Optional[int] = ..., evictable_bytes: _Optional[int] = ..., capacity_pages: _Optional[int] = ..., used_pages: _Optional[int] = ..., blocks: _Optional[int] = ..., pending_blocks: _Optional[int] = ..., evictions: _Optional[int] = ..., hit_blocks: _Optional[int] = ...) -> None: ...

class StatsResponse(_message.Message):
    __slots__ = ("version", "uptime_seconds", "tiers", "sessions", "leases", "reservations", "namespaces", "lookups", "lookup_keys", "hit_blocks", "eviction_policy", "hit_tokens", "lookup_blocks", "lookup_tokens", "prompt_blocks", "prompt_tokens", "tier_series", "engines")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    UPTIME_SECONDS_FIELD_NUMBER: _ClassVar[int]
    TIERS_FIELD_NUMBER: _ClassVar[int]
    SESSIONS_FIELD_NUMBER: _ClassVar[int]
    LEASES_FIELD_NUMBER: _ClassVar[int]
    RESERVATIONS_FIELD_NUMBER: _ClassVar[int]
    NAMESPACES_FIELD_NUMBER: _ClassVar[int]
    LOOKUPS_FIELD_NUMBER: _ClassVar[int]
    LOOKUP_KEYS_FIELD_NUMBER: _ClassVar[int]
    HIT_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    EVICTION_POLICY_FIELD_NUMBER: _ClassVar[int]
    HIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOOKUP_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    LOOKUP_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TIER_SERIES_FIELD_NUMBER: _ClassVar[int]
    ENGINES_FIELD_NUMBER: _ClassVar[int]
    version: str
    uptime_seconds: float
    tiers: _containers.RepeatedCompositeFieldContainer[TierStats]
    sessions: int
    leases: int
    reservations: int
    namespaces: int
    lookups: int
    lookup_keys: int
    hit_blocks: int
    eviction_policy: str
    hit_tokens: int
    lookup_blocks: int
    lookup_tokens: int
    prompt_blocks: int
    prompt_tokens: int
    tier_series: _containers.RepeatedCompositeFieldContainer[TierSeries]
    engines: _containers.RepeatedCompositeFieldContainer[EngineStats]
    def __init__(self, version: _Optional[str] = ..., uptime_seconds: _Optional[float] = ..., tiers: _Optional[_Iterable[_Union[TierStats, _Mapping]]] = ..., sessions: _Optional[int] = ..., leases: _Optional[int] = ..., reservations: _Optional[int] = ..., namespaces: _Optional[int] = ..., lookups: _Optional[int] = ..., lookup_keys: _Optional[int] = ..., hit_blocks: _Optional[int] = ..., eviction_policy: _Optional[str] = ..., hit_tokens: _Optional[int] = ..., lookup_blocks: _Optional[int] = ..., lookup_tokens: _Optional[int] = ..., prompt_blocks: _Optional[int] = ..., prompt_tokens: _Optional[int] = ..., tier_series: _Optional[_Iterable[_Union[TierSeries, _Mapping]]] = ..., engines: _Optional[_Iterable[_Union[EngineStats, _Mapping]]] = ...) -> None: ...

class TierSeries(_message.Message):
    __slots__ = ("name", "kind", "labels", "value")
    class LabelsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    NAME_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    name: str
    kind: str
    labels: _containers.ScalarMap[str, str]
    value: float
    def __init__(self, name: _Optional[str] = ..., kind: _Optional[str] = ..., labels: _Optional[_Mapping[str, str]] = ..., value: _Optional[float] = ...) -> None: ...

class EngineStats(_message.Message):
    __slots__ = ("engine", "instance_id", "namespace_id", "resident_blocks", "resident_bytes", "capacity_blocks")
    ENGINE_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_ID_FIELD_NUMBER: _ClassVar[int]
    RESIDENT_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    RESIDENT_BYTES_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    engine: str
    instance_id: str
    namespace_id: bytes
    resident_blocks: int
    resident_bytes: int
    capacity_blocks: int
    def __init__(self, engine: _Optional[str] = ..., instance_id: _Optional[str] = ..., namespace_id: _Optional[bytes] = ..., resident_blocks: _Optional[int] = ..., resident_bytes: _Optional[int] = ..., capacity_blocks: _Optional[int] = ...) -> None: ...
