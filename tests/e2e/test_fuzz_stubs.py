"""A seeded fuzzer over the raw stubs of kvkeeper.v1.KVKeeper and KVKeeperAdmin.

Requests are bytes sent with identity serializers, over the unix socket and
TCP, as every kind of caller (the socket, two tenants, an admin, and callers
with no, a wrong or a malformed token). Between batches the fuzzer builds
real sessions with committed blocks, leases and open reservations, and the
requests name those ids (and other identities', closed and forged ones).
After each batch: health SERVING, Stats sane, the ledger's invariants hold,
nothing logged at ERROR, no INTERNAL or UNKNOWN counted. At the end every
session closes, everything pinned returns to zero, and the client still saves,
matches and loads.

Replay: KVKEEPER_FUZZ_SEED=<seed> KVKEEPER_FUZZ_COUNT=<n> KVKEEPER_FUZZ_CONCURRENCY=1
(requests are a function of (seed, index); with concurrency 1 so is the order).
KVKEEPER_FUZZ_START=<index> starts at a request index. The report (request
count, histogram of codes) goes to $KVKEEPER_FUZZ_REPORT, else the test's tmp dir.
"""
from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import time
from collections import Counter
from pathlib import Path
from typing import Any

import grpc
import pytest

from kvkeeper.client import AsyncClient
from kvkeeper.v1 import kvkeeper_pb2 as pb

from daemon_process import two_tenants_and_ops, write_tokens
from fuzz_cases import BLOCK, OWNER_IDENT, TOKEN_A, TOKEN_B, TOKEN_OPS
from fuzz_runner import ErrorLog, Fuzzer

SEED = os.environ.get("KVKEEPER_FUZZ_SEED", "kvkeeper-issue-9")
COUNT = int(os.environ.get("KVKEEPER_FUZZ_COUNT", "10000"))
START = int(os.environ.get("KVKEEPER_FUZZ_START", "0"))
CONCURRENCY = int(os.environ.get("KVKEEPER_FUZZ_CONCURRENCY", "16"))
BATCH = int(os.environ.get("KVKEEPER_FUZZ_BATCH", "500"))
# Exploration: run every batch, then list the kinds of bad answers found.
KEEP_GOING = os.environ.get("KVKEEPER_FUZZ_KEEP_GOING") == "1"
PAGES = 512
MAX_MESSAGE = 128 * 1024
MAX_KEYS = 256
# The disk-tier daemon gets a fifth of the requests: its paths (promotion on
# Match, write-back, Verify) on top of the same request mix.
DISK_SHARE = 5
REPORT: dict = {}

TOKENS = two_tenants_and_ops(TOKEN_A, TOKEN_B, TOKEN_OPS)


@pytest.fixture
def tokens_file(tmp_path: Path) -> str:
    return write_tokens(tmp_path, TOKENS)


def config(tokens_file: str, **extra: Any) -> dict:
    return {"auth.tokens_file": tokens_file, "host_tier.capacity_bytes": BLOCK + PAGES * BLOCK,
            "server.max_message_bytes": MAX_MESSAGE, "ledger.max_keys_per_call": MAX_KEYS,
            "ledger.reservation_timeout_seconds": 5.0, **extra}


async def test_fuzz_both_services(daemon_factory: Any, tokens_file: str, tmp_path: Path) -> None:
    d = await daemon_factory(**config(tokens_file))
    await fuzz(d, "host tier", COUNT, tmp_path)


async def test_fuzz_with_a_disk_tier(daemon_factory: Any, tokens_file: str, tmp_path: Path) -> None:
    d = await daemon_factory(**config(tokens_file, **{
        "disk_tier.path": str(tmp_path / "disk"), "disk_tier.capacity_bytes": 32 << 20,
        "disk_tier.write_policy": "write-back",
        # Sessions that miss a heartbeat expire while requests are in flight.
        "ledger.lease_ttl_seconds": 3.0}))
    await fuzz(d, "host and disk tiers", max(1, COUNT // DISK_SHARE), tmp_path)


async def fuzz(d: Any, variant: str, count: int, tmp_path: Path) -> None:
    errors = ErrorLog()
    # grpc's own logger too: it reports exceptions that escape a handler.
    for name in ("kvkeeper", "grpc"):
        logging.getLogger(name).addHandler(errors)
    t0 = time.perf_counter()
    try:
        async with grpc.aio.insecure_channel(f"unix:{d.socket_path}") as unix, \
                grpc.aio.insecure_channel(f"127.0.0.1:{d.port}") as tcp:
            fz = Fuzzer(d, unix, tcp, errors, seed=SEED, max_keys=MAX_KEYS, max_message=MAX_MESSAGE)
            sem = asyncio.Semaphore(CONCURRENCY)

            async def bounded(i: int) -> None:
                async with sem:
                    await fz.one(i)

            for batch, first in enumerate(range(START, START + count, BATCH)):
                await fz.refresh(batch)
                await asyncio.gather(*(bounded(i) for i in range(first, min(first + BATCH, START + count))))
                if KEEP_GOING:
                    continue
                assert not fz.problems, (
                    f"fuzz [{variant}] seed {SEED!r}: {len(fz.problems)} bad answers in requests "
                    f"{first}..{first + BATCH - 1}; replay with KVKEEPER_FUZZ_SEED={SEED!r} "
                    f"KVKEEPER_FUZZ_COUNT={first + BATCH - START} KVKEEPER_FUZZ_START={START} "
                    "KVKEEPER_FUZZ_CONCURRENCY=1\n" + "\n".join(fz.problems[:15]))
                await fz.check_daemon(errors)
            if KEEP_GOING:
                print_problems(fz.problems, errors)
            else:
                await final_checks(fz, d)
    finally:
        for name in ("kvkeeper", "grpc"):
            logging.getLogger(name).removeHandler(errors)
    REPORT[variant] = {"seed": SEED, "start": START, "requests": fz.sent,
                       "codes": dict(fz.codes.most_common()),
                       "by_method": {m: dict(c) for m, c in sorted(fz.by_method.items())},
                       "kinds": dict(fz.kinds.most_common()),
                       "wall_seconds": round(time.perf_counter() - t0, 1)}
    total: Counter = Counter()
    for r in REPORT.values():
        total.update(r["codes"])
    path = Path(os.environ.get("KVKEEPER_FUZZ_REPORT") or tmp_path / "fuzz_report.json")
    path.write_text(json.dumps({"requests": sum(r["requests"] for r in REPORT.values()),
                                "codes": dict(total.most_common()), "runs": REPORT}, indent=1))
    print(f"\nfuzz [{variant}]: {fz.sent} requests, seed {SEED!r}, {REPORT[variant]['wall_seconds']}s; "
          f"codes {REPORT[variant]['codes']}\nfuzz report: {path}")
    assert fz.sent == count


def print_problems(problems: list, errors: ErrorLog) -> None:
    """KVKEEPER_FUZZ_KEEP_GOING: each kind of bad answer once, with its count."""
    kinds: Counter = Counter()
    example: dict = {}
    for p in problems:
        k = re.sub(r"[0-9a-f]{6,}|\d+", "N", p.split("\n")[0])[:150]
        kinds[k] += 1
        example.setdefault(k, p)
    print("\n".join(f"{n:6d}  {example[k]}" for k, n in kinds.most_common()))
    print("\n".join(r.getMessage()[:200] for r in errors.records[:20]))


async def final_checks(fz: Fuzzer, d: Any) -> None:
    """Every session closes, nothing stays pinned, the client still works end to end."""
    await fz.close_all()
    await d.stack.drain()   # write-back flushes pin their blocks until done
    L = d.ledger
    # The daemon's own pins (flushing, promotion) belong to no session.
    mine = list(L.sessions.values())
    assert not mine and not L.leases and not L.reservations, (
        f"{len(mine)} sessions, {len(L.leases)} leases, {len(L.reservations)} reservations left")
    stats = await fz.ok(OWNER_IDENT["socket"], "Stats", pb.StatsRequest())
    assert (stats.sessions, stats.leases, stats.reservations) == (len(L.sessions), 0, 0)
    assert all(t.pinned_bytes == 0 and t.pending_blocks == 0 for t in stats.tiers), stats
    L.check_invariants()
    ns = dict(model_id="model-a", dtype="float16", block_tokens=16, block_bytes=BLOCK)
    for n, (url, token) in enumerate(((f"unix://{d.socket_path}", None),
                                      (f"127.0.0.1:{d.port}", TOKEN_A))):
        keys = [bytes([0xA0 + i, n]) * 16 for i in range(3)]
        blocks = [bytes([i + 1 + n]) * BLOCK for i in range(3)]
        async with await AsyncClient.connect(url, ns, token=token, max_retries=0) as c:
            assert (await c.save(keys, blocks)).committed == 3
            m = await c.match(keys, lease=True)
            assert m.matched == 3
            assert await c.load(m.lease_id) == blocks
            await c.release(m.lease_id)
    await d.stack.drain()
    assert list(L.sessions.values()) == []
    assert not L.leases and not L.reservations
