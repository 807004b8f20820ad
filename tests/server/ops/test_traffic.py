"""The traffic recorder (server/ops/traffic.py): requests joined with the saves
that continue them, written in Match order, bounded, and read back by the
policy bench as the trace it records."""
from __future__ import annotations

import json
import os

from kvkeeper.server.bench.policy_trace import extend, read_trace
from kvkeeper.server.ops.traffic import NO_TRAFFIC, TrafficRecorder


def chain(name: bytes, n: int, prefix: list[bytes] = []) -> list[bytes]:
    return extend(list(prefix), (b"%s.%d" % (name, j) for j in range(n)))


def recorder(**kw):
    # Two sessions in namespace "m", one in "other".
    return TrafficRecorder({"s1": "m", "s2": "m", "s3": "other"}.get, limit=kw.pop("limit", 100),
                           **kw)


def lines(rec, now=1e9):
    return [json.loads(x) for x in rec.take(now)]


def test_a_request_is_its_lookup_then_the_saves_that_continue_its_chain():
    rec = recorder()
    prompt = chain(b"p", 6)
    rec.match("s1", prompt, 7, now=0.0)
    rec.saved("s1", prompt[2:5], prompt[1], now=0.1)   # missed prompt blocks: nothing to add
    answer = chain(b"d", 3, prompt)[6:]
    rec.saved("s1", [prompt[4], prompt[5], answer[0]], prompt[3], now=0.2)  # past its end
    rec.saved("s1", answer[1:], answer[0], now=0.3)                        # decode, named parent
    rec.saved("s1", chain(b"z", 2), None, now=0.3)       # nobody's: not recorded
    rec.saved("gone", answer[1:], answer[0], now=0.3)     # a session the ledger refused
    rec.saved("s1", [answer[-1], b"short"], None, now=0.3)  # keys the ledger refused
    rec.released(7, last_turn=True, now=0.4)
    assert rec.take(50.0) == []                          # still open: touched 0.4 s ago
    [d] = lines(rec, 0.4 + rec.idle_s)
    assert d == {"keys": [k.hex() for k in prompt + answer], "prompt_blocks": 6,
                 "last_turn": True, "ns": "m"}
    assert rec.written == 1 and rec.finished is False   # limit 100: still recording


def test_a_next_turns_saves_extend_the_next_turn_not_the_one_it_continues():
    # Measured with vLLM: the next turn's new blocks were saved under the last
    # block of the previous turn's answer, and joined that turn.
    rec = recorder()
    first = chain(b"p", 3)
    rec.match("s1", first, 1, now=0.0)
    answer = chain(b"d", 1, first)[3:]
    rec.saved("s1", first + answer, b"", now=0.1)
    turn = chain(b"m", 2, first + answer)                 # history + a new message
    rec.match("s1", turn, 2, now=1.0)
    rec.saved("s1", turn[4:5], answer[-1], now=1.1)       # a missed block: nothing
    more = chain(b"e", 1, turn)[6:]
    rec.saved("s1", turn[4:] + more, answer[-1], now=1.2)   # the rest and its answer
    one, two = lines(rec)
    assert one["keys"] == [k.hex() for k in first + answer]
    assert two["keys"] == [k.hex() for k in turn + more] and two["prompt_blocks"] == 6


def test_lines_come_in_match_order_and_a_full_buffer_writes_its_oldest():
    rec = recorder(open_bytes=200)      # keys of 32 B: room for 6 of them
    a, b, c = chain(b"a", 2), chain(b"b", 2), chain(b"c", 2)
    rec.match("s1", a, 1, now=0.0)
    rec.match("s1", b, 2, now=1.0)
    rec.saved("s1", chain(b"x", 1, a)[2:], a[-1], now=5.0)   # a touched last, still first out
    assert rec.take(1.0 + rec.idle_s - 0.1) == []
    assert rec.held == 5 * 32
    rec.match("s2", c, 3, now=2.0)                          # 7 keys open: the oldest goes
    [first] = lines(rec, 2.0)
    assert rec.held == 4 * 32
    assert first["keys"][:2] == [k.hex() for k in a] and len(first["keys"]) == 3
    rec.released(1, last_turn=True, now=3.0)                 # a is written: no effect
    assert [d["keys"][0] for d in lines(rec)] == [b[0].hex(), c[0].hex()]
    assert rec.held == 0
    assert "last_turn" not in first


def test_namespaces_stay_apart_and_saves_join_only_their_own():
    rec = recorder()
    p = chain(b"p", 2)
    rec.match("s3", p, 0, now=0.0)                 # no lease (Match without one)
    rec.saved("s1", chain(b"d", 1, p)[2:], p[-1], now=0.1)   # same key, namespace m
    rec.released(0, last_turn=True, now=0.2)       # lease 0: nobody's
    [d] = [json.loads(x) for x in rec.drain()]
    assert d == {"keys": [k.hex() for k in p], "prompt_blocks": 2, "ns": "other"}


def test_recording_stops_after_its_limit_and_drain_writes_what_is_open():
    rec = recorder(limit=2)
    for i in range(4):
        rec.match("s1", chain(b"r%d" % i, 1), i + 1, now=float(i))
    rec.match("s1", [], 9, now=5.0)                # an empty lookup is no request
    rec2 = recorder()
    rec2.match("gone", [b"k"], 9, now=5.0)         # nor one of an unknown session
    assert rec2.requests == 0
    assert rec.requests == 2 and not rec.finished
    assert len(rec.drain()) == 2 and rec.finished
    assert rec.drain() == [] and rec.take(1e9) == []


def test_the_null_recorder_takes_every_call():
    NO_TRAFFIC.match("s", [b"k"], 1, 0.0)
    NO_TRAFFIC.saved("s", [b"k"], None, 0.0)
    NO_TRAFFIC.released(1, True, 0.0)


def test_the_policy_bench_reads_what_it_records(tmp_path):
    rec = recorder()
    p = chain(b"p", 3)
    rec.match("s1", p, 1, now=0.0)
    rec.saved("s1", chain(b"d", 2, p)[3:], p[-1], now=0.1)
    rec.released(1, last_turn=True, now=0.2)
    rec.match("s3", p, 2, now=0.3)
    path = os.path.join(str(tmp_path), "traffic.jsonl")
    with open(path, "w") as fh:
        fh.write("\n".join(rec.drain()) + "\n")
    first, second = read_trace(path)
    assert (len(first.keys), first.prompt_blocks, first.last_turn) == (5, 3, True)
    assert (len(second.keys), second.prompt_blocks, second.last_turn) == (3, 3, False)
    # The namespace is folded into the keys: the same prompt in two namespaces
    # is two chains; within one, the keys keep their prefixes.
    assert first.keys[:3] != second.keys and len(set(first.keys)) == 5
