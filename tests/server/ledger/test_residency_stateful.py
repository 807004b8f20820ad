"""A model-based stateful test of the gpu tier's books and their event log.

Engines (sessions) in two namespaces report batched changes over 6 keys with
small capacities, repeat reports (report_seq), send bad ones, close, expire;
the model predicts every book (an ordered set trimmed oldest-first to the
capacity) and every event, and after each step check_invariants() runs, a
Locate is compared with the model, and the event log replayed from 0 (or the
gap it reports) must be exactly the model's events.
"""
from __future__ import annotations

from typing import Any

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvkeeper.server.errors import InvalidArgument
from kvkeeper.server.ids import HOST
from kvkeeper.server.ledger import Ledger, LedgerConfig, NamespaceDescriptor, TierSpec
from kvkeeper.server.ledger.events import CLEARED, REMOVED, STORED
from kvkeeper.server.ledger.residency import Change, engine_of

KEYS = [i.to_bytes(32, "big") for i in range(6)]
TTL = 10.0
BUFFER_KEYS = 12
DESCS = [NamespaceDescriptor("ns-a", block_tokens=4, block_bytes=100),
         NamespaceDescriptor("ns-b", block_tokens=4, block_bytes=100)]

changes = st.lists(st.one_of(
    st.builds(lambda ks: (STORED, ks), st.lists(st.sampled_from(KEYS), max_size=4)),
    st.builds(lambda ks: (REMOVED, ks), st.lists(st.sampled_from(KEYS), max_size=3)),
    st.just((CLEARED, []))), max_size=4)


class ResidencyMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.led = Ledger(LedgerConfig(tiers=[TierSpec(HOST, 800, 100)], lease_ttl_s=TTL,
                                       event_buffer_keys=BUFFER_KEYS))
        self.now = 0.0
        self.live: dict[str, dict[str, Any]] = {}   # sid -> {ns, deadline, book, cap, seq}
        self.events: list[tuple] = []               # (kind, engine, keys), in seq order

    def _emit(self, kind: str, sid: str, keys: list[bytes]) -> None:
        self.events.append((kind, engine_of(sid), tuple(keys)))

    @rule(ns=st.integers(0, 1))
    @precondition(lambda self: len(self.live) < 4)
    def register(self, ns: int) -> None:
        s = self.led.register_session(f"e{len(self.live)}", DESCS[ns], self.now)
        self.live[s.id] = {"ns": ns, "deadline": self.now + TTL, "book": {}, "cap": 0,
                           "seq": 0}

    @rule(data=st.data(), batch=changes, cap=st.integers(0, 5), seq=st.integers(0, 4))
    @precondition(lambda self: self.live)
    def report(self, data: Any, batch: list, cap: int, seq: int) -> None:
        sid = data.draw(st.sampled_from(sorted(self.live)))
        m = self.live[sid]
        new_book = m["cap"] == 0
        if new_book and cap == 0:
            before = self.led.residency.log.last_seq
            try:
                self.led.report_residency(sid, [Change(k, ks) for k, ks in batch], self.now)
            except InvalidArgument:
                assert self.led.residency.log.last_seq == before
                return
            raise AssertionError("a first report without a capacity was taken")
        r = self.led.report_residency(sid, [Change(k, ks) for k, ks in batch], self.now,
                                      capacity_blocks=cap, report_seq=seq)
        m["deadline"] = self.now + TTL
        if not new_book and seq and seq <= m["seq"]:
            assert not r.applied
            return
        assert r.applied
        if cap:
            m["cap"] = cap
        if seq:
            m["seq"] = seq
        book = m["book"]
        for kind, ks in batch:
            if kind == STORED:
                for k in ks:
                    book.pop(k, None)
                    book[k] = None
                if ks:
                    self._emit(STORED, sid, ks)
            elif kind == REMOVED:
                gone = [k for k in ks if book.pop(k, 0) is None]
                if gone:
                    self._emit(REMOVED, sid, gone)
            else:
                book.clear()
                self._emit(CLEARED, sid, [])
        over = len(book) - m["cap"]
        if over > 0:
            gone = list(book)[:over]
            for k in gone:
                del book[k]
            self._emit(REMOVED, sid, gone)
        assert r.resident_blocks == len(book)

    @rule(data=st.data())
    @precondition(lambda self: self.live)
    def close(self, data: Any) -> None:
        sid = data.draw(st.sampled_from(sorted(self.live)))
        self.led.close_session(sid, self.now)
        self._ended(sid)

    def _ended(self, sid: str) -> None:
        if self.live.pop(sid)["cap"]:
            self._emit(CLEARED, sid, [])

    @rule(dt=st.sampled_from([1.0, 6.0, 11.0]))
    def tick(self, dt: float) -> None:
        self.now += dt
        self.led.expire(self.now)
        # In registration order, as the ledger drops them.
        for sid in [sid for sid, m in self.live.items() if m["deadline"] < self.now]:
            self._ended(sid)

    @rule(ns=st.integers(0, 1), start=st.integers(0, 3), n=st.integers(0, 6))
    def locate(self, ns: int, start: int, n: int) -> None:
        chain = KEYS[start:start + n]
        p = self.led.locate_chain(DESCS[ns].digest(), chain)
        want = {}
        for sid, m in self.live.items():
            if m["ns"] == ns and m["cap"]:
                held = 0
                while held < len(chain) and chain[held] in m["book"]:
                    held += 1
                want[engine_of(sid)] = held
        assert {e.engine: e.prefix for e in p.engines} == want
        assert [e.prefix for e in p.engines] == sorted(want.values(), reverse=True)

    @invariant()
    def books_and_events_agree(self) -> None:
        self.led.check_invariants()
        r = self.led.residency
        assert {sid: list(b.blocks) for sid, b in r.books.items()} == \
            {sid: list(m["book"]) for sid, m in self.live.items() if m["cap"]}
        log = r.log
        assert log.last_seq == len(self.events)
        replay = log.since(0)
        first = replay.events[0].seq if replay.events else log.last_seq + 1
        assert replay.lost == ((1, first - 1) if first > 1 else None)
        got = [(e.kind, e.engine, e.keys) for e in replay.events]
        assert got == self.events[first - 1:]


TestResidencyStateful = ResidencyMachine.TestCase
TestResidencyStateful.settings = settings(max_examples=150, stateful_step_count=30,
                                          deadline=None, derandomize=True)
