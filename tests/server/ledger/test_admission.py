"""The host tier's admission of cold runs through the ledger (s3fifo's
admit_run): a long run of keys nobody saved lately is refused on a full tier
and filed to be evicted first otherwise; recency policies admit everything."""
from __future__ import annotations

import pytest

from kvkeeper.server.ids import Identity
from kvkeeper.server.ledger import SlotStatus
from kvkeeper.server.ledger.policy import COLD, FREQ, QUEUE, Q1, Q2, S3FIFOPolicy

RUN = S3FIFOPolicy.RUN


def keys(key, start, n):
    return [key(i) for i in range(start, start + n)]


def order(led):
    return [b.key for b in led.top.policy]


def full_ledger(make_ledger, descriptor, key, store, policy="s3fifo", pages=2 * RUN):
    """A tier of `pages` one-page blocks, full, filled in runs short enough to be admitted."""
    led = make_ledger(pages, policy=policy)
    s = led.register_session("i", descriptor(), 0.0)
    for start in range(0, pages, RUN // 2):
        store(led, s.id, keys(key, start, RUN // 2), 1.0)
    assert led.top.free_pages == 0
    return led, s


def test_a_long_fresh_run_on_a_full_tier_is_refused_and_changes_nothing(
        make_ledger, descriptor, key, store, snapshot):
    led, s = full_ledger(make_ledger, descriptor, key, store)
    before = snapshot(led)
    doc = [key(0)] + keys(key, 1000, RUN + 1)          # one present, then a one-off document
    r = led.reserve(s.id, doc, 2.0)
    assert r.reservation_id is None and r.blocks == [None] * len(doc)
    assert r.statuses == [SlotStatus.PRESENT] + [SlotStatus.NOT_ADMITTED] * (RUN + 1)
    after = snapshot(led)
    before["sessions"] = after["sessions"]               # the call renewed its session
    assert after == before
    assert led.top.admission_refused == RUN + 1
    # Remembered: the same document saved again is admitted, into main.
    r = led.reserve(s.id, doc[1:], 3.0)
    assert r.reservation_id is not None and r.statuses == [SlotStatus.RESERVED] * (RUN + 1)
    led.commit(s.id, r.reservation_id, 3.0)
    assert all(led.block(s.ns.id, k).pq & QUEUE == Q2 for k in doc[1:])
    led.check_invariants()


def test_a_short_run_or_one_with_room_is_admitted(make_ledger, descriptor, key, store):
    led, s = full_ledger(make_ledger, descriptor, key, store)
    r = led.reserve(s.id, keys(key, 1000, RUN), 2.0)      # RUN fresh keys: not a cold run
    assert r.reservation_id is not None and led.top.admission_refused == 0
    led2 = make_ledger(4 * RUN, policy="s3fifo")
    s2 = led2.register_session("i", descriptor(), 0.0)
    r = led2.reserve(s2.id, keys(key, 0, RUN + 1), 2.0)   # cold, but nothing to evict
    assert r.reservation_id is not None and all(b.pq & COLD for b in r.blocks)


def test_a_cold_run_is_evicted_first_until_hit_and_its_continuation_is_cold(
        make_ledger, descriptor, key, store):
    led = make_ledger(4 * RUN, policy="s3fifo")
    s = led.register_session("i", descriptor(), 0.0)
    old = keys(key, 0, 4)
    store(led, s.id, old, 1.0)
    doc = keys(key, 100, RUN + 1)
    store(led, s.id, doc, 2.0)
    more = keys(key, 200, 2)                              # the document's next prefill step
    r = led.reserve(s.id, more, 3.0, parent=doc[-1])
    assert all(b.pq & COLD for b in r.blocks)
    led.commit(s.id, r.reservation_id, 3.0)
    listed = order(led)
    assert set(listed[:RUN + 3]) == set(doc + more) and listed[RUN + 3:] == old[::-1]
    m = led.match(s.id, doc[:2], lease=False, now=4.0)    # read again: not a one-off
    assert m.matched == 2
    hit = [led.block(s.ns.id, k) for k in doc[:2]]
    assert all(not b.pq & COLD and b.pq & QUEUE == Q2 for b in hit)
    assert not set(doc[:2]) & set(order(led)[:RUN + 1])
    led.check_invariants()


def test_a_conversation_turn_under_the_leaf_it_read_back_is_filed_warm(
        make_ledger, descriptor, key, store):
    """The ledger files a WARM run (s3fifo admit_run) with a frequency of 1;
    a message under a shared prefix that has other children is filed plain."""
    led = make_ledger(8 * RUN, policy="s3fifo")
    s = led.register_session("i", descriptor(), 0.0)
    turn = keys(key, 0, 4)                  # a system prompt, a message, its answer
    store(led, s.id, turn, 1.0)
    assert led.match(s.id, turn, lease=False, now=2.0).matched == 4   # the next turn reads it
    nxt = keys(key, 100, 2)
    r = led.reserve(s.id, nxt, 2.0, parent=turn[-1])
    led.commit(s.id, r.reservation_id, 2.0)
    assert all(b.pq & FREQ == 1 and b.pq & QUEUE == Q1 for b in r.blocks)
    other = keys(key, 200, 2)               # another message under the same turn: not warm
    r = led.reserve(s.id, other, 3.0, parent=turn[-1])
    led.commit(s.id, r.reservation_id, 3.0)
    assert all(b.pq & FREQ == 0 for b in r.blocks)
    led.check_invariants()


@pytest.mark.parametrize("policy", ["lru", "hits-lru"])
def test_recency_policies_admit_every_run(make_ledger, descriptor, key, store, policy):
    led, s = full_ledger(make_ledger, descriptor, key, store, policy=policy)
    r = led.reserve(s.id, keys(key, 1000, 2 * RUN), 2.0)
    assert r.reservation_id is not None and led.top.admission_refused == 0
    assert not any(b.pq & COLD for b in r.blocks)


def test_promotions_are_never_refused(make_ledger, descriptor, key, store):
    led, s = full_ledger(make_ledger, descriptor, key, store)
    r = led.reserve_internal(s.ns.id, keys(key, 1000, RUN + 1), 2.0)
    assert r.reservation_id is not None and led.top.admission_refused == 0
    led.abort_internal(r.reservation_id, 2.0)
    led.check_invariants()


def test_one_tenant_cannot_read_anothers_evictions_through_admission(make_ledger, descriptor,
                                                                     key):
    """s3fifo's ghosts remember (namespace, key): a tenant who guesses another
    tenant's key and saves it in a long run on a full tier is answered as for
    any key it never saved."""
    A, B = Identity("token:a"), Identity("token:b")
    led = make_ledger(20, policy="s3fifo", lease_ttl_s=1000.0)
    a = led.register_session("a", descriptor("model-A"), 0.0, owner=A)
    b = led.register_session("b", descriptor("model-B"), 0.0, owner=B)

    def put(sid, keys, now, owner):
        r = led.reserve(sid, keys, now, parent=b"", owner=owner)
        if r.reservation_id is not None:
            led.commit(sid, r.reservation_id, now, owner=owner)
    secret = key(777)
    put(a.id, [secret], 0.0, A)
    for i in range(20):                  # A's traffic fills the tier: the secret goes
        put(a.id, [key(1000 + i)], 1.0 + i, A)
    assert led.block(a.ns.id, secret) is None

    def probe(guess, base):
        for i in range(20):
            put(a.id, [key(base + 100000 + i)], 20.0, A)
        assert led.top.free_pages == 0
        r = led.reserve(b.id, [key(base + i) for i in range(16)] + [guess], 30.0,
                        parent=b"", owner=B)
        if r.reservation_id is not None:
            led.abort(b.id, r.reservation_id, 30.0, owner=B)
        return r.statuses[-1]
    assert probe(secret, 5000) == probe(key(888), 6000)
    led.check_invariants()
