"""A full hit over `kvkeeper_transport: stream` against shared memory, on `vllm serve`.

    python tests/serving/stream_vs_shm.py [--models ttft-1layer,gqa-6layer] [--reps 7]
        [--warmups 2] [--prompt-tokens 2000] [--json OUT] [--no-timings] [--keep]

Issue 10, deliverable 4: a full hit over streams on `vllm serve` is <= 1.5x
the shared-memory hit on the same prompt. A measurement, run by hand (under
`flock /work/wt/engine.lock` on a shared machine), not a test: timing asserts
do not belong in the suite. `kvkeeper bench stream-hit` measures the same
with vLLM's LLM engine API; this one goes through the OpenAI-compatible
server (HTTP, the front-end process, detokenizing), as users run it.

One kvkeeper daemon (unix socket, TCP 127.0.0.1, /metrics) for the run; per
model (the stream-hit bench's MODELS, dummy weights, the 512-token BPE
tokenizer of tiny_llama.py) three `vllm serve` servers on it:

  saver          computes each fresh prompt and saves it (unix socket, shm)
  loader-shm     loads it: kvkeeper_transport shm, over the unix socket
  loader-stream  loads it: kvkeeper_transport stream, over TCP

The loaders run without vLLM's own prefix cache, so a hit can only come from
the daemon. After a first round repeated until both loaders hit (a
connector connects on first use), each repetition sends a fresh text prompt
of about --prompt-tokens tokens to the saver (max_tokens 1), waits until the
daemon committed all its full blocks (kvkeeper_saved_blocks_total), then
sends it to each loader (alternating which goes first), one request at a
time, each after the stream-hit bench's pause between engines. TTFT is
taken by the experiment commands' streaming client. Every hit is verified
from the loader's /metrics or the run fails (exit 1): the saver's
vllm:kvkeeper_hit_tokens_total must not move, a loader's must rise by every
full block less the last-token rule, its loaded blocks by every full block,
and no load, load-error-block, checksum or lookup error may be counted.

With timings (the default) the loaders run the benchmarks' timed subclass
of the connector (connector/bench/ttft_connector.py: the same connector,
writing one JSON line per load), and the report carries the median
breakdown of a request: load (the step's wait for the connector), its
phases (load.stream: the LoadStream with its copies and checks,
load.stream_first: the wait for the first chunk, ...), forward, other.
After each model the servers get SIGTERM and the report says how long the
daemon still showed sessions (issue 10, deliverable 5: none, at once).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import sys
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "connector"))

from connector_harness import DaemonProcess, short_tmpdir, vllm_unavailable  # noqa: E402
from serving_harness import Server, free_port, serve_argv, serve_env  # noqa: E402
from tiny_llama import TINY_LLAMA, write_tokenizer  # noqa: E402

from kvkeeper.connector.bench.model import kv_bytes_per_token  # noqa: E402
from kvkeeper.connector.bench.phases import breakdown  # noqa: E402
from kvkeeper.connector.bench.rig import SWITCH_SETTLE_S  # noqa: E402
from kvkeeper.connector.bench.stream_hit_bench import MODELS  # noqa: E402
from kvkeeper.connector.keys import full_blocks, hit_tokens  # noqa: E402
from kvkeeper.server.bench.result import median  # noqa: E402
from kvkeeper.server.experiment.metrics_text import fetch  # noqa: E402
from kvkeeper.server.experiment.openai_client import Backend, RequestRecord  # noqa: E402
from kvkeeper.server.experiment.workload import Row  # noqa: E402

BLOCK = 32
MAX_MODEL_LEN = 2048
READY_ROUNDS = 5
COUNTER_WAIT_S = 10.0     # vLLM's /metrics follows a finished request within a step or two
SAVE_WAIT_S = 60.0
SESSIONS_WAIT_S = 40.0    # beyond the daemon's 30 s session TTL: "gone" then means expired
# connector/bench/ttft_connector.py's TIMINGS_ENV and class (that module imports vLLM).
TIMINGS_ENV = "KVKEEPER_BENCH_TIMINGS"
TIMED_CONNECTOR = ("TimedKVKeeperConnector", "kvkeeper.connector.bench.ttft_connector")
LOADERS = ("loader-shm", "loader-stream")
# Greedy; the one token may be special or a partial UTF-8 byte: show it anyway, so
# the first chunk carries text and the client's TTFT is taken.
SAMPLING = {"temperature": 0, "ignore_eos": True, "skip_special_tokens": False}
ERRORS = ("load_errors", "load_error_blocks", "checksum_errors", "lookup_errors")


class Unverified(RuntimeError):
    """A hit that the metrics do not confirm: the run's figures mean nothing."""


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def samples(url: str) -> Dict[str, float]:
    snap = fetch(url)
    if not snap.ok:
        raise Unverified(f"{url}: {snap.error}")
    return snap.samples


def write_model(path: str, name: str) -> None:
    """MODELS[name] with tiny_llama's tokenizer (its vocabulary: the KV bytes do not
    depend on it) and no weights: the servers load dummy ones."""
    os.makedirs(path)
    cfg = {**MODELS[name], "vocab_size": TINY_LLAMA["vocab_size"]}
    write_tokenizer(path, cfg["vocab_size"])
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)


class Loader:
    """One server of a model run, its client, its timing lines."""

    def __init__(self, name: str, server: Server, model: str, timings: str) -> None:
        self.name, self.server, self.model, self.timings = name, server, model, timings
        self.backend = Backend(server.url, timeout=300)

    def counters(self) -> Dict[str, float]:
        return samples(self.server.url + "/metrics")

    def complete(self, prompt: str) -> RequestRecord:
        rec = self.backend.complete(Row(id=self.name, prompt=prompt, max_tokens=1,
                                        prefix_id=self.name), self.model, SAMPLING)
        if not rec.ok:
            raise Unverified(f"{self.name}: request failed: {rec.error}")
        return rec

    def timing_lines(self, offset: int) -> Tuple[List[Dict[str, Any]], int]:
        try:
            with open(self.timings, "rb") as f:
                f.seek(offset)
                data = f.read()
        except FileNotFoundError:
            return [], offset
        return [json.loads(x) for x in data.splitlines() if x.strip()], offset + len(data)


def delta(after: Dict[str, float], before: Dict[str, float], name: str) -> float:
    key = f"vllm:kvkeeper_{name}_total"
    return after.get(key, 0.0) - before.get(key, 0.0)


class ModelRun:
    def __init__(self, name: str, args: argparse.Namespace, daemon: DaemonProcess, tcp: str,
                 daemon_metrics: str, tmp: str) -> None:
        self.name, self.args, self.daemon, self.tcp = name, args, daemon, tcp
        self.daemon_metrics, self.tmp = daemon_metrics, tmp
        self.servers: Dict[str, Loader] = {}
        self.rng = random.Random(f"{name}-{uuid.uuid4().hex}")
        self.offsets: Dict[str, int] = {}

    def start(self) -> None:
        model = os.path.join(self.tmp, "model")
        write_model(model, self.name)
        specs = {"saver": (self.daemon.url, "shm"), "loader-shm": (self.daemon.url, "shm"),
                 "loader-stream": (self.tcp, "stream")}
        for role, (url, transport) in specs.items():
            port = free_port()
            timings = os.path.join(self.tmp, f"timings-{role}.jsonl")
            env = serve_env()
            kw: Dict[str, Any] = {}
            if role in LOADERS and self.args.timings:
                env[TIMINGS_ENV] = timings
                kw["connector"] = TIMED_CONNECTOR
            argv = serve_argv(model, port, url, max_model_len=MAX_MODEL_LEN,
                              kvkeeper_transport=transport, **kw)
            argv += ["--served-model-name", self.name, "--load-format", "dummy"]
            if role in LOADERS:
                argv.append("--no-enable-prefix-caching")   # after serve_argv's --enable-...
            server = Server.create(os.path.join(self.tmp, role), argv, env,
                                   f"http://127.0.0.1:{port}", cwd=self.tmp)
            self.servers[role] = Loader(role, server, self.name, timings)
        t0 = time.monotonic()
        with ThreadPoolExecutor(len(self.servers)) as pool:
            for f in [pool.submit(s.server.start) for s in self.servers.values()]:
                f.result()
        log(f"{self.name}: 3 servers healthy in {time.monotonic() - t0:.0f} s")

    def stop(self) -> Optional[float]:
        """SIGTERM every server; seconds from their exit until the daemon shows no
        session or lease (None: still some after SESSIONS_WAIT_S)."""
        with ThreadPoolExecutor(len(self.servers) or 1) as pool:
            for f in [pool.submit(s.server.stop) for s in self.servers.values()]:
                f.result()
        t0 = time.monotonic()
        while time.monotonic() - t0 < SESSIONS_WAIT_S:
            m = samples(self.daemon_metrics)
            if not m.get("kvkeeper_sessions") and not m.get("kvkeeper_leases"):
                return time.monotonic() - t0
            time.sleep(0.05)
        return None

    def prompt(self, target: int) -> Tuple[str, int]:
        """A fresh text of at most `target` tokens, as close to it as whole words allow."""
        saver = self.servers["saver"].backend
        letters = "abcdefghijklmnopqrstuvwxyz"
        words = [f"rep{uuid.uuid4().hex[:8]}"] + [
            "".join(self.rng.choice(letters) for _ in range(self.rng.randint(2, 7)))
            for _ in range(target)]

        def tokens(k: int) -> int:
            ids = saver.tokenize(self.name, " ".join(words[:k]))
            if ids is None:
                raise Unverified("the saver's /tokenize did not answer")
            return len(ids)

        lo, hi = 1, len(words)   # the most words within target: tokens() grows with k
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if tokens(mid) <= target else (lo, mid - 1)
        return " ".join(words[:lo]), tokens(lo)

    def wait_saved(self, before: float, blocks: int) -> None:
        deadline = time.monotonic() + SAVE_WAIT_S
        while samples(self.daemon_metrics).get("kvkeeper_saved_blocks_total", 0) - before < blocks:
            if time.monotonic() > deadline:
                raise Unverified(f"the daemon did not commit the prompt's {blocks} blocks within "
                                 f"{SAVE_WAIT_S:.0f} s")
            time.sleep(0.02)

    def request(self, role: str, prompt: str, hit: int, blocks: int) -> Dict[str, Any]:
        """One timed request, its hit verified from the server's counters."""
        s = self.servers[role]
        before = s.counters()
        _, self.offsets[role] = s.timing_lines(self.offsets.get(role, 0))
        time.sleep(SWITCH_SETTLE_S)   # the last server's engine stops busy-polling
        rec = s.complete(prompt)
        deadline = time.monotonic() + COUNTER_WAIT_S
        while True:
            after = s.counters()
            if delta(after, before, "hit_tokens") >= hit and \
                    delta(after, before, "loaded_blocks") >= blocks or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        got = {k: delta(after, before, k) for k in ("hit_tokens", "loaded_blocks", *ERRORS)}
        want = {"hit_tokens": hit, "loaded_blocks": blocks, **{k: 0 for k in ERRORS}}
        if got != want:
            raise Unverified(f"{role}: counters {got}, expected {want}")
        lines, self.offsets[role] = s.timing_lines(self.offsets[role])
        return {"ttft": rec.ttft_s, "prompt_tokens": rec.prompt_tokens, "timings": lines}

    def saved_prompt(self) -> Tuple[str, int]:
        """A fresh prompt (its tokens) that the saver computed and the daemon holds,
        whose greedy token decodes to text (a lone byte of a multi-byte character
        decodes to none: then the client sees no first token, and another prompt
        is taken; the loaders compute the same token from the same KV)."""
        for _ in range(READY_ROUNDS):
            text, n = self.prompt(self.args.prompt_tokens)
            saved_before = samples(self.daemon_metrics).get("kvkeeper_saved_blocks_total", 0)
            r = self.request("saver", text, 0, 0)   # fresh: must miss
            self.wait_saved(saved_before, full_blocks(n, BLOCK))
            if r["ttft"] is not None:
                return text, n
        raise Unverified(f"{READY_ROUNDS} prompts in a row gave no text")

    def round(self, rep: int) -> Dict[str, Dict[str, Any]]:
        text, n = self.saved_prompt()
        blocks = full_blocks(n, BLOCK)
        order = LOADERS if rep % 2 == 0 else LOADERS[::-1]
        out = {role: self.request(role, text, hit_tokens(n, blocks, BLOCK), blocks)
               for role in order}
        for role, r in out.items():
            if r["ttft"] is None:
                raise Unverified(f"{role}: no text, where the saver's token had some")
            if r["prompt_tokens"] != n:
                raise Unverified(f"{role} counted {r['prompt_tokens']} prompt tokens, the saver "
                                 f"{n}")
        return out

    def run(self) -> Dict[str, Any]:
        for attempt in range(READY_ROUNDS):
            try:
                self.round(0)
                break
            except Unverified as e:
                if attempt == READY_ROUNDS - 1:
                    raise
                log(f"{self.name}: not ready yet ({e}); again")
                time.sleep(2.0)
        for i in range(self.args.warmups):
            self.round(i)
        rounds = []
        for i in range(self.args.reps):
            r = self.round(i)
            rounds.append(r)
            log(f"{self.name}: repetition {i + 1}/{self.args.reps}: shm "
                f"{r['loader-shm']['ttft'] * 1e3:.1f} ms, stream "
                f"{r['loader-stream']['ttft'] * 1e3:.1f} ms")
        shm = [r["loader-shm"]["ttft"] for r in rounds]
        stream = [r["loader-stream"]["ttft"] for r in rounds]
        n = rounds[0]["loader-shm"]["prompt_tokens"]
        c = MODELS[self.name]
        return {
            "model": self.name,
            "shape": (f"{c['num_hidden_layers']} layer(s), hidden {c['hidden_size']}, "
                      f"{c['num_attention_heads']} heads / {c['num_key_value_heads']} KV heads, "
                      f"{c['torch_dtype']}, dummy weights"),
            "prompt_tokens": n, "hit_verified": True, "reps": self.args.reps,
            # A shared machine: its load, beside the figures (1, 5, 15 minutes).
            "load_average": [round(x, 2) for x in os.getloadavg()],
            "warmups": self.args.warmups,
            "loaded_bytes": full_blocks(n, BLOCK) * BLOCK * kv_bytes_per_token(c),
            "shm_median_s": median(shm), "stream_median_s": median(stream),
            "ratio": median(stream) / median(shm), "target": "<= 1.5",
            "shm_samples_s": [round(x, 5) for x in shm],
            "stream_samples_s": [round(x, 5) for x in stream],
            "shm_breakdown_s": breakdown(rounds, "loader-shm") if self.args.timings else None,
            "stream_breakdown_s": breakdown(rounds, "loader-stream") if self.args.timings
            else None,
        }


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python tests/serving/stream_vs_shm.py",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default=",".join(MODELS),
                   help=f"comma-separated, of {', '.join(MODELS)}")
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--warmups", type=int, default=2)
    p.add_argument("--prompt-tokens", type=int, default=2000)
    p.add_argument("--json", metavar="OUT", help="write the results here")
    p.add_argument("--timings", action=argparse.BooleanOptionalAction, default=True,
                   help="loaders run the timed connector subclass (load breakdown)")
    p.add_argument("--keep", action="store_true", help="keep the logs' directory")
    args = p.parse_args(argv)
    models = [m for m in args.models.split(",") if m]
    unknown = [m for m in models if m not in MODELS]
    if unknown or args.reps < 1 or not BLOCK < args.prompt_tokens < MAX_MODEL_LEN:
        p.error(f"unknown model(s) {unknown}" if unknown else
                f"--reps >= 1 and {BLOCK} < --prompt-tokens < {MAX_MODEL_LEN}")
    why = vllm_unavailable()
    if why:
        print(why, file=sys.stderr)
        return 2
    tmp = short_tmpdir()
    metrics = f"127.0.0.1:{free_port()}"
    tcp = f"127.0.0.1:{free_port()}"
    daemon = DaemonProcess(f"{tmp}/kvkeeper.sock", capacity="2GiB", page="64KiB",
                           log_path=f"{tmp}/daemon.log", metrics=metrics, tcp=tcp)
    results: List[Dict[str, Any]] = []
    rc = 1
    try:
        daemon.start()
        for name in models:
            run = ModelRun(name, args, daemon, tcp, f"http://{metrics}/metrics",
                           os.path.join(tmp, name))
            os.makedirs(run.tmp)
            try:
                run.start()
                res = run.run()
            finally:
                gone = run.stop()
            res["sessions_gone_after_sigterm_s"] = None if gone is None else round(gone, 3)
            results.append(res)
            log(f"{name}: shm {res['shm_median_s'] * 1e3:.1f} ms, stream "
                f"{res['stream_median_s'] * 1e3:.1f} ms, ratio {res['ratio']:.2f}; sessions "
                f"gone {gone if gone is None else round(gone, 2)} s after SIGTERM")
        rc = 0
    except Unverified as e:
        log(f"FAILED, a hit is not verified: {e}")
    finally:
        daemon.cleanup()
        if args.keep or rc:
            log(f"logs kept in {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    print(f"{'model':<12} {'tokens':>6} {'reps':>4} {'shm ms':>8} {'stream ms':>9} {'ratio':>6}"
          f" {'sessions gone s':>15}")
    for r in results:
        print(f"{r['model']:<12} {r['prompt_tokens']:>6} {r['reps']:>4} "
              f"{r['shm_median_s'] * 1e3:>8.1f} {r['stream_median_s'] * 1e3:>9.1f} "
              f"{r['ratio']:>6.2f} {r['sessions_gone_after_sigterm_s']!s:>15}")
        for k in ("shm_breakdown_s", "stream_breakdown_s"):
            if r[k]:
                print(f"  {k}: " + ", ".join(f"{p} {v * 1e3:.1f}" for p, v in r[k].items()))
    if args.json:
        Path(args.json).write_text(json.dumps({"ok": rc == 0, "results": results}, indent=1))
    return rc


if __name__ == "__main__":
    sys.exit(main())
