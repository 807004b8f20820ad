"""What the stub fuzzer sends: one Case per request, generated from (seed, index)
alone plus the ids of the real sessions it fuzzes around (the Pool).

A Case is plain bytes (one payload, or the chunks of a WriteBlocks stream),
the caller it is sent as, and what the fuzzer itself does to the call (cancel,
deadline). `expect` narrows the allowed codes where the request's meaning is
known: another identity's session id, a forged or never-issued id.
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any, Optional

from google.protobuf.descriptor import FieldDescriptor as FD
from google.protobuf.message import DecodeError
from google.protobuf.message_factory import GetMessageClass
from grpc_health.v1.health_pb2 import HealthCheckRequest as HealthReq

from kvkeeper.v1 import admin_pb2 as apb
from kvkeeper.v1 import kvkeeper_pb2 as pb

import fuzz_wire as w

BLOCK = 4096
KEY_BYTES = 32
TOKEN_A = "fuzz-tenant-a-0123456789abcdef"
TOKEN_B = "fuzz-tenant-b-0123456789abcdef"
TOKEN_OPS = "fuzz-ops-0123456789abcdefghij"


@dataclass(frozen=True)
class Ident:
    name: str
    channel: str                 # "unix" | "tcp"
    metadata: tuple = ()
    owner: Optional[str] = None  # who its sessions belong to; None: not authenticated
    model: str = ""
    admin: bool = False


IDENTS = (
    (30, Ident("socket", "unix", (), "socket", "model-sock", True)),
    (20, Ident("tenant-a", "tcp", (("authorization", f"Bearer {TOKEN_A}"),), "tenant-a", "model-a")),
    (5, Ident("tenant-a@unix", "unix", (("authorization", f"Bearer {TOKEN_A}"),), "tenant-a", "model-a")),
    (15, Ident("tenant-b", "tcp", (("authorization", f"Bearer {TOKEN_B}"),), "tenant-b", "model-b")),
    (15, Ident("ops", "tcp", (("authorization", f"Bearer {TOKEN_OPS}"),), "ops", "model-ops", True)),
    (5, Ident("anonymous@tcp", "tcp")),
    (5, Ident("bad-token", "tcp", (("authorization", "Bearer not-a-token-0123456789"),))),
    (5, Ident("bad-header", "unix", (("authorization", "Basic Zm9vOmJhcg=="),))),
    (2, Ident("empty-bearer", "tcp", (("authorization", "Bearer "),))),
    (2, Ident("huge-token", "unix", (("authorization", "Bearer " + "t" * 6000),))),
)
OWNERS = ("socket", "tenant-a", "tenant-b", "ops")
OWNER_IDENT = {i.owner: i for _, i in IDENTS if i.owner and i.name == i.owner}


@dataclass(frozen=True)
class Method:
    path: str
    short: str                   # "KVKeeper/Match": how malformed-request messages name it
    request: Any
    response: Any
    client_streaming: bool
    server_streaming: bool
    admin: bool


def _methods() -> dict[str, Method]:
    out = {}
    for fd, admin in ((pb.DESCRIPTOR, False), (apb.DESCRIPTOR, True)):
        for svc in fd.services_by_name.values():
            for m in svc.methods:
                out[m.name] = Method(f"/{svc.full_name}/{m.name}", f"{svc.name}/{m.name}",
                                     GetMessageClass(m.input_type), GetMessageClass(m.output_type),
                                     m.client_streaming, m.server_streaming, admin)
    return out


METHODS = _methods()
WEIGHTS = {"RegisterSession": 6, "Heartbeat": 6, "CloseSession": 4, "Match": 14, "Load": 8,
           "LoadStream": 6, "ReserveSave": 10, "WriteBlocks": 12, "CommitSave": 8,
           "AbortSave": 5, "Release": 8, "Stats": 2, "ListNamespaces": 2, "InspectBlock": 3,
           "Evict": 2, "Drain": 2, "Verify": 2}
UNKNOWN_METHODS = ("/kvkeeper.v1.KVKeeper/DropEverything", "/kvkeeper.v1.KVKeeperAdmin/Shell",
                   "/kvkeeper.v1.Nope/Match", "/kvkeeper.v2.KVKeeper/Match", "/nope/",
                   "/kvkeeper.v1.KVKeeper/match", "/kvkeeper.v1.KVKeeper/Match/extra")
HEALTH = "/grpc.health.v1.Health/Check"


@dataclass
class OwnerState:
    """The real ids of one identity's current session (see Pool)."""
    sid: str = ""
    ns_id: bytes = b""
    committed: list = field(default_factory=list)
    pending: list = field(default_factory=list)
    leases: list = field(default_factory=list)            # (lease id, blocks)
    res_shm: list = field(default_factory=list)           # (reservation id, keys)
    res_stream: list = field(default_factory=list)        # (reservation id, keys)


@dataclass
class Pool:
    owners: dict = field(default_factory=lambda: {o: OwnerState() for o in OWNERS})
    closed: list = field(default_factory=list)            # (owner, session id)
    fuzz_sessions: list = field(default_factory=list)     # (Ident, session id) that fuzz requests registered
    dead_leases: list = field(default_factory=list)       # (owner, lease id) released or expired
    dead_reservations: list = field(default_factory=list)


@dataclass
class Case:
    index: int
    method: str                       # path
    kind: str                         # what the generator did, for the report
    ident: Ident
    payloads: list                    # bytes; one unless client-streaming
    server_streaming: bool = False
    client_streaming: bool = False
    meta: Optional[Method] = None     # None: an unknown method or health
    cancel_after: Optional[int] = None
    deadline: Optional[float] = None
    oversized: bool = False
    expect: Optional[frozenset] = None
    notes: list = field(default_factory=list)
    sid_owner: Optional[str] = None   # whose live session the request names, if any

    def malformed(self) -> list:
        """Per payload: True when the method's request message cannot decode it."""
        if self.meta is None:
            return [False] * len(self.payloads)
        out = []
        for p in self.payloads:
            try:
                self.meta.request.FromString(p)
                out.append(False)
            except DecodeError:
                out.append(True)
        return out

    def describe(self) -> str:
        size = sum(len(p) for p in self.payloads)
        head = self.payloads[0][:48].hex() if self.payloads else ""
        return (f"#{self.index} {self.method} kind={self.kind} as={self.ident.name} "
                f"chunks={len(self.payloads)} bytes={size} cancel_after={self.cancel_after} "
                f"deadline={self.deadline} notes={self.notes} head={head}")


def _hexid(rng: random.Random, n: int) -> str:
    return rng.randbytes(n).hex()


class Generator:
    def __init__(self, seed: str, pool: Pool, max_keys: int, max_message_bytes: int) -> None:
        self.seed = seed
        self.pool = pool
        self.max_keys = max_keys
        self.max_message_bytes = max_message_bytes

    # -------------------------------------------------------------- ids
    def _session_id(self, rng: random.Random, ident: Ident, case: Case) -> str:
        p = self.pool
        r = rng.random()
        own = p.owners.get(ident.owner) if ident.owner else None
        others = [o for o in OWNERS if o != ident.owner and p.owners[o].sid]
        if own is not None and own.sid and r < 0.55:
            case.notes.append("sid=own")
            case.sid_owner = ident.owner
            return own.sid
        if others and r < 0.68:
            o = rng.choice(others)
            case.notes.append("sid=other")
            case.sid_owner = o
            return p.owners[o].sid
        if p.closed and r < 0.74:
            owner, sid = rng.choice(p.closed)
            case.notes.append("sid=own-closed" if owner == ident.owner else "sid=other-closed")
            return sid
        if r < 0.82:
            # Shaped like an issued id: a small counter and 16 hex digits.
            case.notes.append("sid=forged")
            return f"{rng.randint(1, 40):x}-{_hexid(rng, 8)}"
        case.notes.append("sid=never")
        return rng.choice(("", "0", "-", "1-", "0-" + "0" * 16, "y" * 20000, "é" * 300,
                           "\x00\x01", f"{rng.getrandbits(64):x}-{_hexid(rng, 8)}",
                           _hexid(rng, rng.randint(1, 40))))

    def _owner_for(self, rng: random.Random, ident: Ident, case: Case) -> OwnerState:
        """The owner whose leases and reservations the request names: the session's, mostly."""
        if case.sid_owner and rng.random() < 0.85:
            return self.pool.owners[case.sid_owner]
        return self.pool.owners[rng.choice(OWNERS)]

    def _lease_id(self, rng: random.Random, st: OwnerState, case: Case) -> int:
        r = rng.random()
        if st.leases and r < 0.7:
            case.notes.append("lease=real")
            return rng.choice(st.leases)[0]
        if self.pool.dead_leases and r < 0.8:
            case.notes.append("lease=dead")
            return rng.choice(self.pool.dead_leases)[1]
        case.notes.append("lease=odd")
        return rng.choice(w.EDGE_INTS)

    def _reservation(self, rng: random.Random, st: OwnerState, case: Case,
                     stream: Optional[bool] = None) -> tuple[int, list]:
        if stream is None:
            stream = rng.random() < 0.5
        real = st.res_stream if stream else st.res_shm
        r = rng.random()
        if real and r < 0.75:
            case.notes.append("res=real-stream" if stream else "res=real-shm")
            return rng.choice(real)
        if self.pool.dead_reservations and r < 0.85:
            case.notes.append("res=dead")
            return rng.choice(self.pool.dead_reservations)[1], []
        case.notes.append("res=odd")
        return rng.choice(w.EDGE_INTS), []

    def _keys(self, rng: random.Random, st: OwnerState) -> list:
        r = rng.random()
        if r < 0.4 and st.committed:
            ks = list(st.committed)
            return ks[:rng.randint(1, len(ks))] + [rng.randbytes(KEY_BYTES) for _ in range(rng.randint(0, 2))]
        if r < 0.55 and st.pending:
            return list(st.pending) + [rng.randbytes(KEY_BYTES)]
        if r < 0.75:
            return [rng.randbytes(KEY_BYTES) for _ in range(rng.randint(0, 8))]
        if r < 0.82:
            k = rng.randbytes(KEY_BYTES)
            return [k, k]
        if r < 0.9:
            return [rng.randbytes(rng.choice((0, 1, 31, 33, 64, 1024))) for _ in range(rng.randint(1, 3))]
        return [rng.randbytes(KEY_BYTES) for _ in range(self.max_keys + rng.choice((0, 1, 50)))]

    # -------------------------------------------------------------- typed messages
    def _namespace(self, rng: random.Random, ident: Ident) -> Any:
        d = pb.NamespaceDescriptor(
            model_id=rng.choice((ident.model or "model-sock", ident.model or "m", "model-a",
                                 "model-b", "", "x" * 300)),
            dtype=rng.choice(("float16", "", "bf16" * 70)), kv_layout=rng.choice(("NHD", "mla", "")),
            block_tokens=rng.choice((16, 16, 0, 1, (1 << 32) - 1)),
            block_bytes=rng.choice((BLOCK, BLOCK, BLOCK, 1, BLOCK - 1, 2 * BLOCK, 1 << 20, 1 << 30, w.U64)),
            tp_rank=rng.choice((0, 0, 1, 7, (1 << 32) - 1)), tp_size=rng.choice((0, 1, 1, 2, 8)))
        if rng.random() < 0.2:
            d.cache_salt = rng.choice(("s", "t" * 257))
        if rng.random() < 0.1:
            d.lora_tag = "lora"
        return d

    def _typed(self, rng: random.Random, name: str, ident: Ident, case: Case) -> Any:
        m = METHODS[name].request()
        fields = {f.name for f in m.DESCRIPTOR.fields}
        if name == "RegisterSession":
            m.instance_id = rng.choice(("", "fuzz", "i" * 257, "é" * 200))
            m.namespace.CopyFrom(self._namespace(rng, ident))
            return m
        if "session_id" in fields:
            m.session_id = self._session_id(rng, ident, case)
        st = self._owner_for(rng, ident, case)
        if "lease_id" in fields:
            m.lease_id = self._lease_id(rng, st, case)
        if name == "Match":
            m.keys.extend(self._keys(rng, st))
            m.lease, m.blocks = rng.random() < 0.6, rng.random() < 0.5
        elif name == "ReserveSave":
            m.keys.extend(self._keys(rng, st))
            m.transport = rng.choice((0, 1, 2, 2, 3, 77))
        elif name in ("CommitSave", "AbortSave"):
            rid, keys = self._reservation(rng, st, case)
            m.reservation_id = rid
            if name == "CommitSave" and rng.random() < 0.5:
                m.checksum_algo = rng.choice((0, 1, 2, 9))
                n = len(keys) if rng.random() < 0.7 else rng.choice((1, 3, 5000))
                m.checksums.extend(rng.getrandbits(64) for _ in range(n))
        elif name == "Release":
            m.discard = rng.random() < 0.3
            if rng.random() < 0.4:
                m.discard_indices.extend(rng.choice((0, 1, 2, 3, 5, (1 << 32) - 1))
                                         for _ in range(rng.choice((1, 2, 3, 20000))))
        elif name == "InspectBlock":
            m.namespace_id = st.ns_id if st.ns_id and rng.random() < 0.7 else rng.randbytes(rng.choice((0, 15, 16, 17)))
            keys = st.committed + st.pending
            m.key = rng.choice(keys) if keys and rng.random() < 0.7 else rng.randbytes(rng.choice((0, 32, 33)))
        elif name == "Evict":
            if rng.random() < 0.5:
                m.namespace_id = st.ns_id if st.ns_id and rng.random() < 0.5 else rng.randbytes(rng.choice((0, 16, 17)))
            elif rng.random() < 0.8:
                m.all = rng.random() < 0.7
        return m

    def _chunks(self, rng: random.Random, ident: Ident, case: Case) -> list:
        """A WriteBlocks stream: real first chunks, then more, garbage or nothing."""
        sid = self._session_id(rng, ident, case)
        st = self._owner_for(rng, ident, case)
        rid, keys = self._reservation(rng, st, case, stream=rng.random() < 0.85)
        out = []
        index = rng.randrange(max(1, len(keys))) if rng.random() < 0.8 else rng.choice(w.EDGE_INTS[:8])
        offset = 0
        for _ in range(rng.choice((0, 1, 1, 2, 3, 5))):
            n = rng.choice((0, 1, 100, BLOCK // 2, BLOCK, BLOCK + 1))
            if rng.random() < 0.1:
                offset = rng.choice(w.EDGE_INTS)
            out.append(pb.WriteChunk(session_id=sid if not out or rng.random() < 0.3 else "",
                                     reservation_id=rid if not out or rng.random() < 0.3 else 0,
                                     index=index & 0xFFFFFFFF, offset=offset & w.U64,
                                     data=rng.randbytes(n)).SerializeToString())
            offset += n
            if rng.random() < 0.2:
                index, offset = (index + 1) & 0xFFFFFFFF, 0
        if not out:
            case.notes.append("empty-stream")   # names no session at all
        return out

    # -------------------------------------------------------------- one case
    def case(self, index: int) -> Case:
        rng = random.Random(f"{self.seed}/{index}")
        ident = rng.choices([i for _, i in IDENTS], [wt for wt, _ in IDENTS])[0]
        r = rng.random()
        if r < 0.03:
            return Case(index, rng.choice(UNKNOWN_METHODS), "unknown-method", ident,
                        [rng.choice((b"", w.random_bytes(rng)))])
        if r < 0.05:
            payload = HealthReq(service=rng.choice(("", "kvkeeper.v1.KVKeeper", "nope", "x" * 5000))).SerializeToString()
            return Case(index, HEALTH, "health", ident, [payload])
        name = rng.choices(list(WEIGHTS), list(WEIGHTS.values()))[0]
        meta = METHODS[name]
        case = Case(index, meta.path, "typed", ident, [], meta.server_streaming,
                    meta.client_streaming, meta)
        if meta.client_streaming:
            self._stream_case(rng, case)
        else:
            self._unary_case(rng, case)
        if name == "Drain" and ident.admin and not any(case.malformed()):
            # A successful drain would refuse every later save: send the same
            # bytes to ListNamespaces instead (both requests are empty messages).
            case.method, case.meta = METHODS["ListNamespaces"].path, METHODS["ListNamespaces"]
            case.notes.append("drain->ls")
        if name != "RegisterSession" and rng.random() < 0.04:
            if rng.random() < 0.5:
                case.cancel_after = 0 if not (meta.client_streaming or meta.server_streaming) else rng.randint(0, 2)
            else:
                case.deadline = rng.choice((0.0005, 0.002, 0.01))
        self._expect(case)
        return case

    def _unary_case(self, rng: random.Random, case: Case) -> None:
        meta = case.meta
        assert meta is not None
        r = rng.random()
        msg = self._typed(rng, meta.path.rsplit("/", 1)[1], case.ident, case)
        raw = msg.SerializeToString()
        if r < 0.6:
            case.payloads = [raw]
            return
        if r < 0.8:
            name = rng.choice(list(w.WIRE_MUTATIONS))
            case.kind = f"wire:{name}"
            case.payloads = [w.WIRE_MUTATIONS[name](rng, meta.request.DESCRIPTOR, raw)]
        elif r < 0.86:
            case.kind, case.payloads = "truncated", [w.truncate(rng, raw)]
        elif r < 0.91:
            case.kind, case.payloads = "bitflip", [w.bitflip(rng, raw)]
        elif r < 0.97:
            case.kind, case.payloads = "random-bytes", [w.random_bytes(rng)]
        elif r < 0.985:
            case.kind, case.payloads = "empty", [b""]
        else:
            case.kind, case.oversized = "oversized", True
            case.payloads = [raw + w.field(999, w.LEN, rng.randbytes(self.max_message_bytes + 1024))]

    def _stream_case(self, rng: random.Random, case: Case) -> None:
        chunks = self._chunks(rng, case.ident, case)
        r = rng.random()
        if r < 0.55:
            case.payloads = chunks
        elif r < 0.75:
            case.kind = "valid-then-garbage"
            case.payloads = chunks[:1] + [rng.choice((w.random_bytes(rng), b"\xff\xff", b"\x0a\x05ab"))]
        elif r < 0.85:
            name = rng.choice(list(w.WIRE_MUTATIONS))
            case.kind = f"wire:{name}"
            case.payloads = [w.WIRE_MUTATIONS[name](rng, pb.WriteChunk.DESCRIPTOR, c) for c in chunks] or [b"\x08"]
        elif r < 0.93:
            case.kind = "garbage-stream"
            case.payloads = [w.random_bytes(rng) for _ in range(rng.randint(1, 3))]
        elif r < 0.97:
            case.kind = "cancelled-stream"
            case.payloads = chunks + [chunks[0] if chunks else b""] * 3
            case.cancel_after = rng.randint(0, max(0, len(chunks)))
        else:
            case.kind, case.oversized = "oversized", True
            case.payloads = chunks[:1] + [w.field(5, w.LEN, rng.randbytes(self.max_message_bytes + 1024))]

    def _expect(self, case: Case) -> None:
        """Narrow the allowed codes where the request's meaning is plain."""
        meta, ident = case.meta, case.ident
        if meta is None or case.kind != "typed" or ident.owner is None or meta.admin or \
                "empty-stream" in case.notes:
            return
        if "sid=other" in case.notes or "sid=other-closed" in case.notes or \
                "sid=forged" in case.notes or "sid=never" in case.notes:
            # Another identity's live or closed session, and ids nobody was
            # issued, all read as unknown: no oracle, no capability.
            case.expect = frozenset({"NOT_FOUND"})

