"""Keys and blocks for the match tests against an in-process daemon
(test_sync_match.py, test_async_match_lane.py): a small namespace, keys and
blocks that differ by salt and seed."""
from __future__ import annotations

import numpy as np

BLOCK = 2 * 4096
NS = dict(model_id="tiny", dtype="float16", kv_layout="NHD", block_tokens=32, block_bytes=BLOCK)


def keys(n: int, salt: int = 0) -> list[bytes]:
    return [(salt * 1000 + i).to_bytes(4, "little") * 8 for i in range(n)]


def blocks(n: int, seed: int = 0) -> list[bytes]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, BLOCK, dtype=np.uint8).tobytes() for _ in range(n)]
