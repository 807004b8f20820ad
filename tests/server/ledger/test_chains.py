"""Chain order (server/ledger/chains.py) through the ledger, for every policy:
leaves before their parents, stranded blocks first, links kept both ways."""
from __future__ import annotations

import pytest

from kvkeeper.server.errors import InvalidArgument
from kvkeeper.server.ledger.chains import GONE, children, private_run, stranded
from kvkeeper.server.ledger.recency import FREQ


def chain_keys(key, start, n):
    return [key(i) for i in range(start, start + n)]


def order(led):
    return [b.key for b in led.top.policy]


def test_a_reserve_links_each_key_to_the_one_before(make_ledger, descriptor, key, store, policy):
    led = make_ledger(8, policy=policy)
    s = led.register_session("i", descriptor(), 0.0)
    ks = chain_keys(key, 0, 4)
    store(led, s.id, ks)
    blocks = [led.block(s.ns.id, k) for k in ks]
    assert blocks[0].parent is None
    assert [b.parent for b in blocks[1:]] == blocks[:3]
    assert [children(b) for b in blocks] == [[blocks[1]], [blocks[2]], [blocks[3]], []]
    led.check_invariants()


def test_a_parent_is_not_evicted_before_its_cached_children(make_ledger, descriptor, key,
                                                             store, policy):
    """A conversation's next turn (children) saved after its first (parents): the
    first turn is older, yet the policy takes the second turn's leaves first."""
    led = make_ledger(8, policy=policy)
    s = led.register_session("i", descriptor(), 0.0)
    turn1 = chain_keys(key, 0, 3)
    store(led, s.id, turn1, 1.0)
    turn2 = chain_keys(key, 3, 3)
    r = led.reserve(s.id, turn2, 2.0, parent=turn1[-1])
    led.commit(s.id, r.reservation_id, 2.0)
    listed = order(led)
    for i, k in enumerate(listed):          # every block after all its descendants
        b = led.block(s.ns.id, k)
        assert all(c.key in listed[:i] for c in children(b))
    store(led, s.id, chain_keys(key, 100, 4), 3.0)     # evicts 2 of the 6
    held = set(led.namespaces[s.ns.id].blocks)
    for k in held:
        b = led.block(s.ns.id, k)
        assert not stranded(b) and (b.parent is None or b.parent.key in held)
    led.check_invariants()


def test_release_before_commit_leaves_no_block_stranded(make_ledger, descriptor, key, store,
                                                        policy):
    """The connector's order: lease the hit, reserve the rest, release, commit.
    Pressure in between evicts the hit's tail; the new blocks are stranded the
    moment they commit, and go first."""
    led = make_ledger(6, policy=policy)
    s = led.register_session("i", descriptor(), 0.0)
    prefix = chain_keys(key, 0, 3)
    store(led, s.id, prefix, 1.0)
    m = led.match(s.id, prefix + [key(3)], lease=True, now=2.0)
    assert m.matched == 3
    r = led.reserve(s.id, [key(3)], 2.0)            # parent from the Match's hint
    assert led.block(s.ns.id, key(3)).parent is led.block(s.ns.id, prefix[-1])
    led.release(s.id, m.lease_id, 2.5)
    store(led, s.id, chain_keys(key, 50, 4), 3.0)   # needs 2 of the prefix's pages
    led.check_invariants()
    assert led.block(s.ns.id, prefix[-1]) is None   # the leaf of what was evictable
    led.commit(s.id, r.reservation_id, 4.0)
    orphan = led.block(s.ns.id, key(3))
    assert orphan.parent is GONE and stranded(orphan)
    assert order(led)[0] == key(3)                   # reclaimed first
    led.check_invariants()
    store(led, s.id, [key(200)], 5.0)
    assert led.block(s.ns.id, key(3)) is None
    led.check_invariants()


def test_discarding_a_parent_strands_its_subtree_first(make_ledger, descriptor, key, store,
                                                       policy):
    led = make_ledger(8, policy=policy)
    s = led.register_session("i", descriptor(), 0.0)
    ks = chain_keys(key, 0, 5)
    store(led, s.id, ks, 1.0)
    store(led, s.id, [key(9)], 1.5)                 # unrelated
    m = led.match(s.id, ks[:2], lease=True, now=2.0)
    led.release(s.id, m.lease_id, 2.0, discard_indices=[1])
    assert led.block(s.ns.id, ks[1]) is None
    strays = [led.block(s.ns.id, k) for k in ks[2:]]
    assert all(stranded(b) for b in strays)
    assert set(order(led)[:3]) == set(ks[2:])       # before the unrelated and the root
    led.check_invariants()


def test_stranded_blocks_go_in_the_order_the_policy_reports(make_ledger, descriptor, key, store,
                                                            policy):
    """Evicting a stranded block whose children are stranded already must not
    move them in the order: the victims are the order listed before."""
    led = make_ledger(8, policy=policy)
    s = led.register_session("i", descriptor(), 0.0)
    ks = chain_keys(key, 0, 5)
    store(led, s.id, ks, 1.0)
    store(led, s.id, [key(9)], 1.5)                 # unrelated
    m = led.match(s.id, ks[:1], lease=True, now=2.0)
    led.release(s.id, m.lease_id, 2.0, discard_indices=[0])    # strands ks[1:]
    listed = order(led)
    store(led, s.id, chain_keys(key, 100, 5), 3.0)  # 8 pages, 5 held: evicts 2
    held = set(led.namespaces[s.ns.id].blocks)
    evicted = [k for k in listed if k not in held]
    assert evicted == listed[:len(evicted)] and len(evicted) == 2
    led.check_invariants()


def test_a_save_names_its_parent_or_its_chain_start(make_ledger, descriptor, key, store,
                                                    snapshot, policy):
    led = make_ledger(8, policy=policy)
    s = led.register_session("i", descriptor(), 0.0)
    store(led, s.id, [key(0)])
    r = led.reserve(s.id, [key(1)], 1.0, parent=key(0))
    assert led.block(s.ns.id, key(1)).parent is led.block(s.ns.id, key(0))
    led.commit(s.id, r.reservation_id, 1.0)
    r = led.reserve(s.id, [key(7)], 1.0, parent=key(6))   # its parent is not cached
    led.commit(s.id, r.reservation_id, 1.0)
    assert led.block(s.ns.id, key(7)).parent is GONE and order(led)[0] == key(7)
    r = led.reserve(s.id, [key(8)], 1.0, parent=b"")      # a chain's first block
    assert led.block(s.ns.id, key(8)).parent is None
    led.check_invariants()
    before = snapshot(led)
    with pytest.raises(InvalidArgument, match="parent key has 3 bytes"):
        led.reserve(s.id, [key(20)], 2.0, parent=b"abc")
    with pytest.raises(InvalidArgument, match="one of the keys"):
        led.reserve(s.id, [key(20), key(21)], 2.0, parent=key(21))
    with pytest.raises(InvalidArgument, match="parent key must be bytes"):
        led.reserve(s.id, [key(20)], 2.0, parent=[1, 2])
    with pytest.raises(InvalidArgument, match="key 0 is a list"):
        led.reserve(s.id, [[1, 2]], 2.0, parent=key(1))   # not an unhashable TypeError
    assert snapshot(led) == before
    r = led.reserve(s.id, [bytearray(key(20))], 2.0, parent=bytearray(key(8)))
    assert led.block(s.ns.id, key(20)).parent is led.block(s.ns.id, key(8))


def test_a_hit_on_a_parked_parent_puts_it_back_in_the_order(make_ledger, descriptor, key,
                                                            store, policy):
    led = make_ledger(4, policy=policy)
    s = led.register_session("i", descriptor(), 0.0)
    store(led, s.id, [key(0)], 1.0)
    r = led.reserve(s.id, [key(1)], 1.0, parent=key(0))   # a pending child
    store(led, s.id, [key(5)], 2.0)
    store(led, s.id, [key(6)], 2.0)    # full: next save evicts, key(0) is parked
    store(led, s.id, [key(7)], 3.0)
    parent = led.block(s.ns.id, key(0))
    assert parent is not None, "a parent with a pending child was evicted first"
    assert parent in list(led.top.policy.parked)
    led.match(s.id, [key(0)], lease=False, now=4.0)
    assert parent not in list(led.top.policy.parked)
    led.commit(s.id, r.reservation_id, 4.0)
    led.check_invariants()


def test_only_ancestors_of_pinned_blocks_left_evicts_a_parked_one(make_ledger, descriptor, key,
                                                                  store, policy):
    """Forced: every evictable block has a pinned child. A parked one goes; its
    pinned child, stranded, goes first once released."""
    led = make_ledger(3, policy=policy)
    s = led.register_session("i", descriptor(), 0.0)
    ks = chain_keys(key, 0, 2)
    store(led, s.id, ks, 1.0)
    m = led.match(s.id, ks, lease=True, now=2.0)
    led.narrow(s.id, m.lease_id, 1, 1, 2.0)      # keeps the child, unpins the root
    store(led, s.id, [key(10)], 3.0)             # the free page
    store(led, s.id, [key(11)], 3.0)             # evicts key(10), a leaf: not the root
    assert led.block(s.ns.id, ks[0]) is not None
    m2 = led.match(s.id, [key(11)], lease=True, now=3.5)
    store(led, s.id, [key(12)], 4.0)             # only the parked root is left
    assert led.block(s.ns.id, ks[0]) is None
    led.release(s.id, m.lease_id, 5.0)
    led.release(s.id, m2.lease_id, 5.0)
    assert stranded(led.block(s.ns.id, ks[1])) and order(led)[0] == ks[1]
    led.check_invariants()


def test_a_lookup_down_to_a_leaf_rereads_only_the_unbranched_tail(make_ledger, descriptor, key,
                                                                  store):
    """private_run: a conversation's next turn reads its history down to the
    leaf; only the blocks below the last branch (another conversation under
    the same system prompt) are its own."""
    led = make_ledger(16, policy="s3fifo")
    s = led.register_session("i", descriptor(), 0.0)
    system, a = chain_keys(key, 0, 2), chain_keys(key, 2, 3)
    store(led, s.id, system + a, 1.0)
    blk = [led.block(s.ns.id, k) for k in system + a]
    assert private_run(blk) == 5                   # nobody branched off yet
    assert private_run(blk[:4]) == 0               # a prefix: its tail has a child
    assert private_run([]) == 0
    b = chain_keys(key, 10, 2)
    r = led.reserve(s.id, b, 2.0, parent=system[-1])
    led.commit(s.id, r.reservation_id, 2.0)
    assert private_run(blk) == 3                   # a's own blocks only
    assert private_run(blk[:2]) == 0               # the shared prefix has children
    # Through the ledger and s3fifo: three more turns of a read its history
    # back; its own blocks earn a frequency of 1, the shared prefix the most.
    for t in range(3):
        led.match(s.id, system + a, lease=False, now=3.0 + t)
    assert [b.pq & FREQ for b in blk] == [3, 3, 1, 1, 1]
    assert [b.hits for b in blk] == [3] * 5
    led.check_invariants()


def test_rereads_count_in_full_once_the_namespace_says_last_turns(make_ledger, descriptor, key,
                                                                  store):
    """A namespace whose clients release last turns gets ended histories
    demoted; from its first such release a lookup's own history counts as hits."""
    led = make_ledger(16, policy="s3fifo")
    s = led.register_session("i", descriptor(), 0.0)
    a = chain_keys(key, 0, 3)
    store(led, s.id, a, 1.0)
    blk = [led.block(s.ns.id, k) for k in a]
    led.match(s.id, a, lease=False, now=2.0)
    assert [b.pq & FREQ for b in blk] == [1, 1, 1]
    other = chain_keys(key, 10, 2)
    store(led, s.id, other, 3.0)
    m = led.match(s.id, other, lease=True, now=4.0)
    assert not s.ns.says_last_turn
    led.release(s.id, m.lease_id, 4.0, last_turn=True)
    assert s.ns.says_last_turn
    for t in range(2):
        led.match(s.id, a, lease=False, now=5.0 + t)
    assert [b.pq & FREQ for b in blk] == [3, 3, 3]
    led.check_invariants()


@pytest.mark.parametrize("read_first", [False, True])
def test_a_due_parent_that_gets_a_child_again_waits_behind_it(make_ledger, descriptor, key,
                                                              policy, read_first):
    """A parent whose last child left waits in `due`, first in line. A
    conversation that reads it again (and saves its next turn under it) must
    take it out of there: a read puts it back in the policy's order, a new
    cached child parks it behind that child; evicted first, it would strand
    the child it just got."""
    led = make_ledger(4, policy=policy)
    s = led.register_session("i", descriptor(), 0.0)
    A, B, C, X, Y, Z = (key(i) for i in range(1, 7))

    def put(k, parent, now):
        r = led.reserve(s.id, [k], now, parent=parent)
        led.commit(s.id, r.reservation_id, now)
    put(A, b"", 0.0)
    put(B, A, 0.5)
    put(X, b"", 1.0)
    put(Z, b"", 1.5)
    put(Y, b"", 2.0)              # full: A is parked behind B, B goes, A is due
    a = led.block(s.ns.id, A)
    assert led.block(s.ns.id, B) is None and a in list(led.top.policy.due)
    lz = led.match(s.id, [Z], lease=True, now=2.5).lease_id
    led.release(s.id, lz, 2.5, discard=True)   # one page free, A untouched
    if read_first:
        led.match(s.id, [A, C], lease=False, now=3.0)
        assert a not in list(led.top.policy.due), "a read left it first in line"
    put(C, A, 3.0)                # its next turn, under it: no eviction needed
    assert a not in list(led.top.policy.due)
    led.check_invariants()
    put(key(50), b"", 4.0)        # one page of room: not A, whose child C is cached
    assert led.match(s.id, [A, C], lease=False, now=5.0).matched == 2
    led.check_invariants()


def test_a_save_never_evicts_the_block_it_extends(make_ledger, descriptor, key, policy):
    """A save under an unleased parent (decode blocks, a client that saves
    without a lookup) on a full tier: making its room must not evict that
    parent, or the new block is stranded (never matchable) from birth."""
    led = make_ledger(3, policy=policy)
    s = led.register_session("i", descriptor(), 0.0)
    P, X, Y, C = key(1), key(2), key(3), key(4)
    for i, k in enumerate((P, X, Y)):
        r = led.reserve(s.id, [k], float(i), parent=b"")
        led.commit(s.id, r.reservation_id, float(i))
    r = led.reserve(s.id, [C], 3.0, parent=P)        # P is the oldest: the policy's first pick
    assert led.block(s.ns.id, P) is not None and r.blocks[0].parent is led.block(s.ns.id, P)
    led.commit(s.id, r.reservation_id, 3.0)
    assert led.match(s.id, [P, C], lease=False, now=4.0).matched == 2
    led.check_invariants()
