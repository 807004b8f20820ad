from kvkeeper.v1 import kvkeeper_pb2 as _kvkeeper_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ListNamespacesRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class TierUsage(_message.Message):
    __slots__ = ("tier", "blocks", "bytes")
    TIER_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    tier: _kvkeeper_pb2.Tier
    blocks: int
    bytes: int
    def __init__(self, tier: _Optional[_Union[_kvkeeper_pb2.Tier, str]] = ..., blocks: _Optional[int] = ..., bytes: _Optional[int] = ...) -> None: ...

class NamespaceInfo(_message.Message):
    __slots__ = ("namespace_id", "registered", "descriptor", "tiers", "sessions", "quota_bytes")
    NAMESPACE_ID_FIELD_NUMBER: _ClassVar[int]
    REGISTERED_FIELD_NUMBER: _ClassVar[int]
    DESCRIPTOR_FIELD_NUMBER: _ClassVar[int]
    TIERS_FIELD_NUMBER: _ClassVar[int]
    SESSIONS_FIELD_NUMBER: _ClassVar[int]
    QUOTA_BYTES_FIELD_NUMBER: _ClassVar[int]
    namespace_id: bytes
    registered: bool
    descriptor: _kvkeeper_pb2.NamespaceDescriptor
    tiers: _containers.RepeatedCompositeFieldContainer[TierUsage]
    sessions: int
    quota_bytes: int
    def __init__(self, namespace_id: _Optional[bytes] = ..., registered: _Optional[bool] = ..., descriptor: _Optional[_Union[_kvkeeper_pb2.NamespaceDescriptor, _Mapping]] = ..., tiers: _Optional[_Iterable[_Union[TierUsage, _Mapping]]] = ..., sessions: _Optional[int] = ..., quota_bytes: _Optional[int] = ...) -> None: ...

class ListNamespacesResponse(_message.Message):
    __slots__ = ("namespaces",)
    NAMESPACES_FIELD_NUMBER: _ClassVar[int]
    namespaces: _containers.RepeatedCompositeFieldContainer[NamespaceInfo]
    def __init__(self, namespaces: _Optional[_Iterable[_Union[NamespaceInfo, _Mapping]]] = ...) -> None: ...

class InspectBlockRequest(_message.Message):
    __slots__ = ("namespace_id", "key")
    NAMESPACE_ID_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    namespace_id: bytes
    key: bytes
    def __init__(self, namespace_id: _Optional[bytes] = ..., key: _Optional[bytes] = ...) -> None: ...

class BlockCopy(_message.Message):
    __slots__ = ("tier", "state", "refs", "hits", "idle_seconds", "bytes")
    TIER_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    REFS_FIELD_NUMBER: _ClassVar[int]
    HITS_FIELD_NUMBER: _ClassVar[int]
    IDLE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    tier: _kvkeeper_pb2.Tier
    state: str
    refs: int
    hits: int
    idle_seconds: float
    bytes: int
    def __init__(self, tier: _Optional[_Union[_kvkeeper_pb2.Tier, str]] = ..., state: _Optional[str] = ..., refs: _Optional[int] = ..., hits: _Optional[int] = ..., idle_seconds: _Optional[float] = ..., bytes: _Optional[int] = ...) -> None: ...

class InspectBlockResponse(_message.Message):
    __slots__ = ("copies", "checksum_algo", "checksum")
    COPIES_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_ALGO_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    copies: _containers.RepeatedCompositeFieldContainer[BlockCopy]
    checksum_algo: _kvkeeper_pb2.ChecksumAlgo
    checksum: int
    def __init__(self, copies: _Optional[_Iterable[_Union[BlockCopy, _Mapping]]] = ..., checksum_algo: _Optional[_Union[_kvkeeper_pb2.ChecksumAlgo, str]] = ..., checksum: _Optional[int] = ...) -> None: ...

class EvictRequest(_message.Message):
    __slots__ = ("namespace_id", "all")
    NAMESPACE_ID_FIELD_NUMBER: _ClassVar[int]
    ALL_FIELD_NUMBER: _ClassVar[int]
    namespace_id: bytes
    all: bool
    def __init__(self, namespace_id: _Optional[bytes] = ..., all: _Optional[bool] = ...) -> None: ...

class EvictResponse(_message.Message):
    __slots__ = ("evicted", "remaining")
    EVICTED_FIELD_NUMBER: _ClassVar[int]
    REMAINING_FIELD_NUMBER: _ClassVar[int]
    evicted: int
    remaining: int
    def __init__(self, evicted: _Optional[int] = ..., remaining: _Optional[int] = ...) -> None: ...

class DrainRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DrainResponse(_message.Message):
    __slots__ = ("disk_tier", "open_reservations", "seconds")
    DISK_TIER_FIELD_NUMBER: _ClassVar[int]
    OPEN_RESERVATIONS_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    disk_tier: bool
    open_reservations: int
    seconds: float
    def __init__(self, disk_tier: _Optional[bool] = ..., open_reservations: _Optional[int] = ..., seconds: _Optional[float] = ...) -> None: ...

class VerifyRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class VerifyProgress(_message.Message):
    __slots__ = ("processed", "total", "done", "checked", "bad", "missing", "quarantined", "bytes", "seconds")
    PROCESSED_FIELD_NUMBER: _ClassVar[int]
    TOTAL_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    CHECKED_FIELD_NUMBER: _ClassVar[int]
    BAD_FIELD_NUMBER: _ClassVar[int]
    MISSING_FIELD_NUMBER: _ClassVar[int]
    QUARANTINED_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    processed: int
    total: int
    done: bool
    checked: int
    bad: int
    missing: int
    quarantined: int
    bytes: int
    seconds: float
    def __init__(self, processed: _Optional[int] = ..., total: _Optional[int] = ..., done: _Optional[bool] = ..., checked: _Optional[int] = ..., bad: _Optional[int] = ..., missing: _Optional[int] = ..., quarantined: _Optional[int] = ..., bytes: _Optional[int] = ..., seconds: _Optional[float] = ...) -> None: ...
