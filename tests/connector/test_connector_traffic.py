"""A daemon recording its traffic ([ledger] traffic_file) while a vLLM engine
with KVKeeperConnector serves conversations: each turn is one line, its lookup
and the answer's blocks, and the next turn's line extends it whole (the call
pattern of the real connector: its save parents, chunks and last-turn
releases), which the policy bench replays."""
from __future__ import annotations

import json
import random
import shutil
from typing import List

import pytest

from connector_harness import DaemonProcess, EngineProcess, short_tmpdir, vllm_unavailable

pytestmark = pytest.mark.skipif(vllm_unavailable() is not None,
                                reason=vllm_unavailable() or "")

BS = 32


def prompt(name: str, n: int) -> List[int]:
    rng = random.Random(name)
    return [rng.randrange(3, 500) for _ in range(n)]


def test_conversations_served_by_vllm_are_recorded_turn_by_turn_and_replay() -> None:
    from tiny_llama import write_tiny_llama

    from kvkeeper.server.bench import policy_bench
    from kvkeeper.server.bench.policy_trace import read_trace

    tmp = short_tmpdir()
    write_tiny_llama(f"{tmp}/model")
    path = f"{tmp}/traffic.jsonl"
    daemon = DaemonProcess(f"{tmp}/kvk.sock", capacity="128MiB", page="32KiB",
                           extra_args=["--set", f"ledger.traffic_file={path}"]).start()
    engine = None
    sent = []
    try:
        engine = EngineProcess(f"{tmp}/model", daemon.url, f"{tmp}/engine.log", ready_timeout=900)
        system = prompt("system", 64)
        turns = {c: system + prompt(f"user{c}", 40) for c in range(2)}
        for turn in range(3):
            for c in range(2):
                last = turn == 2
                r = engine.generate([turns[c]], 48, kv_transfer_params=(
                    {"kvkeeper_last_turn": True} if last else None))
                sent.append((len(turns[c]), len(turns[c]) + len(r["outputs"][0]), last))
                turns[c] = turns[c] + r["outputs"][0] + prompt(f"user{c}.{turn}", 40)
    finally:
        if engine is not None:
            engine.close()
        daemon.stop()          # SIGTERM: the daemon writes the requests still open
        daemon.cleanup()
    try:
        with open(path) as fh:
            lines = [json.loads(x) for x in fh]
        reqs = read_trace(path)
        got = {r.name: r for r in policy_bench.run(trace=path, policies=["s3fifo"])}
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    assert len(lines) == len(sent) and len({d["ns"] for d in lines}) == 1
    for d, (prompt_tokens, all_tokens, last) in zip(lines, sent):
        assert d["prompt_blocks"] == prompt_tokens // BS
        # A last turn saves nothing; any other saves its answer's full blocks.
        assert len(d["keys"]) == (prompt_tokens if last else all_tokens) // BS
        assert d.get("last_turn", False) == last
    for i in range(2, len(lines)):      # conversation c's turns are lines c, c + 2, c + 4
        before = lines[i - 2]["keys"]
        assert lines[i]["keys"][:len(before)] == before
    assert [r.last_turn for r in reqs] == [s[2] for s in sent]
    share = got["policy.hit_ratio.trace.33pct.s3fifo"]
    assert 0 < share.value == share.baseline_value    # all of it fits: every reread hits
