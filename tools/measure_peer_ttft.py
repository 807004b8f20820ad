"""Full-hit time to first token from a same-host peer's KV cache, against a
host-tier hit and against recompute, side by side in one run.

    flock /work/wt/engine.lock python tools/measure_peer_ttft.py [--tokens 2048] [--reps 5]
        [--model m1|m2] [--json FILE]

One daemon and two engines with kvkeeper_peer (the ttft bench's dummy-weight
models, vLLM's CPU build). Each repetition times three fresh prompts on
engine B, each after engine A computed the first two:
  recompute  a prompt nobody holds;
  host       A's prompt, saved by A into the daemon's host tier: a full hit there;
  peer       A's prompt, its blocks then dropped from the host tier: only A's
             cache holds it, and B copies it from there.
Every hit must load the whole prompt but its last token and give A's greedy
token. Prints the medians, ranges and ratios, with the load average.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from typing import Any, Dict, List

from kvkeeper.connector.bench import driver
from kvkeeper.connector.bench.model import M1, M2


def prompt(rng: random.Random, n: int) -> List[int]:
    return [rng.randrange(3, 30000) for _ in range(n)]


def start_daemon(tmp: str) -> Any:
    sock = os.path.join(tmp, "kvk.sock")
    log = open(os.path.join(tmp, "daemon.log"), "w")
    proc = subprocess.Popen([sys.executable, "-m", "kvkeeper.server.cli", "serve", "--socket",
                             sock, "--tcp", "", "--metrics", "", "--capacity", "1GiB",
                             "--set", f"host_tier.name=kvkeeper-peerbench-{uuid.uuid4().hex[:8]}"],
                            stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 60
    while not os.path.exists(sock):
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError("the daemon did not start; see " + log.name)
        time.sleep(0.1)
    time.sleep(0.5)
    return proc, f"unix://{sock}", sock


def wait_for(cond: Any, what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out waiting for {what}")
        time.sleep(0.05)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--model", choices=("m1", "m2"), default="m1")
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    from kvkeeper.client import Client
    from kvkeeper.client.peer import PeerClient
    from kvkeeper.client.peer_wire import peer_socket_path
    from kvkeeper.connector.keys import chain_keys

    tmp = tempfile.mkdtemp(prefix="kvkpb-", dir="/tmp")
    model = os.path.join(tmp, "model")
    os.makedirs(model)
    with open(os.path.join(model, "config.json"), "w") as fh:
        json.dump(M1 if args.model == "m1" else M2, fh)
    daemon, url, sock = start_daemon(tmp)
    common = ["--model", model, "--connector", "kvkeeper", "--url", url, "--report",
              "--extra", json.dumps({"kvkeeper_peer": True}), "--max-model-len", "4096"]
    engines: Dict[str, Any] = {}
    try:
        engines = driver.start_engines({"a": common, "b": common}, sys.executable,
                                       driver.engine_env(), tmp, print, "peer ttft")
        a, b = engines["a"], engines["b"]
        rng = random.Random(7)
        bs = 32
        rows: Dict[str, List[float]] = {"recompute": [], "host": [], "peer": []}
        client = peers = None
        for rep in range(args.reps + 1):   # the first repetition warms up, untimed
            ph, pp, pr = (prompt(rng, args.tokens) for _ in range(3))
            ref: Dict[str, Any] = {}
            for name, p in (("host", ph), ("peer", pp)):
                r = a.results([p], max_tokens=1)[0]
                ref[name] = r
                info = r["params"]["kvkeeper"]
                if client is None:
                    client = Client.connect(url, info["namespace"], instance_id="bench")
                    peers = PeerClient(peer_socket_path(sock))
                keys = chain_keys(bytes.fromhex(info["seed"]), p, bs)
                wait_for(lambda: client.match(keys, report_use=True).matched == len(keys),
                         "A's saves")
                if name == "peer":
                    m = client.match(keys, lease=True, report_use=True)
                    client.release(m.lease_id, discard=True)
                    wait_for(lambda: peers.match(client.session_id, "bench", keys).matched
                             == len(keys), "A's published blocks")
            timed = {"recompute": pr, "host": ph, "peer": pp}
            for name in ("recompute", "host", "peer"):
                r = b.one(timed[name], settle=0.5)
                hit = r["params"]["kvkeeper"]["hit_tokens"]
                if name != "recompute":
                    if hit != args.tokens - 1 or r["tokens"] != ref[name]["tokens"]:
                        raise RuntimeError(f"{name} hit check failed: hit {hit}, tokens "
                                           f"{r['tokens']} vs {ref[name]['tokens']}")
                if rep:
                    rows[name].append(r["ttft"] * 1e3)
        out = {"model": args.model, "tokens": args.tokens, "reps": args.reps,
               "uptime": subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()}
        for name, xs in rows.items():
            out[name] = {"median_ms": statistics.median(xs), "min_ms": min(xs),
                         "max_ms": max(xs)}
        out["peer_over_host"] = out["peer"]["median_ms"] / out["host"]["median_ms"]
        out["peer_over_recompute"] = out["peer"]["median_ms"] / out["recompute"]["median_ms"]
        print(json.dumps(out, indent=1))
        if args.json:
            with open(args.json, "w") as fh:
                json.dump(out, fh, indent=1)
        if client is not None:
            client.close()
        return 0
    finally:
        for e in engines.values():
            e.close()
        daemon.terminate()
        daemon.wait(30)


if __name__ == "__main__":
    sys.exit(main())
