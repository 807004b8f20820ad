"""A model-based stateful test of the ledger.

Several sessions in two namespaces (1 and 2 pages per block) share a 6-page
tier over 5 keys, so reservations contend, evict, and run out of room. The
model tracks, independently of the ledger, which keys are committed, pending
and leased, who owns which lease and reservation, and every deadline; each rule
predicts the outcome (value or typed error) before calling the ledger.
Evictions are the one thing the model does not choose: it observes them and
checks that they took only unpinned, unrequested blocks, a minimal prefix of
the policy order.
"""
from __future__ import annotations

import copy
from collections import Counter
from typing import Any, Optional

import pytest
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import (RuleBasedStateMachine, initialize, invariant, precondition,
                                 rule)

from kvkeeper.server.errors import (FailedPrecondition, InvalidArgument, NotFound,
                                    ResourceExhausted)
from kvkeeper.server.ids import HOST, Identity
from kvkeeper.server.ledger.chains import stranded
from kvkeeper.server.ledger import (BlockState, Ledger, LedgerConfig, NamespaceDescriptor,
                                    SlotStatus, TierSpec)

PAGE = 100
CAP = 6
TTL = 10.0
RES_TIMEOUT = 3.0
DESCS = [NamespaceDescriptor("ns-a", block_tokens=4, block_bytes=100),
         NamespaceDescriptor("ns-b", block_tokens=4, block_bytes=200)]
PPB = [1, 2]
KEYS = [bytes([i]) * 32 for i in range(5)]
UNKNOWN_SID = "0-unknown"
# Two callers: a session answers only the identity that registered it.
OWNERS = [Identity("token:a"), Identity("token:b")]
# Key chains as a client sends them: a run of consecutive keys, mostly from the start.
def chains(min_size: int) -> st.SearchStrategy[list[bytes]]:
    return st.builds(lambda start, n: KEYS[start:start + n],
                     st.sampled_from([0, 0, 0, 1, 2]), st.integers(min_size, 4))


class LedgerMachine(RuleBasedStateMachine):
    policy = "lru"

    def __init__(self) -> None:
        super().__init__()
        self.led = Ledger(LedgerConfig(tiers=[TierSpec(HOST, CAP * PAGE, PAGE)],
                                       policy=self.policy, lease_ttl_s=TTL,
                                       reservation_timeout_s=RES_TIMEOUT))
        self.now = 0.0
        self.sess: dict[str, list] = {}          # live sid -> [ns index, deadline, owner]
        self.dead: dict[str, int] = {}           # dropped sid -> ns index
        self.dead_owner: dict[str, Identity] = {}
        self.who = OWNERS[0]                     # the identity the next call is made as
        self.leases: dict[int, tuple[str, int, tuple[bytes, ...]]] = {}
        self.old_leases: dict[int, str] = {}     # released lease -> owner
        self.res: dict[int, tuple[str, int, tuple[bytes, ...], float]] = {}
        self.old_res: dict[int, str] = {}        # closed reservation -> owner
        self.committed: list[set[bytes]] = [set(), set()]
        self.pending: list[set[bytes]] = [set(), set()]
        self.ns_ids: list[Optional[bytes]] = [None, None]
        # Open watch calls: (the ledger's Watch, its sid, the reasons on_end was given).
        self.watches: list[tuple[Any, str, list[str]]] = []
        self.disconnected = 0                    # sessions ended by their last watch
        # Pages of reservations the ledger ended itself, out of use till then: (until, pages).
        self.cooling: list[tuple[float, int]] = []

    # ------------------------------------------------------------ model helpers
    def leased(self) -> Counter:
        c: Counter = Counter()
        for _, n, keys in self.leases.values():
            for k in keys:
                c[(n, k)] += 1
        return c

    def drop_session(self, sid: str, closed: bool = False) -> None:
        n, _, owner = self.sess.pop(sid)
        self.dead[sid] = n
        self.dead_owner[sid] = owner
        for lid in [l for l, v in self.leases.items() if v[0] == sid]:
            del self.leases[lid]
            self.old_leases[lid] = sid
        for rid in [r for r, v in self.res.items() if v[0] == sid]:
            self.drop_reservation(rid, cool=not closed)

    def drop_reservation(self, rid: int, cool: bool = True) -> None:
        """The ledger ended it unwritten: its pages cool unless its client said
        it writes no more (cooling.py)."""
        sid, n, keys, deadline = self.res.pop(rid)
        self.pending[n] -= set(keys)
        if cool:
            self.cooling.append((deadline + RES_TIMEOUT, PPB[n] * len(keys)))
        self.old_res[rid] = sid

    def gate(self, sid: str):
        """What the session lookup does, for a call made as self.who: None when
        the call goes ahead, else the error. Another identity's session, live or
        ended, reads as never issued."""
        if sid in self.dead:
            return FailedPrecondition if self.dead_owner[sid] == self.who else NotFound
        if sid not in self.sess or self.sess[sid][2] != self.who:
            if sid in self.sess:
                event("another identity's live session: NotFound")
            return NotFound
        if self.sess[sid][1] < self.now:
            event("session lapsed, dropped by its next call")
            self.drop_session(sid)               # lazily expired by this very call
            return FailedPrecondition
        return None

    def renew(self, sid: str) -> None:
        """A call that succeeded: only those push the session's deadline back."""
        self.sess[sid][1] = self.now + TTL

    def owner_of(self, sid: str) -> Identity:
        if sid in self.sess:
            return self.sess[sid][2]
        return self.dead_owner.get(sid, OWNERS[0])

    def as_owner(self, sid: str) -> str:
        self.who = self.owner_of(sid)
        return sid

    def any_sid(self, data) -> str:
        """Mostly a live session; sometimes a dropped or never-issued one; made
        now and then as the wrong identity."""
        live = sorted(self.sess)
        others = sorted(self.dead) + [UNKNOWN_SID]
        if live and data.draw(st.integers(0, 4), label="live?"):
            sid = data.draw(st.sampled_from(live), label="sid")
        else:
            sid = data.draw(st.sampled_from(others), label="sid")
        self.who = self.owner_of(sid)
        if not data.draw(st.integers(0, 5), label="as its owner?"):
            self.who = OWNERS[1] if self.who == OWNERS[0] else OWNERS[0]
        return sid

    def present(self) -> list[set[bytes]]:
        out = []
        for nid in self.ns_ids:
            ns = self.led.namespaces.get(nid) if nid is not None else None
            out.append(set() if ns is None else set(ns.blocks))
        return out

    def ns_index(self, nid: bytes) -> int:
        return self.ns_ids.index(nid)

    # ------------------------------------------------------------ rules
    @initialize()
    def two_sessions(self):
        self.register(0, 0)
        self.register(1, 1)

    @precondition(lambda self: len(self.sess) < 3)
    @rule(n=st.integers(0, 1), who=st.integers(0, 1))
    def register(self, n, who):
        s = self.led.register_session(f"inst-{len(self.sess) + len(self.dead)}", DESCS[n], self.now,
                                      owner=OWNERS[who])
        assert s.id not in self.sess and s.id not in self.dead
        self.sess[s.id] = [n, self.now + TTL, OWNERS[who]]
        self.ns_ids[n] = bytes(s.ns.id)

    @rule(dt=st.sampled_from([0.0, 0.5, 0.5, 2.0, 3.0, 5.0, 10.0, 11.0]), sweep=st.booleans())
    def advance_time(self, dt, sweep):
        self.now += dt
        if sweep:
            self.expire()

    def expire(self):
        self.cooling = [c for c in self.cooling if c[0] > self.now]   # thawed first
        want_sessions = {sid for sid, (_, dl, _) in self.sess.items() if dl < self.now}
        for sid in want_sessions:
            self.drop_session(sid)
        want_res = {rid for rid, v in self.res.items() if v[3] < self.now}
        for rid in want_res:
            self.drop_reservation(rid)
        report = self.led.expire(self.now)
        if report.sessions or report.reservations:
            event("expire() dropped something")
        assert set(report.sessions) == want_sessions and len(report.sessions) == len(want_sessions)
        assert set(report.reservations) == want_res

    @rule(data=st.data())
    def heartbeat(self, data):
        sid = self.any_sid(data)
        err = self.gate(sid)
        if err:
            with pytest.raises(err):
                self.led.heartbeat(sid, self.now, self.who)
        else:
            self.led.heartbeat(sid, self.now, self.who)
            self.renew(sid)

    @precondition(lambda self: len(self.sess) > 2)
    @rule(data=st.data())
    def close(self, data):
        sid = self.as_owner(data.draw(st.sampled_from(sorted(self.sess)), label="sid"))
        err = self.gate(sid)
        if err:
            with pytest.raises(err):
                self.led.close_session(sid, self.now, self.who)
            return
        self.led.close_session(sid, self.now, self.who)
        self.drop_session(sid, closed=True)

    @precondition(lambda self: len(self.watches) < 6)
    @rule(data=st.data())
    def watch(self, data):
        sid = self.any_sid(data)
        err = self.gate(sid)
        told: list[str] = []
        if err:
            with pytest.raises(err):
                self.led.watch(sid, self.now, self.who, told.append)
            return
        w = self.led.watch(sid, self.now, self.who, told.append)
        self.renew(sid)
        self.watches.append((w, sid, told))

    @precondition(lambda self: self.watches)
    @rule(data=st.data())
    def unwatch(self, data):
        """A watch's call ends: the session's last open one ends the session."""
        w, sid, told = self.watches.pop(data.draw(st.integers(0, len(self.watches) - 1),
                                                  label="watch"))
        last = sid in self.sess and not any(s == sid for _, s, _ in self.watches)
        if last:
            event("last watch ended: session disconnected")
        assert self.led.unwatch(w) is last
        if last:
            self.drop_session(sid)
            self.disconnected += 1

    @rule(data=st.data(), lease=st.booleans())
    def match(self, data, lease):
        sid = self.any_sid(data)
        keys = data.draw(st.one_of(chains(0), st.lists(st.sampled_from(KEYS), max_size=4)),
                         label="keys")
        self.do_match(sid, keys, lease)

    @rule(data=st.data(), n=st.integers(1, 5))
    def lease_prefix(self, data, n):
        """The connector's load path: match a chain from its first key and lease the hit."""
        self.do_match(self.any_sid(data), KEYS[:n], True)

    def do_match(self, sid, keys, lease):
        err = self.gate(sid)
        if err:
            with pytest.raises(err):
                self.led.match(sid, keys, lease=lease, now=self.now, owner=self.who)
            return
        n = self.sess[sid][0]
        expected = 0
        for k in keys:                           # only committed keys count, never pending
            if k not in self.committed[n]:
                break
            expected += 1
        r = self.led.match(sid, keys, lease=lease, now=self.now, owner=self.who)
        self.renew(sid)
        assert r.matched == expected
        if expected and lease:
            event("match: leased a prefix")
        assert r.tiers == [HOST] * expected
        if lease and expected:
            assert r.lease_id is not None and r.lease_id not in self.leases
            assert r.lease_id not in self.old_leases
            self.leases[r.lease_id] = (sid, n, tuple(keys[:expected]))
        else:
            assert r.lease_id is None

    @precondition(lambda self: self.leases or self.old_leases)
    @rule(data=st.data(), discard=st.sampled_from(["keep", "all", "some"]),
          foreign=st.booleans(), last_turn=st.booleans())
    def release(self, data, discard, foreign, last_turn):
        if self.leases and (not self.old_leases or data.draw(st.integers(0, 4), label="live?")):
            lid = data.draw(st.sampled_from(sorted(self.leases)), label="lid")
        else:
            lid = data.draw(st.sampled_from(sorted(self.old_leases)), label="lid")
        owner = self.leases[lid][0] if lid in self.leases else self.old_leases[lid]
        sid = self.any_sid(data) if foreign else self.as_owner(owner)
        # Positions to discard; -1 and 5 are outside every lease (at most 5 keys).
        indices = data.draw(st.lists(st.integers(-1, 5), max_size=3), label="indices") \
            if discard == "some" else []
        err = self.gate(sid)
        if err is None and (lid not in self.leases or self.leases[lid][0] != sid):
            err = FailedPrecondition             # released already, or someone else's
        if err is None and any(not 0 <= i < len(self.leases[lid][2]) for i in indices):
            err = InvalidArgument                # the lease stays held
        call = lambda: self.led.release(sid, lid, self.now, discard=discard == "all",  # noqa: E731
                                        discard_indices=indices, owner=self.who,
                                        last_turn=last_turn)
        if err:
            with pytest.raises(err):
                call()
            return
        call()
        self.renew(sid)
        _, n, keys = self.leases.pop(lid)
        self.old_leases[lid] = sid
        dropped = keys if discard == "all" else [keys[i] for i in indices]
        if dropped:
            event("release: discarded")
        if last_turn:
            event("release: a last turn (demoted)")
        still = self.leased()
        for k in dropped:
            if still[(n, k)] == 0:
                self.committed[n].discard(k)

    @rule(data=st.data(), then_commit=st.sampled_from([True, True, False]))
    def reserve(self, data, then_commit):
        sid = self.any_sid(data)
        keys = data.draw(st.one_of(chains(1),
                                   st.lists(st.sampled_from(KEYS), min_size=1, max_size=4,
                                            unique=True)),
                         label="keys")
        self.do_reserve(sid, keys, then_commit)

    @precondition(lambda self: self.sess)
    @rule(data=st.data(), n=st.integers(1, 4))
    def save_then_load(self, data, n):
        """The connector's round trip: save a chain from its first key, then lease it."""
        sid = self.as_owner(data.draw(st.sampled_from(sorted(self.sess)), label="sid"))
        self.do_reserve(sid, KEYS[:n], then_commit=True)
        self.do_match(self.as_owner(sid), KEYS[:n], lease=True)

    @precondition(lambda self: self.sess)
    @rule(data=st.data(), n=st.integers(1, 5), name_parent=st.booleans())
    def lookup_save_release_commit(self, data, n, name_parent):
        """The connector's usual order: look a chain up leasing the hit, save the
        rest (naming its parent, or leaving that to the lookup), release the lease,
        and only then commit: no block may be left stranded by it."""
        sid = self.as_owner(data.draw(st.sampled_from(sorted(self.sess)), label="sid"))
        before = set(self.leases)
        self.do_match(sid, KEYS[:n], True)
        if sid not in self.sess:
            return
        lids = sorted(set(self.leases) - before)
        h = len(self.leases[lids[0]][2]) if lids else 0
        res_before = set(self.res)
        if h < n:
            parent = (KEYS[h - 1] if h else b"") if name_parent else None
            self.do_reserve(self.as_owner(sid), KEYS[h:n], then_commit=False, parent=parent)
        if sid not in self.sess:
            return
        for lid in lids:
            self.as_owner(sid)
            self.led.release(sid, lid, self.now, owner=self.who)
            self.renew(sid)
            self.leases.pop(lid)
            self.old_leases[lid] = sid
        for rid in sorted(set(self.res) - res_before):
            self.close_reservation(rid, self.as_owner(sid), commit=True)

    def first_parent(self, n, key, parent):
        """The key a save's first key is filed under: the one named, else the
        one a Match that stopped at `key` hit last (the ledger's hint)."""
        if parent is None:
            hinted = self.led.namespaces[self.ns_ids[n]].hints.get(key)
            return None if hinted is None else bytes(hinted.key)
        return parent or None

    def refuses_admission(self, sid, keys, parent) -> bool:
        """s3fifo may turn away a run that continues a cold one (a one-off
        document, a demoted last turn) where it would evict (s3fifo.admit_run,
        tested in test_s3fifo.py). When a copy of the ledger refuses, the
        ledger must refuse alike: every new key NOT_ADMITTED, nothing else
        changed, and only when the free pages would not do."""
        if self.policy != "s3fifo":
            return False
        twin = copy.deepcopy(self.led)
        try:
            r = twin.reserve(sid, keys, self.now, owner=self.who, parent=parent)
        except ResourceExhausted:
            return False
        if SlotStatus.NOT_ADMITTED not in r.statuses:
            return False
        event("reserve: s3fifo admission refused a cold run")
        tier = self.led.top
        before = (self.present(), tier.free_pages, tier.evictable_pages, dict(tier.evictions),
                  tier.admission_refused)
        got = self.led.reserve(sid, keys, self.now, owner=self.who, parent=parent)
        self.renew(sid)
        refused = [i for i, st_ in enumerate(got.statuses) if st_ == SlotStatus.NOT_ADMITTED]
        assert got.statuses == r.statuses and got.reservation_id is None
        n = self.sess[sid][0]
        assert all(keys[i] not in self.committed[n] | self.pending[n] for i in refused)
        assert tier.free_pages < PPB[n] * len(refused), "refused with room free"
        after = (self.present(), tier.free_pages, tier.evictable_pages, dict(tier.evictions),
                 tier.admission_refused - len(refused))
        assert after == before
        return True

    def do_reserve(self, sid, keys, then_commit, parent=None):
        err = self.gate(sid)
        if err:
            with pytest.raises(err):
                self.led.reserve(sid, keys, self.now, owner=self.who, parent=parent)
            return
        n = self.sess[sid][0]
        leased = self.leased()
        statuses, new = [], []
        for k in keys:
            if k in self.committed[n]:
                statuses.append(SlotStatus.PRESENT)
            elif k in self.pending[n]:
                statuses.append(SlotStatus.IN_FLIGHT)
            else:
                statuses.append(SlotStatus.RESERVED)
                new.append(k)
        pinned = sum(PPB[m] * (len(self.pending[m]) + len({k for (mm, k) in leased if mm == m}))
                     for m in (0, 1)) + sum(pages for _, pages in self.cooling)
        protected = {(n, k) for k, st_ in zip(keys, statuses)
                     if st_ == SlotStatus.PRESENT and leased[(n, k)] == 0}
        up = self.first_parent(n, keys[0], parent) if new and new[0] == keys[0] else None
        if up is not None and up in self.committed[n] and not leased[(n, up)]:
            protected.add((n, up))           # a save never evicts the block it extends
        room = CAP - pinned - PPB[n] * len(protected)
        needed = PPB[n] * len(new)
        tier = self.led.top
        if new and self.refuses_admission(sid, keys, parent):
            return
        if new and needed > room:
            event("reserve: resource exhausted")
            before = (self.present(), tier.free_pages, tier.evictable_pages, dict(tier.evictions))
            with pytest.raises(ResourceExhausted):
                self.led.reserve(sid, keys, self.now, owner=self.who, parent=parent)
            after = (self.present(), tier.free_pages, tier.evictable_pages, dict(tier.evictions))
            assert after == before               # nothing reserved, nothing evicted
            return
        # The order reserve evicts in: the policy's with the PRESENT blocks taken
        # out (as reserve does), read off a copy so this ledger is not touched.
        twin = copy.deepcopy(self.led)
        for m, k in protected:
            twin.top.policy.remove(twin.block(self.ns_ids[m], k))
        order = [(self.ns_index(bytes(b.ns.id)), bytes(b.key)) for b in twin.top.policy]
        free_before = tier.free_pages
        r = self.led.reserve(sid, keys, self.now, owner=self.who, parent=parent)
        self.renew(sid)
        assert r.statuses == statuses
        if not new:
            assert r.reservation_id is None and r.blocks == [None] * len(keys)
            return
        assert r.reservation_id is not None
        assert r.reservation_id not in self.res and r.reservation_id not in self.old_res
        assert r.expires_at == self.now + RES_TIMEOUT
        # Which committed blocks went, and were they fair game?
        present = self.present()
        evicted = {(m, k) for m in (0, 1) for k in self.committed[m] if k not in present[m]}
        assert not any(leased[x] for x in evicted), "a leased block was evicted"
        assert not evicted & protected, "a block reported PRESENT was evicted"
        candidates = order
        assert evicted == set(candidates[:len(evicted)]), "victims are not the policy's order"
        freed = sum(PPB[m] for m, _ in evicted)
        assert free_before + freed >= needed
        if evicted:
            last = candidates[len(evicted) - 1]
            assert free_before + freed - PPB[last[0]] < needed, "evicted more than needed"
        if evicted:
            event("reserve: evicted" + (" around PRESENT keys" if protected else ""))
        for m, k in evicted:
            self.committed[m].discard(k)
        self.pending[n] |= set(new)
        self.res[r.reservation_id] = (sid, n, tuple(new), self.now + RES_TIMEOUT)
        if then_commit:
            self.close_reservation(r.reservation_id, sid, commit=True)

    def pick_reservation(self, data, foreign) -> tuple[int, str]:
        if self.res and (not self.old_res or data.draw(st.integers(0, 4), label="open?")):
            rid = data.draw(st.sampled_from(sorted(self.res)), label="rid")
        else:
            rid = data.draw(st.sampled_from(sorted(self.old_res)), label="rid")
        owner = self.res[rid][0] if rid in self.res else self.old_res[rid]
        return rid, self.any_sid(data) if foreign else self.as_owner(owner)

    def close_reservation(self, rid: int, sid: str, commit: bool, checksums: bool = False):
        err = self.gate(sid)
        if err is None:
            if rid not in self.res or self.res[rid][0] != sid:
                err = FailedPrecondition
            elif self.res[rid][3] < self.now:
                event("reservation timed out, dropped by its commit/abort")
                self.drop_reservation(rid)       # timed out, swept by this call
                err = FailedPrecondition
        r = self.led.reservations.get(rid)
        sums = list(range(len(r.entries))) if checksums and r is not None else ()
        if commit:
            call = lambda: self.led.commit(sid, rid, self.now, checksum_algo=1,  # noqa: E731
                                           checksums=sums, owner=self.who)
        else:
            call = lambda: self.led.abort(sid, rid, self.now, self.who)  # noqa: E731
        if err:
            with pytest.raises(err):
                call()
            return
        _, n, keys, _ = self.res[rid]
        got = call()
        self.renew(sid)
        self.res.pop(rid)
        self.old_res[rid] = sid
        self.pending[n] -= set(keys)
        if commit:
            assert got == len(keys)
            self.committed[n] |= set(keys)

    @precondition(lambda self: self.res or self.old_res)
    @rule(data=st.data(), foreign=st.booleans(), checksums=st.booleans())
    def commit(self, data, foreign, checksums):
        rid, sid = self.pick_reservation(data, foreign)
        self.close_reservation(rid, sid, True, checksums)

    @precondition(lambda self: self.res)
    @rule(data=st.data(), commit=st.booleans())
    def just_too_late(self, data, commit):
        """A writer that finishes half a second after its reservation's deadline."""
        rid = data.draw(st.sampled_from(sorted(self.res)), label="rid")
        self.now = max(self.now, self.res[rid][3] + 0.5)
        self.close_reservation(rid, self.as_owner(self.res[rid][0]), commit)

    @precondition(lambda self: self.res or self.old_res)
    @rule(data=st.data(), foreign=st.booleans())
    def abort(self, data, foreign):
        rid, sid = self.pick_reservation(data, foreign)
        self.close_reservation(rid, sid, False)

    @precondition(lambda self: self.led.top.free_pages == 0)   # rare, or it empties the tier
    @rule()
    def reclaim_unpinned(self):
        leased = self.leased()
        expected = 0
        for n in (0, 1):
            keep = {k for k in self.committed[n] if leased[(n, k)]}
            expected += len(self.committed[n] - keep)
            self.committed[n] = keep
        assert self.led.reclaim_unpinned() == expected

    # ------------------------------------------------------------ invariants
    @invariant()
    def books_balance(self):
        led, tier = self.led, self.led.top
        led.check_invariants()
        # No stranded block (its chain lost a block) is evicted after one that is not.
        flags = [stranded(b) for b in tier.policy]
        assert flags == sorted(flags, reverse=True), "a stranded block is not evicted first"
        used = sum(PPB[n] * (len(self.committed[n]) + len(self.pending[n])) for n in (0, 1))
        used += sum(pages for _, pages in self.cooling)
        assert tier.used_pages == used
        assert tier.free_pages == CAP - used >= 0
        leased = self.leased()
        evictable = sum(PPB[n] for n in (0, 1) for k in self.committed[n] if not leased[(n, k)])
        assert tier.evictable_pages == evictable
        for n, nid in enumerate(self.ns_ids):
            ns = led.namespaces.get(nid) if nid is not None else None
            blocks = {} if ns is None else ns.blocks
            assert {k for k, b in blocks.items() if b.state is BlockState.COMMITTED} == self.committed[n]
            assert {k for k, b in blocks.items() if b.state is BlockState.PENDING} == self.pending[n]
            assert len(blocks) == len(self.committed[n]) + len(self.pending[n])
            for k, b in blocks.items():
                assert b.refs >= 0 and b.refs == leased[(n, k)]
        # A block held by a live lease is present and committed, whatever was evicted.
        for (n, k), count in leased.items():
            b = led.block(self.ns_ids[n], k)
            assert b is not None and b.state is BlockState.COMMITTED and b.refs == count
        for b in tier.policy:
            assert b.refs == 0 and b.state is BlockState.COMMITTED
        assert set(led.sessions) == set(self.sess)
        assert set(led.leases) == set(self.leases)
        assert set(led.reservations) == set(self.res)
        for sid, (n, deadline, owner) in self.sess.items():
            assert led.sessions[sid].owner == owner
            assert led.sessions[sid].expires_at == deadline
        # A watch is told once that its session ended, and only then.
        for _, sid, told in self.watches:
            assert len(told) == (sid not in self.sess) and set(told) <= {"closed", "expired"}
        assert led.session_ends["disconnected"] == self.disconnected
        assert sum(led.session_ends.values()) == len(self.dead)


class HitsLRULedgerMachine(LedgerMachine):
    policy = "hits-lru"


class S3FIFOLedgerMachine(LedgerMachine):
    policy = "s3fifo"


# derandomize: CI runs the same 150 programs every time (a random draw that
# fails also spends minutes shrinking). A random run once found stranded
# blocks evicted out of the order ChainPolicy reports (strand() re-queued an
# already stranded subtree); test_chains.py now checks that case directly.
SETTINGS = settings(max_examples=150, stateful_step_count=30, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow])

TestLedgerStatefulLRU = LedgerMachine.TestCase
TestLedgerStatefulLRU.settings = SETTINGS
TestLedgerStatefulHitsLRU = HitsLRULedgerMachine.TestCase
TestLedgerStatefulHitsLRU.settings = SETTINGS
TestLedgerStatefulS3FIFO = S3FIFOLedgerMachine.TestCase
TestLedgerStatefulS3FIFO.settings = SETTINGS
