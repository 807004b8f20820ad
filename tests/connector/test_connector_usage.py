"""What the scheduler tells the daemon it used of its lookups: every lookup is a
Match with report_use, its leases are narrowed to the blocks beyond vLLM's
own prefix-cache hit, and their release carries the LookupReport whose loaded
blocks are the daemon's hits. Against the in-memory daemon of the scheduler
tests; no engine."""
from __future__ import annotations

from typing import Any, Dict, List

import pytest

from connector_harness import vllm_unavailable

if vllm_unavailable() is not None:
    pytest.skip(vllm_unavailable(), allow_module_level=True)

from test_connector_scheduler import (BS, TOKENS, Blocks, Req, done, flush, hold, make,  # noqa: E402
                                      output, store)

LONG = TOKENS + [5] * 10   # 138 tokens, 4 full blocks


def report(prompt_tokens: int, prompt_blocks: int, local: int, loaded: int) -> Dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "prompt_blocks": prompt_blocks,
            "local_blocks": local, "loaded_blocks": loaded}


def schedule(side: Any, r: Any, computed: int, blocks: List[int]) -> Any:
    """get_num_new_matched_tokens, allocation and the step's meta; the load."""
    hit, _ = side.get_num_new_matched_tokens(r, computed)
    side.update_state_after_alloc(r, Blocks(blocks), hit)
    r.num_computed_tokens = computed + hit
    meta = side.build_connector_meta(output(**{r.request_id: r.num_tokens - computed - hit}),
                                     lambda rid: blocks)
    return hit, (meta.loads[0] if meta.loads else None)


def test_a_hit_beyond_vllms_own_cache_pins_and_reports_only_the_loaded_blocks() -> None:
    side, (d,), _ = make()
    keys = store(d, 0, LONG, 4)
    r = Req("a", LONG)
    hit, load = schedule(side, r, 32, [40, 41, 42, 43, 44])   # vLLM holds block 0
    assert hit == 96 and load.block_ids == (41, 42, 43)
    flush(side)
    (lid,) = d.leases
    assert d.narrowed == [(lid, 1, 3)] and d.leases[lid] == keys[1:4]
    assert d.report_use == [True]
    side.update_connector_output(done(load.load_id, 3))
    flush(side)
    assert d.reports == [(lid, report(138, 4, 1, 3))]
    assert side.counters.totals()["hit_tokens"] == 3 * BS == 96


def test_a_corrupt_block_is_discarded_at_its_position_in_the_narrowed_lease() -> None:
    side, (d,), _ = make()
    keys = store(d, 0, LONG, 4)
    r = Req("a", LONG)
    _, load = schedule(side, r, 32, [40, 41, 42, 43, 44])
    # the load's second block (request block 2) failed its checksum
    side.update_connector_output(done(load.load_id, good=1, bad=[1]))
    flush(side)
    assert keys[2] not in d.keys and {keys[1], keys[3]} <= d.keys
    assert d.reports[-1][1] == report(138, 4, 1, 1)


def test_a_full_hit_reports_every_block_vllm_counts_one_token_fewer() -> None:
    """The last-token rule: a 128-token prompt fully held loads all 4 blocks;
    vLLM computes the last token itself and counts 127 hit tokens, the
    daemon counts the 4 loaded blocks (128 tokens)."""
    side, (d,), _ = make()
    store(d, 0, TOKENS, 4)
    r = Req("a", TOKENS)
    hit, load = schedule(side, r, 0, [10, 11, 12, 13])
    assert hit == 127 and len(load.block_ids) == 4
    side.update_connector_output(done(load.load_id, 4))
    flush(side)
    assert d.narrowed == []   # nothing to unpin
    assert d.reports[-1][1] == report(128, 4, 0, 4)
    assert side.counters.totals()["hit_tokens"] == 127


def test_a_miss_reports_without_a_lease_and_a_local_hit_loads_nothing() -> None:
    side, (d,), _ = make()
    assert side.get_num_new_matched_tokens(Req("a", LONG), 0) == (0, False)
    store(d, 0, LONG, 2)
    # vLLM holds blocks 0-1 itself, the daemon holds nothing more
    assert side.get_num_new_matched_tokens(Req("b", LONG), 64) == (0, False)
    flush(side)
    assert d.reports == [(0, report(138, 4, 0, 0)), (1, report(138, 4, 2, 0))]
    assert not d.leases


def test_a_hit_vllm_does_not_take_reports_nothing_loaded() -> None:
    side, (d,), _ = make()
    store(d, 0, LONG, 3)
    r = Req("a", LONG)
    assert side.get_num_new_matched_tokens(r, 0) == (96, False)
    side.update_state_after_alloc(r, Blocks([1, 2, 3, 4, 5]), 0)
    flush(side)
    assert d.reports == [(1, report(138, 4, 0, 0))] and not d.leases


def test_a_lookup_whose_answer_vllm_never_used_reports_nothing() -> None:
    side, (d,), (link,) = make()
    store(d, 0, LONG, 3)
    hold(link)
    r = Req("a", LONG)
    side.on_new_request(r)
    side.request_finished(r)
    link.land()
    flush(side)
    assert d.reports == [] and not d.leases


def test_tensor_parallel_narrows_each_rank_to_the_common_hit() -> None:
    side, (d0, d1), _ = make(tp=2)
    k0 = store(d0, 0, LONG, 3, tp=2)
    store(d1, 1, LONG, 2, tp=2)
    r = Req("a", LONG)
    assert side.get_num_new_matched_tokens(r, 0) == (64, False)
    flush(side)
    (l0,), (l1,) = d0.leases, d1.leases
    assert d0.narrowed == [(l0, 0, 2)] and d0.leases[l0] == k0[:2]
    assert d1.narrowed == []
    side.request_finished(r)
    flush(side)
    assert d0.reports == [(l0, report(138, 4, 0, 0))] and d1.reports == [(l1, report(138, 4, 0, 0))]
