"""The ledger's records: namespaces, blocks, sessions, the daemon's own holder,
leases, reservations."""
from __future__ import annotations

import hashlib
import json
import math
from collections import OrderedDict
from dataclasses import asdict, dataclass, field
from typing import Any, Optional, Union

from ..errors import InvalidArgument
from ..ids import (INTERNAL, LOCAL, BlockKey, Identity, LeaseId, NamespaceId, ReservationId,
                   SessionId, TierName)
from .pages import Pages
from .states import BlockState

MAX_TEXT = 256


@dataclass(frozen=True)
class NamespaceDescriptor:
    """What makes two blocks interchangeable; mirrors kvkeeper.v1.NamespaceDescriptor."""

    model_id: str
    block_tokens: int
    block_bytes: int
    model_revision: str = ""
    dtype: str = ""
    kv_layout: str = ""
    tp_rank: int = 0
    tp_size: int = 1
    cache_salt: str = ""
    lora_tag: str = ""

    def validate(self) -> None:
        if not self.model_id:
            raise InvalidArgument("namespace.model_id is empty; name the model (e.g. its HF id)")
        for name in ("model_id", "model_revision", "dtype", "kv_layout", "cache_salt", "lora_tag"):
            value = getattr(self, name)
            if len(value.encode()) > MAX_TEXT:
                raise InvalidArgument(f"namespace.{name} is longer than {MAX_TEXT} bytes")
        if self.block_tokens <= 0:
            raise InvalidArgument(f"namespace.block_tokens must be positive, got {self.block_tokens}")
        if self.block_bytes <= 0:
            raise InvalidArgument(f"namespace.block_bytes must be positive, got {self.block_bytes}")
        if self.tp_size <= 0 or not 0 <= self.tp_rank < self.tp_size:
            raise InvalidArgument(
                f"namespace.tp_rank={self.tp_rank} must be in [0, tp_size={self.tp_size})")

    def digest(self) -> NamespaceId:
        canonical = json.dumps(asdict(self), sort_keys=True, separators=(",", ":"))
        return NamespaceId(hashlib.sha256(canonical.encode()).digest()[:16])


class Namespace:
    __slots__ = ("id", "descriptor", "pages_per_block", "blocks", "sessions", "used_pages",
                 "more_kids", "hints", "says_last_turn")

    def __init__(self, descriptor: NamespaceDescriptor, pages_per_block: int) -> None:
        self.id = descriptor.digest()
        self.descriptor = descriptor
        self.pages_per_block = pages_per_block
        self.blocks: dict[BlockKey, Block] = {}
        self.sessions = 0
        # Pages its blocks hold in their tier (pending included): what a quota counts.
        self.used_pages = 0
        # The children beyond a block's first (block.child), of the blocks with
        # more than one: branch points of chains (see chains.py).
        self.more_kids: dict[Block, set[Block]] = {}
        # Key -> the block before it in a chain a Match named but did not hit:
        # the parent of a save that starts there (bounded, see saves.py).
        self.hints: OrderedDict[bytes, Block] = OrderedDict()   # trimmed oldest first
        # Its clients say when a conversation ends (a release with last_turn
        # came): ended histories get demoted, so a lookup reading its own
        # history back needs no discount (chains.private_run) and its hits count.
        self.says_last_turn = False

    @property
    def block_bytes(self) -> int:
        return self.descriptor.block_bytes

    @property
    def block_tokens(self) -> int:
        return self.descriptor.block_tokens


class Block:
    """One block's ledger entry; also the node of its tier's eviction list.

    Slots only, and size and page count live on the namespace, because a
    daemon holds millions of these.
    """

    __slots__ = ("key", "ns", "tier", "state", "refs", "hits", "last_used",
                 "pages", "checksum", "prev", "next", "parent", "child", "pq")

    def __init__(self, key: BlockKey, ns: Namespace, tier: "Any", pages: Pages, now: float) -> None:
        self.key = key
        self.ns = ns
        self.tier = tier
        self.state = BlockState.PENDING
        self.refs = 0
        self.hits = 0
        self.last_used = now
        self.pages = pages
        self.checksum: Optional[tuple[int, int]] = None  # (algo, value) as committed
        self.prev: Any = None
        self.next: Any = None
        # Chain links (chains.py): the block before it, one block after it.
        self.parent: Any = None
        self.child: Any = None
        # The eviction policy's bits (policy.py): frequency, queue, place.
        self.pq = 0

    @property
    def where(self) -> tuple[bytes, bytes]:
        """(namespace id, key): what the policy's ghosts remember it by."""
        return (self.ns.id, self.key)

    def label(self) -> str:
        return f"{self.ns.id.hex()[:8]}/{self.key.hex()[:16]}"


@dataclass(eq=False)
class Session:
    id: SessionId
    instance_id: str
    ns: Namespace
    expires_at: float
    # Who registered it: only that identity can use the session (see sessions.py).
    owner: Identity = LOCAL
    leases: set[LeaseId] = field(default_factory=set)
    reservations: set[ReservationId] = field(default_factory=set)
    # The calls watching it (sessions.Watch): the last one to end ends the session.
    watches: list[Any] = field(default_factory=list)


@dataclass(eq=False)
class Internal:
    """The daemon's own holder of leases and reservations: the pins of a
    flush to a lower tier, the reservation a promotion from one fills. No
    session: it never expires, has no namespace of its own, and no caller
    can name it (its owner INTERNAL is no identity an RPC has)."""

    id: SessionId = SessionId("internal")
    owner: Identity = INTERNAL
    expires_at: float = math.inf
    leases: set[LeaseId] = field(default_factory=set)
    reservations: set[ReservationId] = field(default_factory=set)


# Who holds a lease or a reservation.
Holder = Union[Session, Internal]


@dataclass(eq=False)
class Lease:
    id: LeaseId
    session: Holder
    blocks: list[Block]
    # With report_use the Match counted no hit: the Release's report does.
    report_use: bool = False
    # Position in the Match's keys of blocks[0] (a lease narrowed by a
    # Release with keep_blocks no longer starts at the first key).
    first: int = 0
    # Match positions a lower tier served, and which: their hits are that tier's.
    below: dict[int, TierName] = field(default_factory=dict)
    # The servicer handed out the blocks' shared-memory refs: a reported load
    # counts its bytes as a shm load.
    refs_out: bool = False


@dataclass(eq=False)
class Reservation:
    id: ReservationId
    session: Holder
    ns: Namespace
    # One entry per requested key: the reserved block, or None when skipped.
    entries: list[Optional[Block]]
    expires_at: float
    # Bytes received per entry when the data arrives through the daemon
    # (streamed); None when the client writes shared memory directly.
    written: Optional[list[int]] = None

    @property
    def blocks(self) -> list[Block]:
        return [b for b in self.entries if b is not None]


# Namespaces outlive their sessions while they hold blocks (the cache is
# theirs), and a namespace nobody uses any more (no session, no block) is
# forgotten when a new one is made and the table has doubled since the last
# sweep: otherwise every registration with a new cache_salt (or LoRA, or
# model) would keep its ~1 KB for the daemon's life, and any token holder
# could grow the daemon without bound. Amortised O(1) a registration.
SWEEP_MIN = 1024


def sweep_namespaces(namespaces: dict[NamespaceId, Namespace], at: int) -> int:
    """Drop the unused namespaces once there are `at` or more; the count to sweep at next."""
    if len(namespaces) < at:
        return at
    for ns_id in [i for i, ns in namespaces.items() if not ns.sessions and not ns.blocks]:
        del namespaces[ns_id]
    return max(SWEEP_MIN, 2 * len(namespaces))
