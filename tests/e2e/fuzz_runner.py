"""The stub fuzzer's engine: sends each Case as raw bytes, judges the answer,
learns the ids that successful requests create, builds the real sessions the
next batch fuzzes around, and checks the daemon between batches. The cases
come from fuzz_cases.py; tests/e2e/test_fuzz_stubs.py runs it."""
from __future__ import annotations

import asyncio
import logging
from collections import Counter, defaultdict
from typing import Any, Optional

import grpc
from grpc_health.v1 import health_pb2

from kvkeeper.v1 import admin_pb2 as apb
from kvkeeper.v1 import kvkeeper_pb2 as pb

from fuzz_cases import (BLOCK, HEALTH, METHODS, OWNER_IDENT, OWNERS, Case, Generator, Ident,
                        OwnerState, Pool)

# A call the fuzzer did not deadline must still answer: past this it hangs.
SAFETY_S = 30.0
# Documented answers. CANCELLED and DEADLINE_EXCEEDED only where the fuzzer
# cancelled or deadlined the call, UNIMPLEMENTED only for unknown methods.
ALLOWED = frozenset({"OK", "INVALID_ARGUMENT", "NOT_FOUND", "FAILED_PRECONDITION", "OUT_OF_RANGE",
                     "RESOURCE_EXHAUSTED", "UNAUTHENTICATED", "PERMISSION_DENIED", "UNAVAILABLE"})
# Longest status message: every quoted client value is truncated.
MAX_DETAILS = 1024
# grpc.aio's client (grpcio <= 1.85 at least) reports INTERNAL with this text
# when the server ends a client stream (any status) while the client is still
# writing: a later failed write overwrites the status the server sent
# (grpc/grpc#36066, fix proposed in grpc/grpc#43486). The daemon's own answer is
# checked where it is counted: no INTERNAL in kvkeeper_rpc_errors_total.
CLIENT_STREAM_ARTIFACT = ("INTERNAL", "Internal error from Core")
BLOCK_SIZES = (BLOCK, 3 * BLOCK + 100, 100, 2 * BLOCK)


class ErrorLog(logging.Handler):
    """Records at ERROR or above from the daemon's loggers: a client must not cause one."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


class Fuzzer:
    def __init__(self, daemon: Any, unix: Any, tcp: Any, errors: ErrorLog, *, seed: str,
                 max_keys: int, max_message: int) -> None:
        self.daemon = daemon
        self.seed = seed
        self.errors = errors
        self.channels = {"unix": unix, "tcp": tcp}
        self.pool = Pool()
        self.gen = Generator(seed, self.pool, max_keys, max_message)
        self.codes: Counter = Counter()
        self.by_method: dict[str, Counter] = defaultdict(Counter)
        self.kinds: Counter = Counter()
        self.problems: list[str] = []
        self.sent = 0
        self._callables: dict[tuple, Any] = {}

    # ------------------------------------------------------------ sending
    def _callable(self, ident: Ident, path: str, cs: bool, ss: bool) -> Any:
        key = (ident.channel, path, cs, ss)
        mc = self._callables.get(key)
        if mc is None:
            ch = self.channels[ident.channel]
            make = ch.stream_unary if cs else ch.unary_stream if ss else ch.unary_unary
            mc = self._callables[key] = make(path)
        return mc

    async def send(self, case: Case) -> tuple[str, str, list]:
        """(code name, details, response bytes) of one case, as sent."""
        mc = self._callable(case.ident, case.method, case.client_streaming, case.server_streaming)
        kw = dict(metadata=case.ident.metadata or None,
                  timeout=case.deadline if case.deadline is not None else SAFETY_S)
        out: list = []
        try:
            if case.client_streaming:
                out.append(await self._client_stream(mc, case, kw))
            elif case.server_streaming:
                call = mc(case.payloads[0], **kw)
                if case.cancel_after == 0:
                    call.cancel()
                async for msg in call:
                    out.append(msg)
                    if case.cancel_after is not None and len(out) >= case.cancel_after:
                        call.cancel()
                        break
                code = await call.code()
                return code.name, await call.details() or "", out
            else:
                call = mc(case.payloads[0], **kw)
                if case.cancel_after is not None:
                    await asyncio.sleep(0)
                    call.cancel()
                out.append(await call)
        except grpc.aio.AioRpcError as e:
            return e.code().name, e.details() or "", out
        except asyncio.CancelledError:
            # grpc.aio raises this for a CANCELLED status, whoever cancelled:
            # check() flags it unless the fuzzer did.
            return "CANCELLED", "(asyncio.CancelledError)", out
        return "OK", "", out

    async def _client_stream(self, mc: Any, case: Case, kw: dict) -> Any:
        gate = asyncio.Event()

        async def chunks() -> Any:
            for i, p in enumerate(case.payloads):
                if i == case.cancel_after:
                    gate.set()
                    await asyncio.sleep(3600)   # hold the stream open until cancelled
                yield p
                await asyncio.sleep(0)

        call = mc(chunks(), **kw)
        if case.cancel_after is None:
            return await call
        done = asyncio.ensure_future(self._await(call))
        opened = asyncio.ensure_future(gate.wait())
        await asyncio.wait({done, opened}, return_when=asyncio.FIRST_COMPLETED)
        opened.cancel()
        if not done.done():
            call.cancel()
        return await done

    @staticmethod
    async def _await(call: Any) -> Any:
        return await call

    async def call(self, owner_ident: Ident, name: str, request: Any) -> tuple[str, str, Any]:
        """A well-formed typed call (deep-state set-up and the final checks)."""
        meta = METHODS[name]
        payloads = request if meta.client_streaming else [request.SerializeToString()]
        case = Case(-1, meta.path, "setup", owner_ident, payloads, meta.server_streaming,
                    meta.client_streaming, meta)
        code, details, out = await self.send(case)
        resp = meta.response.FromString(out[-1]) if code == "OK" and out and not meta.server_streaming else out
        return code, details, resp

    async def ok(self, ident: Ident, name: str, request: Any) -> Any:
        code, details, resp = await self.call(ident, name, request)
        assert code == "OK", f"{name} as {ident.name}: {code} {details}"
        return resp

    # ------------------------------------------------------------ one case
    def check(self, case: Case, code: str, details: str, out: list) -> list[str]:
        bad = []
        cancelled, deadlined = case.cancel_after is not None, case.deadline is not None
        if case.meta is None and case.method != HEALTH:
            if code not in {"UNIMPLEMENTED"} | ({"CANCELLED"} if cancelled else set()) | \
                    ({"DEADLINE_EXCEEDED"} if deadlined else set()):
                bad.append(f"unknown method answered {code}")
            return bad
        if case.client_streaming and (code, details) == CLIENT_STREAM_ARTIFACT:
            return bad
        allowed = set(ALLOWED)
        if cancelled:
            allowed.add("CANCELLED")
        if deadlined:
            # A deadline that expires while the client is still streaming can
            # surface as the local cancellation of the stream.
            allowed |= {"DEADLINE_EXCEEDED", "CANCELLED"}
        if code not in allowed:
            bad.append(f"code {code} is not a documented answer")
        if len(details) > MAX_DETAILS:
            bad.append(f"status message of {len(details)} chars (unbounded echo?)")
        if code in ("CANCELLED", "DEADLINE_EXCEEDED") and code in allowed:
            return bad
        malformed = case.malformed()
        if "malformed" in details and not any(malformed):
            bad.append(f"well-formed request answered as malformed: {details[:200]}")
        ident, meta = case.ident, case.meta
        trusted = ident.owner is not None and (meta is None or not meta.admin or ident.admin)
        strict = malformed[:1] == [True] if case.client_streaming else any(malformed)
        if case.oversized and (not case.client_streaming or len(case.payloads) == 1):
            # A stream's caller is refused before its first message is read.
            if code != "RESOURCE_EXHAUSTED" and (trusted or not case.client_streaming or
                                                 code not in {"UNAUTHENTICATED", "PERMISSION_DENIED"}):
                bad.append(f"oversized request answered {code}")
        elif strict and not case.oversized and meta is not None:
            refusals = set() if trusted else {"UNAUTHENTICATED", "PERMISSION_DENIED"}
            prefix = f"malformed {meta.short} request"
            if not (code == "INVALID_ARGUMENT" and details.startswith(prefix)) and code not in refusals:
                bad.append(f"undecodable request answered {code} {details[:120]!r}, "
                           f"expected INVALID_ARGUMENT {prefix!r}")
        elif not trusted and code not in {"UNAUTHENTICATED", "PERMISSION_DENIED"} and \
                meta is not None and not any(malformed):
            bad.append(f"{ident.name} (not allowed) answered {code}")
        if case.expect is not None and trusted and not any(malformed) and code not in case.expect:
            bad.append(f"expected {sorted(case.expect)}, got {code} {details[:160]!r}")
        if code == "OK" and meta is not None and not meta.client_streaming and not meta.server_streaming:
            try:
                meta.response.FromString(out[-1])
            except Exception as e:  # noqa: BLE001
                bad.append(f"OK answer does not decode as {meta.response.__name__}: {e}")
        return bad

    def harvest(self, case: Case, code: str, out: list) -> None:
        """Learn the ids a successful fuzz request created or ended."""
        if code != "OK" or case.meta is None or case.meta.client_streaming:
            return
        name = case.meta.path.rsplit("/", 1)[1]
        req = case.meta.request.FromString(case.payloads[0])
        owner = self._live_owner(getattr(req, "session_id", None))
        if name == "RegisterSession":
            self.pool.fuzz_sessions.append((case.ident, pb.RegisterSessionResponse.FromString(out[-1]).session_id))
        if owner is None:
            return
        st = self.pool.owners[owner]
        if name == "CloseSession":
            self._retire(owner)
        elif name == "Match":
            resp = pb.MatchResponse.FromString(out[-1])
            if resp.lease_id:
                st.leases.append((resp.lease_id, resp.matched))
        elif name == "Release":
            st.leases = [x for x in st.leases if x[0] != req.lease_id]
            self.pool.dead_leases.append((owner, req.lease_id))
        elif name == "ReserveSave":
            resp = pb.ReserveSaveResponse.FromString(out[-1])
            if resp.reservation_id:
                target = st.res_stream if req.transport == pb.TRANSPORT_STREAM else st.res_shm
                target.append((resp.reservation_id, list(req.keys)))
        elif name in ("CommitSave", "AbortSave"):
            st.res_shm = [x for x in st.res_shm if x[0] != req.reservation_id]
            st.res_stream = [x for x in st.res_stream if x[0] != req.reservation_id]
            self.pool.dead_reservations.append((owner, req.reservation_id))

    def _live_owner(self, sid: Optional[str]) -> Optional[str]:
        for o, st in self.pool.owners.items():
            if sid and st.sid == sid:
                return o
        return None

    def _retire(self, owner: str) -> None:
        st = self.pool.owners[owner]
        self.pool.closed.append((owner, st.sid))
        self.pool.dead_leases.extend((owner, lid) for lid, _ in st.leases)
        self.pool.dead_reservations.extend((owner, rid) for rid, _ in st.res_shm + st.res_stream)
        self.pool.owners[owner] = OwnerState()
        for lst in (self.pool.closed, self.pool.dead_leases, self.pool.dead_reservations):
            del lst[:-64]

    async def one(self, index: int) -> None:
        case = self.gen.case(index)
        logged = len(self.errors.records)
        code, details, out = await self.send(case)
        self.sent += 1
        if len(self.errors.records) > logged:
            # Exact with KVKEEPER_FUZZ_CONCURRENCY=1; otherwise one of the calls in flight.
            rec = self.errors.records[logged]
            tb = logging.Formatter().formatException(rec.exc_info)[-600:] if rec.exc_info else ""
            self.problems.append(f"the daemon logged at ERROR during this call: "
                                 f"{rec.getMessage()[:200]}\n    {case.describe()}\n{tb}")
        for problem in self.check(case, code, details, out):
            self.problems.append(f"{problem}\n    {case.describe()}")
        self.harvest(case, code, out)
        if case.client_streaming and (code, details) == CLIENT_STREAM_ARTIFACT:
            code = "INTERNAL(grpc.aio client, grpc#36066)"
        self.codes[code] += 1
        self.by_method[case.method.rsplit("/", 1)[-1] or case.method][code] += 1
        self.kinds[case.kind] += 1

    # ------------------------------------------------------------ deep state
    async def close_all(self) -> None:
        """Close every session the fuzzer knows of, as its owner. Some may be gone
        already (closed by a fuzz request, expired): what remains is checked."""
        for owner in OWNERS:
            st = self.pool.owners[owner]
            if st.sid:
                await self.call(OWNER_IDENT[owner], "CloseSession", pb.CloseSessionRequest(session_id=st.sid))
                self._retire(owner)
        for ident, sid in self.pool.fuzz_sessions:
            await self.call(ident, "CloseSession", pb.CloseSessionRequest(session_id=sid))
        self.pool.fuzz_sessions.clear()

    async def refresh(self, batch: int) -> None:
        """Close last batch's sessions; give each owner a fresh one with blocks,
        leases and open reservations for the next batch to fuzz around."""
        await self.close_all()
        for n, owner in enumerate(OWNERS):
            ident = OWNER_IDENT[owner]
            # The socket's blocks change size from batch to batch: partial last
            # pages, several pages, less than a page.
            size = BLOCK_SIZES[batch % len(BLOCK_SIZES)] if owner == "socket" else BLOCK
            reg = await self.ok(ident, "RegisterSession", pb.RegisterSessionRequest(
                instance_id=f"fuzz-{owner}", namespace=pb.NamespaceDescriptor(
                    model_id=ident.model, dtype="float16", block_tokens=16, block_bytes=size)))
            st = OwnerState(sid=reg.session_id, ns_id=reg.namespace_id)
            self.pool.owners[owner] = st
            salt = f"{self.seed}/{batch}/{n}".encode()
            keys = [bytes([i]) * 4 + salt.ljust(28, b".")[:28] for i in range(8)]
            rid, _ = await self._reserve(ident, st, keys[:4], pb.TRANSPORT_STREAM)
            if rid:
                chunks = [pb.WriteChunk(session_id=st.sid, reservation_id=rid, index=i,
                                        data=bytes([i]) * size).SerializeToString() for i in range(4)]
                await self.ok(ident, "WriteBlocks", chunks)
                await self.ok(ident, "CommitSave", pb.CommitSaveRequest(session_id=st.sid, reservation_id=rid))
            st.committed = keys[:4]
            for k in (2, 4):
                m = await self.ok(ident, "Match", pb.MatchRequest(session_id=st.sid, keys=keys[:k], lease=True))
                if m.lease_id:
                    st.leases.append((m.lease_id, m.matched))
            st.pending = keys[4:]
            rid, ks = await self._reserve(ident, st, keys[4:6], pb.TRANSPORT_SHM)
            if rid:
                st.res_shm.append((rid, ks))
            rid, ks = await self._reserve(ident, st, keys[6:8], pb.TRANSPORT_STREAM)
            if rid:
                st.res_stream.append((rid, ks))

    async def _reserve(self, ident: Ident, st: OwnerState, keys: list, transport: int) -> tuple[int, list]:
        req = pb.ReserveSaveRequest(session_id=st.sid, keys=keys, transport=transport)
        code, details, resp = await self.call(ident, "ReserveSave", req)
        if code == "RESOURCE_EXHAUSTED":
            # Fuzz requests filled the tier: make room as an operator would.
            await self.ok(OWNER_IDENT["ops"], "Evict", apb.EvictRequest(all=True))
            code, details, resp = await self.call(ident, "ReserveSave", req)
        assert code == "OK", f"set-up ReserveSave as {ident.name}: {code} {details}"
        return resp.reservation_id, keys

    # ------------------------------------------------------------ batch checks
    async def check_daemon(self, errors: ErrorLog) -> None:
        for ch in self.channels.values():
            for service in ("", "kvkeeper.v1.KVKeeper"):
                r = await ch.unary_unary(
                    "/grpc.health.v1.Health/Check",
                    request_serializer=health_pb2.HealthCheckRequest.SerializeToString,
                    response_deserializer=health_pb2.HealthCheckResponse.FromString)(
                        health_pb2.HealthCheckRequest(service=service), timeout=SAFETY_S)
                assert r.status == health_pb2.HealthCheckResponse.SERVING
        stats = await self.ok(OWNER_IDENT["socket"], "Stats", pb.StatsRequest())
        check_stats(stats, self.daemon.ledger)
        self.daemon.ledger.check_invariants()
        if self.daemon.disk is not None:
            self.daemon.disk.index.check_invariants()
        assert not errors.records, "the daemon logged at ERROR:\n" + "\n".join(
            r.getMessage()[:300] for r in errors.records[:5])
        for metric in self.daemon.metrics.rpc_errors.collect():
            for s in metric.samples:
                if s.name.endswith("_total") and s.labels.get("code") in ("INTERNAL", "UNKNOWN"):
                    assert s.value == 0, f"{s.labels} counted {s.value}"


def check_stats(stats: Any, ledger: Any) -> None:
    assert stats.tiers, "Stats lists no tier"
    for t in stats.tiers:
        assert t.used_bytes <= t.capacity_bytes and t.used_pages <= t.capacity_pages, t
        assert t.pinned_bytes + t.evictable_bytes <= t.used_bytes, t
        assert t.pending_blocks <= t.blocks, t
    assert stats.sessions == len(ledger.sessions) and stats.leases == len(ledger.leases)
    assert stats.reservations == len(ledger.reservations)
