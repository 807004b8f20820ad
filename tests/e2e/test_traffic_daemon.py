"""A daemon with [ledger] traffic_file records what its clients do, and the
policy bench replays the file: the operator's own traffic through every policy."""
from __future__ import annotations

import asyncio
import os
from typing import Any

from kvkeeper.client import AsyncClient
from kvkeeper.server.bench import policy_bench
from kvkeeper.server.bench.policy_trace import read_trace

BLOCK = 4096


def ns() -> dict:
    return dict(model_id="tiny", dtype="float16", kv_layout="NHD", block_tokens=32,
                block_bytes=BLOCK)


def keys(n: int, salt: int) -> list[bytes]:
    return [(salt * 1000 + i).to_bytes(4, "little") * 8 for i in range(n)]


async def test_a_conversation_recorded_by_the_daemon_replays_in_the_policy_bench(
        daemon_factory: Any, tmp_path: Any) -> None:
    path = os.path.join(str(tmp_path), "traffic.jsonl")
    d = await daemon_factory(**{"ledger.traffic_file": path})
    prompt, answer, message = keys(4, 1), keys(2, 2), keys(1, 3)
    c = await AsyncClient.connect(f"unix://{d.socket_path}", ns())
    try:
        m = await c.match(prompt, lease=True)
        assert m.matched == 0 and not m.lease_id      # a miss holds no lease
        await c.save(prompt + answer, [bytes(BLOCK)] * 6)   # the missed prompt, the answer
        turn = prompt + answer + message
        m = await c.match(turn, lease=True)
        assert m.matched == 6
        await c.release(m.lease_id, last_turn=True)
    finally:
        await c.close()
    await d.stop(0)                 # writes the requests still open
    first, second = read_trace(path)
    assert (len(first.keys), first.prompt_blocks, first.last_turn) == (6, 4, False)
    assert (len(second.keys), second.prompt_blocks, second.last_turn) == (7, 7, True)
    assert second.keys[:6] == first.keys          # the next turn extends the first whole
    results = policy_bench.run(trace=path, policies=["lru", "s3fifo"])
    hit = {r.name: r for r in results}
    # Room for everything at every point: the second turn hits its 6-block history.
    assert hit["policy.hit_ratio.trace.33pct.s3fifo"].value == 6 / 11
    assert hit["policy.hit_ratio.trace.33pct.s3fifo"].baseline_value == 6 / 11


async def test_a_reload_turns_recording_on_and_off_while_the_cache_stays(
        daemon_factory: Any, tmp_path: Any) -> None:
    from dataclasses import replace

    path = os.path.join(str(tmp_path), "traffic.jsonl")
    d = await daemon_factory()
    off = d.config
    c = await AsyncClient.connect(f"unix://{d.socket_path}", ns())
    try:
        await c.save(keys(3, 1), [bytes(BLOCK)] * 3)      # cached before recording starts
        d.reload(replace(off, ledger=replace(off.ledger, traffic_file=path)))
        assert d.config.ledger.traffic_file == path
        m = await c.match(keys(3, 1) + keys(1, 2), lease=True)
        assert m.matched == 3                              # no restart: the cache is there
        await c.release(m.lease_id, last_turn=True)
        d.reload(off)                                      # off: what is open is written
    finally:
        await c.close()
    deadline = asyncio.get_running_loop().time() + 10
    while not os.path.exists(path) or not open(path).read().endswith("\n"):
        assert asyncio.get_running_loop().time() < deadline
        await asyncio.sleep(0.01)
    [r] = read_trace(path)
    assert (len(r.keys), r.prompt_blocks, r.last_turn) == (4, 4, True)
