from kvkeeper.v1 import kvkeeper_pb2 as _kvkeeper_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ResidencyKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    RESIDENCY_KIND_UNSPECIFIED: _ClassVar[ResidencyKind]
    RESIDENCY_STORED: _ClassVar[ResidencyKind]
    RESIDENCY_REMOVED: _ClassVar[ResidencyKind]
    RESIDENCY_CLEARED: _ClassVar[ResidencyKind]
RESIDENCY_KIND_UNSPECIFIED: ResidencyKind
RESIDENCY_STORED: ResidencyKind
RESIDENCY_REMOVED: ResidencyKind
RESIDENCY_CLEARED: ResidencyKind

class ResidencyChange(_message.Message):
    __slots__ = ("kind", "keys", "block_ids")
    KIND_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    kind: ResidencyKind
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, kind: _Optional[_Union[ResidencyKind, str]] = ..., keys: _Optional[_Iterable[bytes]] = ..., block_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class ReportResidencyRequest(_message.Message):
    __slots__ = ("session_id", "capacity_blocks", "changes", "report_seq")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    CHANGES_FIELD_NUMBER: _ClassVar[int]
    REPORT_SEQ_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    capacity_blocks: int
    changes: _containers.RepeatedCompositeFieldContainer[ResidencyChange]
    report_seq: int
    def __init__(self, session_id: _Optional[str] = ..., capacity_blocks: _Optional[int] = ..., changes: _Optional[_Iterable[_Union[ResidencyChange, _Mapping]]] = ..., report_seq: _Optional[int] = ...) -> None: ...

class ReportResidencyResponse(_message.Message):
    __slots__ = ("engine", "resident_blocks", "applied")
    ENGINE_FIELD_NUMBER: _ClassVar[int]
    RESIDENT_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    APPLIED_FIELD_NUMBER: _ClassVar[int]
    engine: str
    resident_blocks: int
    applied: bool
    def __init__(self, engine: _Optional[str] = ..., resident_blocks: _Optional[int] = ..., applied: _Optional[bool] = ...) -> None: ...

class LocateRequest(_message.Message):
    __slots__ = ("descriptor", "namespace_id", "keys")
    DESCRIPTOR_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_ID_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    descriptor: _kvkeeper_pb2.NamespaceDescriptor
    namespace_id: bytes
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, descriptor: _Optional[_Union[_kvkeeper_pb2.NamespaceDescriptor, _Mapping]] = ..., namespace_id: _Optional[bytes] = ..., keys: _Optional[_Iterable[bytes]] = ...) -> None: ...

class EnginePrefix(_message.Message):
    __slots__ = ("engine", "instance_id", "prefix", "resident_blocks", "capacity_blocks")
    ENGINE_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    PREFIX_FIELD_NUMBER: _ClassVar[int]
    RESIDENT_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    engine: str
    instance_id: str
    prefix: int
    resident_blocks: int
    capacity_blocks: int
    def __init__(self, engine: _Optional[str] = ..., instance_id: _Optional[str] = ..., prefix: _Optional[int] = ..., resident_blocks: _Optional[int] = ..., capacity_blocks: _Optional[int] = ...) -> None: ...

class TierPrefix(_message.Message):
    __slots__ = ("tier", "prefix")
    TIER_FIELD_NUMBER: _ClassVar[int]
    PREFIX_FIELD_NUMBER: _ClassVar[int]
    tier: _kvkeeper_pb2.Tier
    prefix: int
    def __init__(self, tier: _Optional[_Union[_kvkeeper_pb2.Tier, str]] = ..., prefix: _Optional[int] = ...) -> None: ...

class LocateResponse(_message.Message):
    __slots__ = ("namespace_id", "engines", "tiers", "stored")
    NAMESPACE_ID_FIELD_NUMBER: _ClassVar[int]
    ENGINES_FIELD_NUMBER: _ClassVar[int]
    TIERS_FIELD_NUMBER: _ClassVar[int]
    STORED_FIELD_NUMBER: _ClassVar[int]
    namespace_id: bytes
    engines: _containers.RepeatedCompositeFieldContainer[EnginePrefix]
    tiers: _containers.RepeatedCompositeFieldContainer[TierPrefix]
    stored: int
    def __init__(self, namespace_id: _Optional[bytes] = ..., engines: _Optional[_Iterable[_Union[EnginePrefix, _Mapping]]] = ..., tiers: _Optional[_Iterable[_Union[TierPrefix, _Mapping]]] = ..., stored: _Optional[int] = ...) -> None: ...

class WatchEventsRequest(_message.Message):
    __slots__ = ("resume", "epoch", "after_seq", "descriptor", "namespace_id")
    RESUME_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    AFTER_SEQ_FIELD_NUMBER: _ClassVar[int]
    DESCRIPTOR_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_ID_FIELD_NUMBER: _ClassVar[int]
    resume: bool
    epoch: str
    after_seq: int
    descriptor: _kvkeeper_pb2.NamespaceDescriptor
    namespace_id: bytes
    def __init__(self, resume: _Optional[bool] = ..., epoch: _Optional[str] = ..., after_seq: _Optional[int] = ..., descriptor: _Optional[_Union[_kvkeeper_pb2.NamespaceDescriptor, _Mapping]] = ..., namespace_id: _Optional[bytes] = ...) -> None: ...

class ResidencyEvent(_message.Message):
    __slots__ = ("seq", "tier", "engine", "kind", "namespace_id", "keys")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    ENGINE_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_ID_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    seq: int
    tier: _kvkeeper_pb2.Tier
    engine: str
    kind: ResidencyKind
    namespace_id: bytes
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, seq: _Optional[int] = ..., tier: _Optional[_Union[_kvkeeper_pb2.Tier, str]] = ..., engine: _Optional[str] = ..., kind: _Optional[_Union[ResidencyKind, str]] = ..., namespace_id: _Optional[bytes] = ..., keys: _Optional[_Iterable[bytes]] = ...) -> None: ...

class EventGap(_message.Message):
    __slots__ = ("first_seq", "last_seq", "restarted")
    FIRST_SEQ_FIELD_NUMBER: _ClassVar[int]
    LAST_SEQ_FIELD_NUMBER: _ClassVar[int]
    RESTARTED_FIELD_NUMBER: _ClassVar[int]
    first_seq: int
    last_seq: int
    restarted: bool
    def __init__(self, first_seq: _Optional[int] = ..., last_seq: _Optional[int] = ..., restarted: _Optional[bool] = ...) -> None: ...

class WatchEventsResponse(_message.Message):
    __slots__ = ("epoch", "last_seq", "events", "gap")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    LAST_SEQ_FIELD_NUMBER: _ClassVar[int]
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    GAP_FIELD_NUMBER: _ClassVar[int]
    epoch: str
    last_seq: int
    events: _containers.RepeatedCompositeFieldContainer[ResidencyEvent]
    gap: EventGap
    def __init__(self, epoch: _Optional[str] = ..., last_seq: _Optional[int] = ..., events: _Optional[_Iterable[_Union[ResidencyEvent, _Mapping]]] = ..., gap: _Optional[_Union[EventGap, _Mapping]] = ...) -> None: ...
