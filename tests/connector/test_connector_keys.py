"""Chained block keys: deterministic, chained, seeded by the namespace, full blocks only."""
from __future__ import annotations

import hashlib
import json
import os
import struct
import subprocess
import sys

import pytest

from kvkeeper.connector.keys import (KEY_BYTES, KeyChain, RequestSeeds, block_tokens_bytes,
                                     chain_keys, full_blocks, hit_tokens, matchable_blocks,
                                     namespace_seed)

NS = {"model_id": "meta-llama/Llama-3-8B", "model_revision": "main", "dtype": "bfloat16",
      "kv_layout": "kvk1:LBNHC:FullAttentionSpec:L32xH8xN16xC256B", "block_tokens": 16,
      "block_bytes": 32 * 8 * 16 * 256, "tp_rank": 0, "tp_size": 1}
TOKENS = list(range(1000, 1000 + 100))

_CHILD = """
import json, sys
from kvkeeper.connector.keys import chain_keys, namespace_seed
ns, tokens = json.loads(sys.stdin.read())
seed = namespace_seed(ns, cache_salt="s", lora="adapter")
print(json.dumps([k.hex() for k in chain_keys(seed, tokens, ns["block_tokens"])]))
"""


def test_keys_are_the_chained_sha256_of_the_block_tokens() -> None:
    seed = namespace_seed(NS)
    keys = chain_keys(seed, TOKENS, 16)
    prev = seed
    for i, k in enumerate(keys):
        want = hashlib.sha256(prev + struct.pack("<16q", *TOKENS[i * 16:(i + 1) * 16])).digest()
        assert k == want
        assert len(k) == KEY_BYTES
        prev = k


def test_identical_in_processes_with_different_hash_seeds() -> None:
    here = [k.hex() for k in chain_keys(namespace_seed(NS, cache_salt="s", lora="adapter"),
                                        TOKENS, 16)]
    outs = []
    for hashseed in ("0", "1", "12345"):
        env = dict(os.environ, PYTHONHASHSEED=hashseed)
        r = subprocess.run([sys.executable, "-c", _CHILD], input=json.dumps([NS, TOKENS]),
                           capture_output=True, text=True, env=env, check=True, timeout=120)
        outs.append(json.loads(r.stdout))
    assert all(o == here for o in outs)


def test_a_key_depends_on_every_earlier_token() -> None:
    seed = namespace_seed(NS)
    base = chain_keys(seed, TOKENS, 16)
    changed = list(TOKENS)
    changed[3] += 1  # inside block 0
    other = chain_keys(seed, changed, 16)
    assert all(a != b for a, b in zip(base, other)), "every later key must change"
    changed = list(TOKENS)
    changed[40] += 1  # inside block 2
    other = chain_keys(seed, changed, 16)
    assert other[:2] == base[:2] and all(a != b for a, b in zip(base[2:], other[2:]))


def test_shared_prefix_shares_exactly_the_full_blocks_it_covers() -> None:
    seed = namespace_seed(NS)
    a = chain_keys(seed, TOKENS[:50] + [1] * 50, 16)
    b = chain_keys(seed, TOKENS[:50] + [2] * 50, 16)
    assert a[:3] == b[:3]       # tokens 0..47 are shared
    assert a[3] != b[3]         # block 3 holds tokens 48..63: differ from 50 on


@pytest.mark.parametrize("field,value", [
    ("model_id", "other/model"), ("model_revision", "v2"), ("dtype", "float16"),
    ("kv_layout", "kvk1:LBHNC:FullAttentionSpec:L32xH8xN16xC256B"), ("block_bytes", 1),
    ("tp_rank", 1), ("tp_size", 2),
])
def test_every_namespace_field_seeds_the_chain(field: str, value: object) -> None:
    other = dict(NS, **{field: value})
    assert namespace_seed(other) != namespace_seed(NS)
    assert chain_keys(namespace_seed(other), TOKENS, 16)[0] != chain_keys(namespace_seed(NS),
                                                                          TOKENS, 16)[0]


def test_request_salt_lora_and_media_seed_the_chain() -> None:
    seeds = {namespace_seed(NS), namespace_seed(NS, cache_salt="tenant-a"),
             namespace_seed(NS, cache_salt="tenant-b"), namespace_seed(NS, lora="sql-adapter"),
             namespace_seed(NS, extra=["img:abc@5+10"]), namespace_seed(NS, extra=["img:abd@5+10"])}
    assert len(seeds) == 6
    # Fields are length-prefixed: moving bytes between fields changes the seed.
    assert namespace_seed(NS, cache_salt="ab", lora="c") != namespace_seed(NS, cache_salt="a",
                                                                          lora="bc")
    # tp_size 0 means 1, as in the proto.
    assert namespace_seed(dict(NS, tp_size=0)) == namespace_seed(dict(NS, tp_size=1))


def test_only_full_blocks_get_keys() -> None:
    seed = namespace_seed(NS)
    assert len(chain_keys(seed, TOKENS[:15], 16)) == 0
    assert len(chain_keys(seed, TOKENS[:16], 16)) == 1
    assert len(chain_keys(seed, TOKENS[:47], 16)) == 2
    assert full_blocks(47, 16) == 2 and full_blocks(48, 16) == 3 and full_blocks(0, 16) == 0
    with pytest.raises(ValueError):
        KeyChain(seed, 16).keys(TOKENS[:47], 3)


def test_every_full_block_is_matchable_but_the_last_token_is_never_a_hit() -> None:
    # vLLM must compute at least the last token: a 48-token prompt matches and
    # loads its 3 full blocks but reports 47 tokens, so vLLM computes 1, not 16.
    assert matchable_blocks(48, 16) == 3 and hit_tokens(48, 3, 16) == 47
    assert matchable_blocks(49, 16) == 3 and hit_tokens(49, 3, 16) == 48
    assert matchable_blocks(17, 16) == 1 and hit_tokens(17, 1, 16) == 16
    assert matchable_blocks(16, 16) == 1 and hit_tokens(16, 1, 16) == 15
    assert matchable_blocks(15, 16) == 0 and hit_tokens(15, 0, 16) == 0
    assert hit_tokens(1, 0, 16) == 0 and hit_tokens(0, 0, 16) == 0
    assert hit_tokens(2048, 64, 32) == 2047 and hit_tokens(2048, 63, 32) == 2016
    for n in range(200):
        for m in range(matchable_blocks(n, 16) + 1):
            h = hit_tokens(n, m, 16)
            assert 0 <= h <= max(0, n - 1) and h <= m * 16
            # the blocks a hit touches are all matched ones
            assert -(-h // 16) <= m


def test_keychain_extends_incrementally_and_agrees_with_one_shot() -> None:
    seed = namespace_seed(NS)
    chain = KeyChain(seed, 16)
    growing: list = []
    for n in range(0, 101, 7):  # tokens arrive a few at a time (decode)
        growing = TOKENS[:n]
        chain.keys(growing, full_blocks(n, 16))
    assert chain.keys(TOKENS, 6) == chain_keys(seed, TOKENS, 16)
    assert len(chain) == 6


def test_tokens_are_little_endian_int64() -> None:
    assert block_tokens_bytes([1, 2**40, -1]) == (b"\x01" + b"\x00" * 7
                                                   + (2**40).to_bytes(8, "little")
                                                   + b"\xff" * 8)


def test_request_seeds_are_each_namespaces_seed_remembered_within_a_bound() -> None:
    ranks = [dict(NS), {**NS, "tp_rank": 1, "tp_size": 2}]
    seeds = RequestSeeds(ranks, limit=2)
    for salt, lora, extra in ((None, None, ()), ("tenant-a", None, ()), (None, "adapter", ()),
                              ("tenant-a", "adapter", ("img:1",)), (None, None, ())):
        got = seeds(salt, lora, extra)
        assert got == tuple(namespace_seed(ns, cache_salt=salt, lora=lora, extra=extra)
                            for ns in ranks)
        assert seeds(salt, lora, list(extra)) is got   # remembered
    assert len(set(seeds("x") + seeds("y"))) == 4
    ranks[0]["model_id"] = "changed after"   # the seeds keep the namespaces they were given
    assert seeds.namespaces[0]["model_id"] == NS["model_id"]


def test_keys_of_many_blocks_at_once_equal_those_of_one_block_at_a_time() -> None:
    seed = namespace_seed(NS)
    tokens = list(range(-5, 2048 - 5))
    one = KeyChain(seed, 32)
    for n in range(1, 65):
        one.keys(tokens, n)
    assert KeyChain(seed, 32).keys(tokens, 64) == one.keys(tokens, 64) == chain_keys(seed, tokens, 32)
