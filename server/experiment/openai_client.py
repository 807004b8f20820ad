"""A small client of an OpenAI-compatible server (vLLM's `vllm serve`), stdlib only.

Requests go to /v1/completions with stream=true; each one is timed from the
moment it is sent: TTFT to the first chunk carrying text, end-to-end latency
to the end of the stream, TPOT = (e2e - TTFT) / (output tokens - 1). Output
tokens are the server's usage count (stream_options.include_usage), else the
number of text chunks (vLLM sends one token a chunk). A request fails when the
connection fails, the status is not 200, the stream carries an error or ends
without `data: [DONE]`; it is recorded, never raised.
"""
from __future__ import annotations

import http.client
import json
import time
import urllib.parse
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import asdict, dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence

from .workload import Row

READY_PATHS = ("/health", "/v1/models")


class BackendError(RuntimeError):
    """The server did not answer a control request (models, tokenize) as expected."""


@dataclass
class RequestRecord:
    id: str
    ok: bool
    error: Optional[str] = None
    status: Optional[int] = None
    ttft_s: Optional[float] = None
    tpot_s: Optional[float] = None
    e2e_s: Optional[float] = None
    output_tokens: int = 0
    prompt_tokens: Optional[int] = None
    finish_reason: Optional[str] = None
    sent_at_s: float = 0.0          # since the start of the run
    text: str = ""

    def to_json(self) -> Dict[str, Any]:
        return asdict(self)


class Backend:
    """One OpenAI-compatible server at base_url (e.g. http://127.0.0.1:8000)."""

    def __init__(self, base_url: str, api_key: Optional[str] = None, timeout: float = 600.0):
        if "://" not in base_url:
            base_url = "http://" + base_url
        u = urllib.parse.urlsplit(base_url)
        if u.scheme not in ("http", "https") or not u.hostname:
            raise ValueError(f"--backend-url {base_url!r}: expected http://HOST:PORT")
        self.base_url = base_url.rstrip("/")
        self._https = u.scheme == "https"
        self._host = u.hostname
        self._port = u.port
        self._prefix = u.path.rstrip("/")
        self.api_key = api_key
        self.timeout = timeout

    # ---- plumbing
    def _conn(self, timeout: float) -> http.client.HTTPConnection:
        cls = http.client.HTTPSConnection if self._https else http.client.HTTPConnection
        return cls(self._host, self._port, timeout=timeout)

    def _headers(self) -> Dict[str, str]:
        h = {"Content-Type": "application/json", "Accept": "application/json"}
        if self.api_key:
            h["Authorization"] = f"Bearer {self.api_key}"
        return h

    def request_json(self, method: str, path: str, body: Optional[dict] = None,
                     timeout: float = 30.0) -> Any:
        """The decoded JSON answer; BackendError on a connection error or non-200."""
        conn = self._conn(timeout)
        try:
            conn.request(method, self._prefix + path,
                         json.dumps(body).encode() if body is not None else None, self._headers())
            resp = conn.getresponse()
            data = resp.read()
        except (OSError, http.client.HTTPException) as e:
            raise BackendError(f"{method} {self.base_url}{path}: {type(e).__name__}: {e}") from None
        finally:
            conn.close()
        if resp.status != 200:
            raise BackendError(f"{method} {self.base_url}{path}: HTTP {resp.status}: "
                               f"{data[:200].decode(errors='replace')}")
        try:
            return json.loads(data)
        except ValueError:
            raise BackendError(f"{method} {self.base_url}{path}: answer is not JSON") from None

    # ---- control
    def ready(self, timeout: float = 5.0) -> bool:
        """True when /health or /v1/models answers 200."""
        for path in READY_PATHS:
            conn = self._conn(timeout)
            try:
                conn.request("GET", self._prefix + path, headers=self._headers())
                resp = conn.getresponse()
                resp.read()
                if resp.status == 200:
                    return True
            except (OSError, http.client.HTTPException):
                pass
            finally:
                conn.close()
        return False

    def wait_ready(self, timeout: float, poll: float = 0.5) -> float:
        """Seconds until ready(); BackendError after timeout seconds."""
        t0 = time.monotonic()
        while True:
            if self.ready():
                return time.monotonic() - t0
            if time.monotonic() - t0 >= timeout:
                raise BackendError(f"{self.base_url} did not answer {' or '.join(READY_PATHS)} "
                                   f"within {timeout:g}s")
            time.sleep(poll)

    def models(self) -> List[Dict[str, Any]]:
        data = self.request_json("GET", "/v1/models")
        models = data.get("data") if isinstance(data, dict) else None
        if not isinstance(models, list):
            raise BackendError(f"GET {self.base_url}/v1/models: no \"data\" list")
        return [m for m in models if isinstance(m, dict)]

    def connect(self, model: Optional[str]) -> tuple[str, List[Dict[str, Any]]]:
        """(the model to request: `model`, else the first one served; /v1/models's list).
        BackendError when the server does not answer or serves no model."""
        if not self.ready():
            raise BackendError(f"{self.base_url} does not answer {' or '.join(READY_PATHS)}; "
                               "is the server running?")
        served = self.models()
        model = model or (served[0].get("id") if served else None)
        if not model:
            raise BackendError(f"{self.base_url}/v1/models lists no model; pass --model")
        return str(model), served

    def version(self) -> Optional[str]:
        """The server's /version (vLLM), or None."""
        try:
            v = self.request_json("GET", "/version", timeout=5.0)
        except BackendError:
            return None
        return str(v.get("version")) if isinstance(v, dict) and "version" in v else None

    def tokenize(self, model: str, prompt: str) -> Optional[List[int]]:
        """The prompt's token ids by vLLM's /tokenize, or None where the server has none."""
        try:
            v = self.request_json("POST", "/tokenize", {"model": model, "prompt": prompt})
        except BackendError:
            return None
        tokens = v.get("tokens") if isinstance(v, dict) else None
        return tokens if isinstance(tokens, list) else None

    # ---- completions
    def complete(self, row: Row, model: str, extra: Optional[Dict[str, Any]] = None,
                 t_run: Optional[float] = None) -> RequestRecord:
        body: Dict[str, Any] = {"model": model, "prompt": row.prompt, "max_tokens": row.max_tokens,
                                "stream": True, "stream_options": {"include_usage": True}}
        body.update(extra or {})
        rec = RequestRecord(id=row.id, ok=False)
        t0 = time.perf_counter()
        rec.sent_at_s = t0 - t_run if t_run is not None else 0.0
        conn = self._conn(self.timeout)
        chunks = 0
        texts: List[str] = []
        done = False
        try:
            conn.request("POST", self._prefix + "/v1/completions", json.dumps(body).encode(),
                         self._headers())
            resp = conn.getresponse()
            rec.status = resp.status
            if resp.status != 200:
                rec.error = f"HTTP {resp.status}: {resp.read()[:200].decode(errors='replace')}"
                return rec
            while True:
                line = resp.readline()
                if not line:
                    break
                line = line.strip()
                if not line.startswith(b"data:"):
                    continue
                payload = line[5:].strip()
                if payload == b"[DONE]":
                    done = True
                    break
                event = json.loads(payload)
                if "error" in event:
                    rec.error = f"stream error: {json.dumps(event['error'])[:200]}"
                    return rec
                for choice in event.get("choices") or ():
                    text = choice.get("text") or ""
                    if text:
                        if rec.ttft_s is None:
                            rec.ttft_s = time.perf_counter() - t0
                        texts.append(text)
                        chunks += 1
                    if choice.get("finish_reason"):
                        rec.finish_reason = choice["finish_reason"]
                usage = event.get("usage")
                if isinstance(usage, dict):
                    rec.output_tokens = int(usage.get("completion_tokens") or 0)
                    if usage.get("prompt_tokens") is not None:
                        rec.prompt_tokens = int(usage["prompt_tokens"])
        except (OSError, http.client.HTTPException, ValueError) as e:
            rec.error = f"{type(e).__name__}: {e}"
            return rec
        finally:
            conn.close()
            rec.e2e_s = time.perf_counter() - t0
            rec.text = "".join(texts)
        if not done:
            rec.error = "stream ended without data: [DONE]"
            return rec
        rec.output_tokens = rec.output_tokens or chunks
        if rec.ttft_s is not None and rec.output_tokens > 1:
            rec.tpot_s = (rec.e2e_s - rec.ttft_s) / (rec.output_tokens - 1)
        rec.ok = True
        return rec

    def run(self, rows: Sequence[Row], model: str, concurrency: int,
            extra: Optional[Dict[str, Any]] = None,
            on_done: Callable[[RequestRecord], None] = lambda r: None
            ) -> tuple[List[RequestRecord], float]:
        """Send rows with at most `concurrency` in flight, in file order; returns
        (records in file order, wall seconds from the first send to the last end)."""
        records: List[Optional[RequestRecord]] = [None] * len(rows)
        t_run = time.perf_counter()
        with ThreadPoolExecutor(max_workers=max(1, concurrency)) as pool:
            futures = {pool.submit(self.complete, row, model, extra, t_run): i
                       for i, row in enumerate(rows)}
            for fut in as_completed(futures):
                rec = fut.result()
                records[futures[fut]] = rec
                on_done(rec)
        return [r for r in records if r is not None], time.perf_counter() - t_run
