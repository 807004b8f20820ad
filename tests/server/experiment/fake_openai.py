"""A fake OpenAI-compatible streaming server with vLLM's metrics, for the experiment tests.

It models what the commands measure, so that their figures can be checked
against the fake's own bookkeeping: words are tokens (stable ids); full
blocks of a prompt go into a "vLLM prefix cache" (lost on restart) and into
an "external store" (the daemon: kept across restarts unless told
otherwise); a request's hits follow vLLM's rules (its own cache first, at
most prompt tokens - 1; then the store's leading blocks beyond it). Counters
are exported on /metrics (vLLM, reset by a restart) and /daemon/metrics (the
daemon, not reset). POST /_restart is the restart; knobs inject faults.
"""
from __future__ import annotations

import json
import shlex
import sys
import threading
import time
import zlib
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Dict, List, Set, Tuple

MODEL = "fake/model-7b"


def token_ids(prompt: str) -> List[int]:
    return [zlib.crc32(w.encode()) % 50000 for w in prompt.split()]


@dataclass
class FakeState:
    block_size: int = 16
    # knobs
    fail_every: int = 0                 # every n-th completion answers HTTP 500
    break_every: int = 0                # every n-th completion's stream stops before [DONE]
    omit: Set[str] = field(default_factory=set)      # vLLM metric names not exported
    unready_polls: int = 0              # /health and /v1/models answer 503 this often after a restart
    wipe_store_on_restart: bool = False
    outputs_change_on_restart: bool = False
    load_errors_after_restart: int = 0  # load errors counted per loading request after a restart
    tokenize: bool = True
    daemon_disk_tier: bool = True       # the daemon exports its disk checksum counter
    token_delay_s: float = 0.0005
    # state
    local: Set[Tuple[int, ...]] = field(default_factory=set)
    store: Set[Tuple[int, ...]] = field(default_factory=set)
    vllm: Dict[str, Dict[str, float]] = field(default_factory=dict)    # name -> {engine: v}
    daemon: Dict[str, Dict[str, float]] = field(default_factory=dict)  # name -> {tier: v}
    generation: int = 0
    started: float = 1_700_000_000.0
    completions: int = 0
    injected_failures: int = 0
    unready_left: int = 0
    served: Dict[str, Dict[str, int]] = field(default_factory=dict)   # prompt -> its last hits
    lock: threading.Lock = field(default_factory=threading.Lock)

    def inc(self, table: Dict[str, Dict[str, float]], name: str, label: str, v: float) -> None:
        table.setdefault(name, {}).setdefault(label, 0.0)
        table[name][label] += v

    def total(self, table: str, name: str) -> float:
        return sum(getattr(self, table).get(name, {}).values())

    def restart(self) -> None:
        with self.lock:
            self.generation += 1
            self.started += 100.0
            self.local.clear()
            self.vllm.clear()
            if self.wipe_store_on_restart:
                self.store.clear()
            self.unready_left = self.unready_polls

    def admit(self, prompt: str) -> Tuple[str, int, int]:
        """("ok" | "fail" | "break", prompt tokens, tokens to compute)."""
        ids = token_ids(prompt)
        n, bs = len(ids), self.block_size
        with self.lock:
            self.completions += 1
            k = self.completions
            if self.fail_every and k % self.fail_every == 0:
                self.injected_failures += 1
                return "fail", n, 0
            engine = str(k % 2)        # two label sets: the commands must sum them
            chains = [tuple(ids[:(j + 1) * bs]) for j in range(n // bs)]
            local = 0
            while local < (n - 1) // bs and chains[local] in self.local:
                local += 1
            ext = local
            while ext < len(chains) and chains[ext] in self.store:
                ext += 1
            ext_tokens = max(0, min(ext * bs, n - 1) - local * bs) if ext > local else 0
            self.inc(self.vllm, "vllm:prefix_cache_queries_total", engine, n)
            self.inc(self.vllm, "vllm:prefix_cache_hits_total", engine, local * bs)
            self.inc(self.vllm, "vllm:kvkeeper_hit_tokens_total", engine, ext_tokens)
            errors = self.load_errors_after_restart if self.generation and ext_tokens else 0
            self.inc(self.vllm, "vllm:kvkeeper_load_errors_total", engine, errors)
            self.inc(self.vllm, "vllm:kvkeeper_load_error_blocks_total", engine, errors)
            self.inc(self.vllm, "vllm:kvkeeper_checksum_errors_total", engine, 0)
            tier = "disk" if k % 3 == 0 else "host"
            self.inc(self.daemon, "kvkeeper_hit_blocks_total", tier, ext - local if ext_tokens else 0)
            self.inc(self.daemon, "kvkeeper_hit_tokens_total", tier, ext_tokens)
            self.local.update(chains)
            self.store.update(chains)
            self.served[prompt] = {"prompt_tokens": n, "local_tokens": local * bs,
                                   "ext_tokens": ext_tokens,
                                   "ext_blocks": ext - local if ext_tokens else 0}
            if self.break_every and k % self.break_every == 0:
                self.injected_failures += 1
                return "break", n, 0
            return "ok", n, n - local * bs - ext_tokens

    def words(self, prompt: str, count: int) -> List[str]:
        seed = zlib.crc32(prompt.encode()) + (self.generation if self.outputs_change_on_restart else 0)
        return [f" w{(seed * (i + 7)) % 997}" for i in range(count)]

    def vllm_text(self) -> str:
        lines = ["# HELP process_start_time_seconds Start time of the process.",
                 "# TYPE process_start_time_seconds gauge",
                 f"process_start_time_seconds {self.started}",
                 "# TYPE vllm:cache_config_info gauge",
                 f'vllm:cache_config_info{{block_size="{self.block_size}",cache_dtype="auto",'
                 f'enable_prefix_caching="True",engine="0"}} 1.0']
        for name in ("vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total",
                     "vllm:kvkeeper_hit_tokens_total", "vllm:kvkeeper_load_errors_total",
                     "vllm:kvkeeper_load_error_blocks_total", "vllm:kvkeeper_checksum_errors_total"):
            if name in self.omit:
                continue
            lines.append(f"# TYPE {name[:-len('_total')]} counter")
            for engine in ("0", "1"):
                v = self.vllm.get(name, {}).get(engine, 0.0)
                lines.append(f'{name}{{engine="{engine}",model_name="{MODEL}"}} {v}')
        return "\n".join(lines) + "\n"

    def daemon_text(self) -> str:
        lines = []
        for name in ("kvkeeper_hit_blocks_total", "kvkeeper_hit_tokens_total",
                     "kvkeeper_disk_checksum_failures_total"):
            lines.append(f"# TYPE {name[:-len('_total')]} counter")
            if name == "kvkeeper_disk_checksum_failures_total":
                if self.daemon_disk_tier:
                    lines.append(f"{name} 0.0")
                else:
                    lines.pop()
                continue
            for tier in ("host", "disk"):
                lines.append(f'{name}{{tier="{tier}"}} {self.daemon.get(name, {}).get(tier, 0.0)}')
        return "\n".join(lines) + "\n"


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    state: FakeState

    def log_message(self, *args: Any) -> None:
        pass

    def send(self, code: int, body: bytes, ctype: str = "application/json") -> None:
        self.send_response(code)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        # One request a connection, as the commands use them (no reset noise at exit).
        self.send_header("Connection", "close")
        self.close_connection = True
        self.end_headers()
        self.wfile.write(body)

    def ready(self) -> bool:
        with self.state.lock:
            if self.state.unready_left > 0:
                self.state.unready_left -= 1
                return False
        return True

    def do_GET(self) -> None:
        st = self.state
        if self.path == "/health":
            self.send(200 if self.ready() else 503, b"")
        elif self.path == "/v1/models":
            if not self.ready():
                self.send(503, b"{}")
                return
            self.send(200, json.dumps({"object": "list", "data": [
                {"id": MODEL, "object": "model", "root": "/models/fake", "max_model_len": 4096}]}).encode())
        elif self.path == "/version":
            self.send(200, b'{"version": "0.0-fake"}')
        elif self.path == "/metrics":
            self.send(200, st.vllm_text().encode(), "text/plain; version=0.0.4")
        elif self.path == "/daemon/metrics":
            self.send(200, st.daemon_text().encode(), "text/plain; version=0.0.4")
        else:
            self.send(404, b"{}")

    def do_POST(self) -> None:
        st = self.state
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"{}")
        if self.path == "/_restart":
            st.restart()
            self.send(200, b"{}")
        elif self.path == "/tokenize":
            if not st.tokenize:
                self.send(404, b'{"detail": "Not Found"}')
                return
            ids = token_ids(body["prompt"])
            self.send(200, json.dumps({"count": len(ids), "max_model_len": 4096,
                                       "tokens": ids}).encode())
        elif self.path == "/v1/completions":
            self.complete(body)
        else:
            self.send(404, b"{}")

    def chunk(self, data: bytes) -> None:
        self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
        self.wfile.flush()

    def complete(self, body: Dict[str, Any]) -> None:
        st = self.state
        if body.get("model") != MODEL or not body.get("stream"):
            self.send(400, b'{"error": {"message": "bad request"}}')
            return
        if st.unready_left > 0:   # still starting: a client that did not wait fails
            self.send(503, b'{"error": {"message": "starting"}}')
            return
        outcome, n_prompt, compute = st.admit(body["prompt"])
        if outcome == "fail":
            self.send(500, b'{"error": {"message": "injected failure"}}')
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked")
        self.send_header("Connection", "close")
        self.close_connection = True
        self.end_headers()
        time.sleep(st.token_delay_s * (1 + compute / 8))   # prefill: only uncached tokens
        words = st.words(body["prompt"], int(body["max_tokens"]))
        for i, w in enumerate(words):
            if outcome == "break" and i == len(words) // 2:
                self.chunk(b"")        # end the chunked body early: no [DONE]
                return
            last = i == len(words) - 1
            event = {"id": "cmpl-1", "object": "text_completion", "model": MODEL,
                     "choices": [{"index": 0, "text": w, "logprobs": None,
                                  "finish_reason": "length" if last else None}]}
            self.chunk(b"data: " + json.dumps(event).encode() + b"\n\n")
            time.sleep(st.token_delay_s)
        if (body.get("stream_options") or {}).get("include_usage"):
            usage = {"id": "cmpl-1", "object": "text_completion", "model": MODEL, "choices": [],
                     "usage": {"prompt_tokens": n_prompt, "completion_tokens": len(words),
                               "total_tokens": n_prompt + len(words)}}
            self.chunk(b"data: " + json.dumps(usage).encode() + b"\n\n")
        self.chunk(b"data: [DONE]\n\n")
        self.chunk(b"")


class FakeServer:
    """`with FakeServer(**knobs) as fake:` fake.url, fake.state, fake.restart_cmd."""

    def __init__(self, **knobs: Any):
        self.state = FakeState(**knobs)
        handler = type("BoundHandler", (Handler,), {"state": self.state})
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.daemon_metrics_url = self.url + "/daemon/metrics"
        code = ("import urllib.request as u; "
                f"u.urlopen(u.Request({self.url + '/_restart'!r}, data=b'', method='POST'))")
        self.restart_cmd = f"{shlex.quote(sys.executable)} -c {shlex.quote(code)}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def __enter__(self) -> "FakeServer":
        self.thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
