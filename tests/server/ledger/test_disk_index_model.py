"""The disk index (server/ledger/disk_index.py) against a model: random operations,
and after each one the invariants, the bytes used, the LRU order of unpinned
stored entries and every entry's state agree with what the model predicts."""
from __future__ import annotations

import random
from collections import OrderedDict

import pytest

from disk_index_helpers import B, NS, key, lru_order
from kvkeeper.server.errors import InvalidTransition, ResourceExhausted
from kvkeeper.server.ledger.disk_index import DiskEntry, DiskIndex


def test_random_walk_keeps_the_invariants_and_matches_a_model():
    """Random operations against a model: bytes used, the LRU order of
    unpinned stored entries, the pins, and what each call returns or raises."""
    rng = random.Random(11)
    cap = 12 * B
    ix = DiskIndex(cap)
    model_state: dict[int, str] = {}                       # key -> "writing" | "stored"
    size: dict[int, int] = {}
    pins: dict[int, int] = {}
    lru: OrderedDict[int, None] = OrderedDict()            # unpinned stored keys, oldest first
    held: dict[int, DiskEntry] = {}
    for step in range(3000):
        i = rng.randrange(16)
        op = rng.choice(["reserve", "finish", "adopt", "pin", "unpin", "touch", "drop", "evict"])
        e = held.get(i)
        if op == "reserve":
            n = rng.choice([B, 2 * B, 3 * B])
            if i in model_state:
                assert ix.reserve(NS, key(i), n) is None
                continue
            used = sum(size.values())
            evictable = sum(size[k] for k in lru)
            if n > cap - used + evictable:
                with pytest.raises(ResourceExhausted):
                    ix.reserve(NS, key(i), n)
                continue
            victims = []
            while cap - used < n:
                v, _ = lru.popitem(last=False)
                used -= size.pop(v)
                del model_state[v]
                victims.append(v)
            res = ix.reserve(NS, key(i), n)
            assert res is not None and [int.from_bytes(w[1], "big") for w in res.evicted] == victims
            model_state[i], size[i], pins[i], held[i] = "writing", n, 0, res.entry
        elif op == "finish" and model_state.get(i) == "writing":
            if rng.random() < 0.7:
                ix.written(e)
                model_state[i] = "stored"
                lru[i] = None
            else:
                ix.failed(e)
                del model_state[i], size[i]
        elif op == "adopt" and i not in model_state:
            n = B
            got = ix.adopt(NS, key(i), n)
            if sum(size.values()) + n > cap:
                assert got is None
            else:
                assert got is not None
                model_state[i], size[i], pins[i], held[i] = "stored", n, 0, got
                lru[i] = None
        elif op == "pin" and e is not None:
            if model_state.get(i) == "stored" and held[i] is ix.entries.get((NS, key(i))):
                ix.pin(e)
                pins[i] += 1
                lru.pop(i, None)
            else:
                with pytest.raises(InvalidTransition):
                    ix.pin(e)
        elif op == "unpin" and e is not None:
            if pins.get(i, 0) > 0:
                ix.unpin(e)
                pins[i] -= 1
                if pins[i] == 0 and model_state.get(i) == "stored" and e is ix.entries.get((NS, key(i))):
                    lru[i] = None
            else:
                with pytest.raises(InvalidTransition):
                    ix.unpin(e)
        elif op == "touch":
            got = ix.get(NS, key(i))
            assert (got is not None) == (model_state.get(i) == "stored")
            if got is not None:
                ix.touch(got)
                if i in lru:
                    lru.move_to_end(i)
        elif op == "drop":
            got = ix.get(NS, key(i))
            if got is not None:
                ix.drop(got, "lost")
                del model_state[i], size[i]
                lru.pop(i, None)
        elif op == "evict" and rng.random() < 0.05:
            out = ix.evict_unpinned()
            assert [int.from_bytes(w[1], "big") for w in out] == list(lru)
            for k in lru:
                del model_state[k], size[k]
            lru.clear()
        ix.check_invariants()
        assert ix.used_bytes == sum(size.values()), step
        assert lru_order(ix) == list(lru), step
        assert {int.from_bytes(w[1], "big"): e.state.value for w, e in ix.entries.items()} == model_state
