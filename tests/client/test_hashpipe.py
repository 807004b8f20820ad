"""Checksums computed in a helper thread (kvkeeper.client.hashpipe)."""
from __future__ import annotations

import multiprocessing as mp
import os

import pytest

from kvkeeper.client.checksum import crc32, xxh3_64
from kvkeeper.client.hashpipe import HashPipe, usable
from kvkeeper.v1 import kvkeeper_pb2 as pb


def _blocks():
    return [os.urandom(n) for n in (0, 1, 4096, 300_001, 1 << 20)]


@pytest.mark.parametrize("algo,fn", [(pb.CHECKSUM_XXH3_64, xxh3_64), (pb.CHECKSUM_CRC32, crc32)])
def test_pieces_fed_in_order_give_the_one_shot_checksum(algo, fn):
    blocks = _blocks()
    hp = HashPipe()
    for i, b in enumerate(blocks):
        hp.begin(10 + i, algo)
        mv = memoryview(b)
        for pos in range(0, len(b), 65_537):
            hp.feed(mv[pos:pos + 65_537])
    assert hp.finish() == {10 + i: fn(b) for i, b in enumerate(blocks)}


def test_blocks_of_both_algorithms_in_one_pipe():
    a, b = os.urandom(5000), os.urandom(7000)
    hp = HashPipe()
    hp.begin(0, pb.CHECKSUM_CRC32)
    hp.feed(memoryview(a))
    hp.begin(1, pb.CHECKSUM_XXH3_64)
    hp.feed(memoryview(b))
    assert hp.finish() == {0: crc32(a), 1: xxh3_64(b)}


def test_an_empty_pipe_finishes_with_nothing():
    assert HashPipe().finish() == {}


def test_a_helper_error_reaches_finish():
    hp = HashPipe()
    hp.feed(memoryview(b"no block begun"))
    with pytest.raises(AttributeError):
        hp.finish()
    with pytest.raises(KeyError):   # an algorithm nothing can compute
        bad = HashPipe()
        bad.begin(0, pb.CHECKSUM_NONE)
        bad.finish()


def _child(q):
    hp = HashPipe()
    hp.begin(0, pb.CHECKSUM_XXH3_64)
    hp.feed(memoryview(b"after fork"))
    q.put(hp.finish()[0])


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_child_gets_its_own_helpers():
    HashPipe().finish()   # the parent's pool exists, with its threads
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    p = ctx.Process(target=_child, args=(q,))
    p.start()
    p.join(60)
    assert p.exitcode == 0, "the child hung or failed on an inherited pool"
    assert q.get(timeout=5) == xxh3_64(b"after fork")


def test_usable_needs_two_cpus(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {3}, raising=False)
    assert usable() is False
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 5}, raising=False)
    assert usable() is True
