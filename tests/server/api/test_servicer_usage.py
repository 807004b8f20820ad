"""Match(report_use) and Release(report, keep) on the wire: hits, lookups and
shm load bytes count only for the blocks the client reports loaded, and a
narrowed lease pins only what it keeps. Raw stubs."""
from __future__ import annotations

from typing import Any

import grpc

from test_servicer_errors import BLOCK, expect, key, snapshot
from test_servicer_match_blocks import load_shm_bytes, saved

from kvkeeper.v1 import kvkeeper_pb2 as pb

BT = 32   # block_tokens of the wire tests' namespace


def sample(daemon: Any, name: str, **labels: str) -> float:
    v = daemon.metrics.registry.get_sample_value(name, labels)
    return 0.0 if v is None else v


def hit_tokens(daemon: Any) -> float:
    return sample(daemon, "kvkeeper_hit_tokens_total", tier="host")


async def test_report_use_counts_the_loaded_blocks_at_release(daemon: Any, stub: Any) -> None:
    sid, ks = await saved(stub, 5)
    # 6 full blocks (200 tokens); the client holds blocks 0-1 itself.
    m = await stub.Match(pb.MatchRequest(session_id=sid, keys=ks + [key(99)], lease=True,
                                         blocks=True, report_use=True))
    assert m.matched == 5 and len(m.blocks) == 5
    assert hit_tokens(daemon) == 0 and load_shm_bytes(daemon) == 0
    assert sample(daemon, "kvkeeper_lookup_keys_total") == 6
    # Pin only the blocks it will load.
    await stub.Release(pb.ReleaseRequest(session_id=sid, lease_id=m.lease_id, keep_start=2,
                                         keep_blocks=3))
    assert [len(lease.blocks) for lease in daemon.ledger.leases.values()] == [3]
    daemon.ledger.check_invariants()
    await stub.Release(pb.ReleaseRequest(
        session_id=sid, lease_id=m.lease_id,
        report=pb.LookupReport(prompt_tokens=200, prompt_blocks=6, local_blocks=2,
                               loaded_blocks=3)))
    assert hit_tokens(daemon) == 3 * BT
    assert sample(daemon, "kvkeeper_hit_blocks_total", tier="host") == 3
    assert load_shm_bytes(daemon) == 3 * BLOCK
    assert sample(daemon, "kvkeeper_lookup_blocks_total") == 4
    assert sample(daemon, "kvkeeper_lookup_tokens_total") == 4 * BT
    assert sample(daemon, "kvkeeper_prompt_blocks_total") == 6
    assert sample(daemon, "kvkeeper_prompt_tokens_total") == 200
    assert not daemon.ledger.leases
    st = await stub.Stats(pb.StatsRequest())
    assert (st.hit_tokens, st.lookup_tokens, st.prompt_tokens) == (3 * BT, 4 * BT, 200)


async def test_a_streamed_lease_reports_no_shm_bytes(daemon: Any, stub: Any) -> None:
    sid, ks = await saved(stub, 2)
    m = await stub.Match(pb.MatchRequest(session_id=sid, keys=ks, lease=True, report_use=True))
    await stub.Release(pb.ReleaseRequest(
        session_id=sid, lease_id=m.lease_id,
        report=pb.LookupReport(prompt_tokens=70, prompt_blocks=2, local_blocks=0,
                               loaded_blocks=2)))
    assert hit_tokens(daemon) == 2 * BT and load_shm_bytes(daemon) == 0


async def test_a_miss_reports_with_lease_id_0(daemon: Any, stub: Any) -> None:
    sid, _ = await saved(stub, 1)
    m = await stub.Match(pb.MatchRequest(session_id=sid, keys=[key(50), key(51)], lease=True,
                                         report_use=True))
    assert m.matched == 0 and m.lease_id == 0
    await stub.Release(pb.ReleaseRequest(
        session_id=sid, report=pb.LookupReport(prompt_tokens=64, prompt_blocks=2,
                                               local_blocks=0)))
    assert sample(daemon, "kvkeeper_lookup_blocks_total") == 2
    assert sample(daemon, "kvkeeper_prompt_tokens_total") == 64
    assert hit_tokens(daemon) == 0


async def test_bad_keeps_and_reports_get_invalid_argument_and_change_nothing(
        daemon: Any, stub: Any) -> None:
    sid, ks = await saved(stub, 3)
    m = await stub.Match(pb.MatchRequest(session_id=sid, keys=ks, lease=True, report_use=True))
    before = snapshot(daemon)
    usage = dict(vars(daemon.ledger.usage))
    report = pb.LookupReport(prompt_tokens=96, prompt_blocks=3, local_blocks=0, loaded_blocks=3)
    bad = pb.LookupReport(prompt_tokens=96, prompt_blocks=3, local_blocks=1, loaded_blocks=3)
    rel = pb.ReleaseRequest
    cases = [
        (rel(session_id=sid, lease_id=m.lease_id, keep_start=2, keep_blocks=2),
         "not a non-empty range"),
        (rel(session_id=sid, lease_id=m.lease_id, keep_blocks=1, discard=True), "narrows a lease"),
        (rel(session_id=sid, lease_id=m.lease_id, keep_blocks=1, report=report),
         "narrows a lease"),
        (rel(session_id=sid, lease_id=m.lease_id, report=bad), "more than the prompt's"),
    ]
    for req, fragment in cases:
        await expect(grpc.StatusCode.INVALID_ARGUMENT, stub.Release(req), fragment)
        assert snapshot(daemon) == before and vars(daemon.ledger.usage) == usage
    await stub.Release(rel(session_id=sid, lease_id=m.lease_id, report=report))
    assert hit_tokens(daemon) == 3 * BT
