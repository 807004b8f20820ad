"""Cross-tenant attacks with real ids: every session-scoped RPC of the data
service, tried by other identities with a victim tenant's live session id, its
closed session id, its lease ids and its reservation ids; and the admin RPCs
with a tenant's token. Over (a) TCP with bearer tokens, (b) mutual TLS with a
certificate per tenant, (c) the unix socket with auth.require_token_on_socket.

A breach is any answer that differs from the reference (the same call with an
id nobody was issued, or for leases and reservations, with one no longer live:
their ids are public counters, so "not yours" must read as "not live"), any
status other than NOT_FOUND where a session id was named, any change to the
victim's state (session deadline, leases, reservations, blocks, bytes
written), a victim that cannot then load, commit and release as before, or a
log line that carries the victim's full session id. Attempts and breaches are
printed and written to $KVKEEPER_CROSS_TENANT_REPORT (else the tmp dir).
"""
from __future__ import annotations

import json
import logging
import os
import re
import secrets
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import grpc
import pytest

from kvkeeper.v1 import admin_pb2 as apb
from kvkeeper.v1 import kvkeeper_pb2 as pb

from daemon_process import two_tenants_and_ops, write_tokens
from fuzz_cases import METHODS
from pki import make_pki, openssl

BLOCK = 4096
TOKEN_A = "xt-tenant-a-0123456789abcdef"
TOKEN_B = "xt-tenant-b-0123456789abcdef"
TOKEN_OPS = "xt-ops-0123456789abcdefghij"
TOKENS = two_tenants_and_ops(TOKEN_A, TOKEN_B, TOKEN_OPS)
NEVER_ISSUED = 10 ** 9
REPORT: dict = {}


@dataclass
class Party:
    name: str
    channel: Any
    metadata: tuple = ()
    model: str = ""

    async def call(self, method: str, request: Any) -> tuple[str, str, Any]:
        meta = METHODS[method]
        ch = self.channel
        kw = dict(request_serializer=meta.request.SerializeToString,
                  response_deserializer=meta.response.FromString)
        md = dict(metadata=self.metadata or None, timeout=30)
        try:
            if meta.client_streaming:
                return "OK", "", await ch.stream_unary(meta.path, **kw)(iter(request), **md)
            if meta.server_streaming:
                return "OK", "", [m async for m in ch.unary_stream(meta.path, **kw)(request, **md)]
            return "OK", "", await ch.unary_unary(meta.path, **kw)(request, **md)
        except grpc.aio.AioRpcError as e:
            return e.code().name, e.details() or "", None

    async def ok(self, method: str, request: Any) -> Any:
        code, details, resp = await self.call(method, request)
        assert code == "OK", f"{self.name} {method}: {code} {details}"
        return resp


@dataclass
class Victim:
    """A tenant's session with committed blocks, leases and open reservations."""
    party: Party
    sid: str = ""
    closed_sid: str = ""
    keys: list = field(default_factory=list)
    data: list = field(default_factory=list)
    lease: int = 0                 # all blocks, kept to the end
    lease2: int = 0                # the first block, released at the end
    dead_lease: int = 0            # released
    res_stream: int = 0            # two keys, half of the first block written
    res_shm: int = 0
    dead_res: int = 0              # committed
    stream_keys: list = field(default_factory=list)
    shm_keys: list = field(default_factory=list)


def _ns(model: str) -> Any:
    return pb.NamespaceDescriptor(model_id=model, dtype="float16", block_tokens=16, block_bytes=BLOCK)


async def register(p: Party, model: Optional[str] = None) -> str:
    return (await p.ok("RegisterSession", pb.RegisterSessionRequest(
        instance_id=p.name, namespace=_ns(model or p.model)))).session_id


def _chunk(sid: str, rid: int, index: int, offset: int, data: bytes) -> pb.WriteChunk:
    return pb.WriteChunk(session_id=sid, reservation_id=rid, index=index, offset=offset, data=data)


async def make_victim(p: Party, salt: bytes) -> Victim:
    v = Victim(p)
    v.closed_sid = await register(p)
    await p.ok("CloseSession", pb.CloseSessionRequest(session_id=v.closed_sid))
    v.sid = sid = await register(p)
    v.keys = [salt + bytes([i]) * (32 - len(salt)) for i in range(3)]
    v.data = [bytes([0x40 + i]) * BLOCK for i in range(3)]
    r = await p.ok("ReserveSave", pb.ReserveSaveRequest(session_id=sid, keys=v.keys,
                                                         transport=pb.TRANSPORT_STREAM))
    await p.ok("WriteBlocks", [_chunk(sid, r.reservation_id, i, 0, d) for i, d in enumerate(v.data)])
    await p.ok("CommitSave", pb.CommitSaveRequest(session_id=sid, reservation_id=r.reservation_id))
    v.dead_res = r.reservation_id
    for attr, n in (("lease", 3), ("lease2", 1), ("dead_lease", 2)):
        m = await p.ok("Match", pb.MatchRequest(session_id=sid, keys=v.keys[:n], lease=True))
        assert m.matched == n
        setattr(v, attr, m.lease_id)
    await p.ok("Release", pb.ReleaseRequest(session_id=sid, lease_id=v.dead_lease))
    v.stream_keys = [salt + bytes([0x10 + i]) * (32 - len(salt)) for i in range(2)]
    v.shm_keys = [salt + bytes([0x20 + i]) * (32 - len(salt)) for i in range(2)]
    v.res_stream = (await p.ok("ReserveSave", pb.ReserveSaveRequest(
        session_id=sid, keys=v.stream_keys, transport=pb.TRANSPORT_STREAM))).reservation_id
    await p.ok("WriteBlocks", [_chunk(sid, v.res_stream, 0, 0, b"\x07" * (BLOCK // 2))])
    v.res_shm = (await p.ok("ReserveSave", pb.ReserveSaveRequest(
        session_id=sid, keys=v.shm_keys, transport=pb.TRANSPORT_SHM))).reservation_id
    return v


def forged_like(sid: str) -> str:
    """An id of the same shape (issue counter, length) that nobody was issued."""
    head = sid.split("-", 1)[0]
    return f"{head}-{secrets.token_hex(8)}"


def session_attempts(v: Victim, sid: str, extra_key: bytes) -> list:
    """(label, method, request) naming the session `sid` with the victim's other ids."""
    S = sid
    return [
        ("Heartbeat", "Heartbeat", pb.HeartbeatRequest(session_id=S)),
        ("Match+lease+blocks", "Match", pb.MatchRequest(session_id=S, keys=v.keys, lease=True, blocks=True)),
        ("Match", "Match", pb.MatchRequest(session_id=S, keys=v.keys)),
        ("Load", "Load", pb.LoadRequest(session_id=S, lease_id=v.lease)),
        ("LoadStream", "LoadStream", pb.LoadRequest(session_id=S, lease_id=v.lease)),
        ("Release+discard", "Release", pb.ReleaseRequest(session_id=S, lease_id=v.lease, discard=True)),
        ("Release+indices", "Release", pb.ReleaseRequest(session_id=S, lease_id=v.lease2, discard_indices=[0])),
        ("ReserveSave(new)", "ReserveSave", pb.ReserveSaveRequest(session_id=S, keys=[extra_key],
                                                                  transport=pb.TRANSPORT_STREAM)),
        ("ReserveSave(victim's pending)", "ReserveSave", pb.ReserveSaveRequest(session_id=S, keys=v.shm_keys)),
        ("WriteBlocks", "WriteBlocks", [_chunk(S, v.res_stream, 0, BLOCK // 2, b"\xee" * (BLOCK // 2))]),
        ("CommitSave(shm)", "CommitSave", pb.CommitSaveRequest(session_id=S, reservation_id=v.res_shm)),
        ("CommitSave(stream)", "CommitSave", pb.CommitSaveRequest(session_id=S, reservation_id=v.res_stream)),
        ("AbortSave(shm)", "AbortSave", pb.AbortSaveRequest(session_id=S, reservation_id=v.res_shm)),
        ("AbortSave(stream)", "AbortSave", pb.AbortSaveRequest(session_id=S, reservation_id=v.res_stream)),
        ("CloseSession", "CloseSession", pb.CloseSessionRequest(session_id=S)),
    ]


def id_attempts(own: str, lease: int, lease2: int, res_stream: int, res_shm: int) -> list:
    """(label, method, request) naming the caller's own session with these leases and reservations."""
    return [
        ("own session: Load", "Load", pb.LoadRequest(session_id=own, lease_id=lease)),
        ("own session: LoadStream", "LoadStream", pb.LoadRequest(session_id=own, lease_id=lease)),
        ("own session: Release+discard", "Release", pb.ReleaseRequest(session_id=own, lease_id=lease, discard=True)),
        ("own session: Release+indices", "Release", pb.ReleaseRequest(session_id=own, lease_id=lease2,
                                                                      discard_indices=[0])),
        ("own session: WriteBlocks", "WriteBlocks", [_chunk(own, res_stream, 0, BLOCK // 2, b"\xee" * (BLOCK // 2))]),
        ("own session: CommitSave(stream)", "CommitSave", pb.CommitSaveRequest(session_id=own, reservation_id=res_stream)),
        ("own session: CommitSave(shm)", "CommitSave", pb.CommitSaveRequest(session_id=own, reservation_id=res_shm)),
        ("own session: AbortSave(stream)", "AbortSave", pb.AbortSaveRequest(session_id=own, reservation_id=res_stream)),
        ("own session: AbortSave(shm)", "AbortSave", pb.AbortSaveRequest(session_id=own, reservation_id=res_shm)),
    ]


def admin_attempts(v: Victim, ns_id: bytes) -> list:
    return [
        ("admin ListNamespaces", "ListNamespaces", apb.ListNamespacesRequest()),
        ("admin InspectBlock", "InspectBlock", apb.InspectBlockRequest(namespace_id=ns_id, key=v.keys[0])),
        ("admin Evict(namespace)", "Evict", apb.EvictRequest(namespace_id=ns_id)),
        ("admin Evict(all)", "Evict", apb.EvictRequest(all=True)),
        ("admin Drain", "Drain", apb.DrainRequest()),
        ("admin Verify", "Verify", apb.VerifyRequest()),
    ]


def shape(details: str, *ids: str) -> str:
    for i in ids:
        details = details.replace(i, "<id>")
    return re.sub(r"\d+", "N", details)


def snapshot(ledger: Any, v: Victim) -> Any:
    s = ledger.sessions.get(v.sid)
    if s is None:
        return {"session": "gone"}
    ns = s.ns
    # The victim's blocks only: an attacker allowed the same model (the socket,
    # a certificate) shares the namespace and adds blocks of its own.
    mine = v.keys + v.stream_keys + v.shm_keys
    return {"deadline": s.expires_at, "leases": sorted(s.leases),
            "reservations": sorted(s.reservations),
            "blocks": {k: (b.state, b.refs, b.hits, b.last_used) for k in mine
                       if (b := ns.blocks.get(k)) is not None},
            "written": {rid: list(ledger.reservations[rid].written or ()) for rid in s.reservations},
            "lease blocks": {lid: [id(b) for b in ledger.leases[lid].blocks] for lid in s.leases}}


class Tally:
    def __init__(self, variant: str) -> None:
        self.variant = variant
        self.attempts = 0
        self.breaches: list[str] = []

    def breach(self, who: str, label: str, what: str) -> None:
        self.breaches.append(f"[{self.variant}] {who}: {label}: {what}")


async def attack(t: Tally, d: Any, victim_party: Party, attackers: list, refused: list,
                 salt: bytes, admin_refused: list = ()) -> None:
    """Each attacker against a fresh victim; `refused` parties must be UNAUTHENTICATED,
    `admin_refused` (tenant tokens) PERMISSION_DENIED on every admin RPC."""
    for n, who in enumerate([*attackers, *refused, *admin_refused]):
        v = await make_victim(victim_party, salt + bytes([n]))
        before = snapshot(d.ledger, v)
        if who in attackers:
            await identity_attack(t, who, v)
        elif who in refused:
            for label, method, req in session_attempts(v, v.sid, b"\x99" * 32):
                t.attempts += 1
                code, details, _ = await who.call(method, req)
                if code != "UNAUTHENTICATED":
                    t.breach(who.name, label, f"{code} {details[:120]!r}, expected UNAUTHENTICATED")
        else:
            ns_id = d.ledger.sessions[v.sid].ns.id
            for label, method, req in admin_attempts(v, ns_id):
                t.attempts += 1
                code, details, _ = await who.call(method, req)
                if code != "PERMISSION_DENIED":
                    t.breach(who.name, label, f"{code} {details[:120]!r}, expected PERMISSION_DENIED")
        after = snapshot(d.ledger, v)
        changed = [k for k in before if before[k] != after.get(k)]
        if changed:
            t.breach(who.name, "victim state", f"{', '.join(changed)} changed by the attempts")
        await victim_still_works(t, who.name, v)


async def identity_attack(t: Tally, who: Party, v: Victim) -> None:
    own = await register(who)
    extra = secrets.token_bytes(32)
    # The victim's live and closed session ids against ids of the same shape nobody was issued.
    for sid in (v.sid, v.closed_sid):
        ref_sid = forged_like(sid)
        for (label, method, req), (_, _, ref) in zip(session_attempts(v, sid, extra),
                                                      session_attempts(v, ref_sid, extra)):
            label = f"{label} ({'live' if sid == v.sid else 'closed'} session)"
            await compare(t, who, label, method, req, ref, (sid, ref_sid), need="NOT_FOUND")
    # The caller's own session with the victim's leases and reservations, against
    # its own leases and reservations that are no longer live.
    mine = await make_victim(who, b"own" + secrets.token_bytes(4))
    dead_own_lease, dead_own_res = mine.dead_lease, mine.dead_res
    for (label, method, req), (_, _, ref) in zip(
            id_attempts(own, v.lease, v.lease2, v.res_stream, v.res_shm),
            id_attempts(own, dead_own_lease, dead_own_lease, dead_own_res, dead_own_res)):
        await compare(t, who, label, method, req, ref, ())
    # And ids beyond any issued: the plain unknown answer.
    for (label, method, req), (_, _, ref) in zip(
            id_attempts(own, v.lease, v.lease, v.res_stream, v.res_shm),
            id_attempts(own, NEVER_ISSUED, NEVER_ISSUED, NEVER_ISSUED, NEVER_ISSUED)):
        t.attempts += 1
        code, details, _ = await who.call(method, ref)
        if code != "NOT_FOUND":
            t.breach(who.name, label + " (never issued)", f"{code} {details[:120]!r}")
    await who.call("CloseSession", pb.CloseSessionRequest(session_id=mine.sid))
    await who.call("CloseSession", pb.CloseSessionRequest(session_id=own))


async def compare(t: Tally, who: Party, label: str, method: str, req: Any, ref: Any,
                  ids: tuple, need: Optional[str] = None) -> None:
    t.attempts += 1
    code, details, _ = await who.call(method, req)
    rcode, rdetails, _ = await who.call(method, ref)
    if code == "OK" or (need is not None and code != need):
        t.breach(who.name, label, f"answered {code} {details[:160]!r}")
    elif (code, shape(details, *ids)) != (rcode, shape(rdetails, *ids)):
        t.breach(who.name, label, f"{code} {details[:160]!r} differs from the reference "
                                  f"{rcode} {rdetails[:160]!r}")


async def victim_still_works(t: Tally, who: str, v: Victim) -> None:
    """The victim's session, lease and reservations are as they were: it loads the
    same bytes, writes the rest of its stream, commits both, releases, closes."""
    p, sid = v.party, v.sid
    steps = [
        ("Heartbeat", pb.HeartbeatRequest(session_id=sid)),
        ("Load", pb.LoadRequest(session_id=sid, lease_id=v.lease)),
        ("LoadStream", pb.LoadRequest(session_id=sid, lease_id=v.lease)),
        ("Release", pb.ReleaseRequest(session_id=sid, lease_id=v.lease2)),
        ("WriteBlocks", [_chunk(sid, v.res_stream, 0, BLOCK // 2, b"\x07" * (BLOCK // 2)),
                         _chunk(sid, v.res_stream, 1, 0, b"\x08" * BLOCK)]),
        ("CommitSave", pb.CommitSaveRequest(session_id=sid, reservation_id=v.res_stream)),
        ("CommitSave", pb.CommitSaveRequest(session_id=sid, reservation_id=v.res_shm)),
        ("Match", pb.MatchRequest(session_id=sid, keys=v.keys)),
        ("Release", pb.ReleaseRequest(session_id=sid, lease_id=v.lease)),
        ("CloseSession", pb.CloseSessionRequest(session_id=sid)),
    ]
    for method, req in steps:
        code, details, resp = await p.call(method, req)
        if code != "OK":
            t.breach(who, f"victim {method} afterwards", f"{code} {details[:160]!r}")
            return
        if method == "LoadStream":
            got = [b"".join(c.data for c in resp if c.index == i) for i in range(3)]
            if got != v.data:
                t.breach(who, "victim's bytes", "changed")
        elif method == "CommitSave" and resp.committed != 2:
            t.breach(who, "victim CommitSave", f"committed {resp.committed} of 2")
        elif method == "Match" and resp.matched != 3:
            t.breach(who, "victim Match", f"matched {resp.matched} of 3")


class LogWatch(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage() + " " + json.dumps(
            {k: str(v) for k, v in record.__dict__.items() if k not in logging.makeLogRecord({}).__dict__}))


@pytest.fixture
def log_watch() -> Any:
    h = LogWatch()
    logger = logging.getLogger("kvkeeper")
    level = logger.level
    logger.addHandler(h)
    logger.setLevel(logging.DEBUG)
    yield h
    logger.removeHandler(h)
    logger.setLevel(level)


@pytest.fixture
def tokens_file(tmp_path: Path) -> str:
    return write_tokens(tmp_path, TOKENS)


@pytest.fixture(scope="module")
def pki() -> Any:
    if openssl() is None:
        pytest.skip("openssl is not installed")
    d = Path(tempfile.mkdtemp(prefix="kvk-pki-"))
    yield make_pki(d, clients=("tenant-a", "tenant-b"))
    shutil.rmtree(d, ignore_errors=True)


def bearer(token: str) -> tuple:
    return (("authorization", f"Bearer {token}"),)


def finish(t: Tally, d: Any, log_watch: LogWatch, tmp_path: Path) -> None:
    assert any("session" in line for line in log_watch.lines), "the daemon's log was not captured"
    leaked = [line for line in log_watch.lines
              if re.search(r"\b[0-9a-f]+-[0-9a-f]{16}\b", line)]
    for line in leaked[:5]:
        t.breach("log", "full session id in a log line", line[:200])
    assert not d.ledger.sessions or all(s.instance_id.startswith("kvkeeper") for s in d.ledger.sessions.values())
    REPORT[t.variant] = {"attempts": t.attempts, "breaches": len(t.breaches)}
    path = Path(os.environ.get("KVKEEPER_CROSS_TENANT_REPORT") or tmp_path / "cross_tenant_report.json")
    path.write_text(json.dumps(REPORT, indent=1))
    print(f"\ncross-tenant [{t.variant}]: {t.attempts} attempts, {len(t.breaches)} breaches; report {path}")
    assert not t.breaches, "\n".join(t.breaches[:30])


async def test_tcp_with_tokens(daemon_factory: Any, tokens_file: str, log_watch: Any,
                               tmp_path: Path) -> None:
    d = await daemon_factory(**{"auth.tokens_file": tokens_file})
    t = Tally("tcp+tokens")
    async with grpc.aio.insecure_channel(f"127.0.0.1:{d.port}") as tcp, \
            grpc.aio.insecure_channel(f"unix:{d.socket_path}") as unix:
        victim = Party("tenant-b", tcp, bearer(TOKEN_B), "model-b")
        attackers = [Party("tenant-a", tcp, bearer(TOKEN_A), "model-a"),
                     Party("ops (admin token)", tcp, bearer(TOKEN_OPS), "model-ops"),
                     Party("socket (no token)", unix, (), "model-b"),
                     Party("tenant-a over the socket", unix, bearer(TOKEN_A), "model-a")]
        refused = [Party("tcp without a token", tcp), Party("tcp with a wrong token", tcp, bearer("x" * 24))]
        await attack(t, d, victim, attackers, refused, b"tcp",
                     admin_refused=[Party("tenant-a (admin RPCs)", tcp, bearer(TOKEN_A))])
    finish(t, d, log_watch, tmp_path)


async def test_mutual_tls(daemon_factory: Any, pki: Path, log_watch: Any, tmp_path: Path) -> None:
    d = await daemon_factory(**{"tls.cert_file": str(pki / "server.pem"),
                                "tls.key_file": str(pki / "server.key"),
                                "tls.client_ca_file": str(pki / "ca.pem")})
    t = Tally("mtls")

    def creds(name: str) -> Any:
        return grpc.ssl_channel_credentials(root_certificates=(pki / "ca.pem").read_bytes(),
                                            private_key=(pki / f"{name}.key").read_bytes(),
                                            certificate_chain=(pki / f"{name}.pem").read_bytes())

    target = f"127.0.0.1:{d.port}"
    async with grpc.aio.secure_channel(target, creds("tenant-b")) as b, \
            grpc.aio.secure_channel(target, creds("tenant-a")) as a, \
            grpc.aio.insecure_channel(f"unix:{d.socket_path}") as unix:
        victim = Party("cert tenant-b", b, (), "model-b")
        # Without a tokens file every certified client may call the admin
        # service by design, and it takes no session ids: nothing to attack there.
        attackers = [Party("cert tenant-a", a, (), "model-b"), Party("socket (no token)", unix, (), "model-b")]
        await attack(t, d, victim, attackers, [], b"tls")
    finish(t, d, log_watch, tmp_path)


async def test_socket_requiring_tokens(daemon_factory: Any, tokens_file: str, log_watch: Any,
                                       tmp_path: Path) -> None:
    d = await daemon_factory(**{"auth.tokens_file": tokens_file, "auth.require_token_on_socket": True,
                                "listen.tcp": ""})
    t = Tally("socket+require_token_on_socket")
    async with grpc.aio.insecure_channel(f"unix:{d.socket_path}") as unix:
        victim = Party("tenant-b", unix, bearer(TOKEN_B), "model-b")
        attackers = [Party("tenant-a", unix, bearer(TOKEN_A), "model-a"),
                     Party("ops (admin token)", unix, bearer(TOKEN_OPS), "model-ops")]
        refused = [Party("socket without a token", unix), Party("socket with a wrong token", unix, bearer("x" * 24))]
        await attack(t, d, victim, attackers, refused, b"uds",
                     admin_refused=[Party("tenant-a (admin RPCs)", unix, bearer(TOKEN_A))])
    finish(t, d, log_watch, tmp_path)
