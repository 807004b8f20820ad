"""Timed subclasses of the connectors `kvkeeper bench ttft` compares (engine side only).

Imported by vLLM inside an engine process (kv_connector_module_path
"kvkeeper.connector.bench.ttft_connector"), never by the daemon or by the bench
driver: it imports vLLM and torch at the top.

Each class behaves exactly like its parent and only appends one JSON line per
event to the file named by $KVKEEPER_BENCH_TIMINGS (nothing when unset):

  {"event": "new_request", "dur": s, "start_at": t}
                                                scheduler: on_new_request (kvkeeper
                                                submits its lookup there)
  {"event": "lookup", "dur": s, "tokens": n, "start_at": t}
                                                scheduler: get_num_new_matched_tokens
  {"event": "meta", "dur": s}                  scheduler: build_connector_meta of a
                                                step that loads
  {"event": "bind"}                            worker: the metadata of a step that
                                                loads is bound (the step begins)
  {"event": "worker_out"}                      worker: that step's last connector hook
                                                (build_connector_worker_meta)
  {"event": "output", "dur": s}                scheduler: update_connector_output of a
                                                step whose workers reported loads
  {"event": "load", "dur": s, "blocks": n, ...}
                                                worker, a step that loads: dur is the
                                                time the step waited for the
                                                connector's loads (kvkeeper:
                                                start_load_kv, plus the waits in
                                                wait_for_layer_load and for the
                                                checksum checks after the forward);
                                                kvkeeper adds its phases: fetch
                                                (Match + arena refs), copy (arena ->
                                                KV cache), check (checksums of the
                                                copied blocks), layer_wait,
                                                check_wait (copy and check may run
                                                beside the forward, on a spare core)
  {"event": "step", "forward": s, "save": s}   worker, wait_for_save: forward is
                                                the time from bind_connector_metadata
                                                (just before the forward pass) to
                                                wait_for_save (just after it), less
                                                the loads and saves in between; save
                                                is the connector's save work of the
                                                step (kvkeeper: queueing the new
                                                blocks for its save thread)
  {"event": "save_sent", "dur": s}             kvkeeper's background save thread:
                                                one batch sent (Reserve, copy, CRC32,
                                                Commit); off the step's critical path

Every line has "at", time.monotonic() when it was written (one clock for
every process: the runner's "sent" is on it too), so the lines of one
request make a timeline across the engine's processes. The writes happen
inside the step (a few microseconds each); the runner (engine.py) reads the
lines a request produced after it finished.
"""
from __future__ import annotations

import json
import os
import time
from typing import Any, Dict, Optional

from vllm.distributed.kv_transfer.kv_connector.v1.example_connector import ExampleConnector

from kvkeeper.connector.connector import KVKeeperConnector

TIMINGS_ENV = "KVKEEPER_BENCH_TIMINGS"

__all__ = ["TIMINGS_ENV", "TimedKVKeeperConnector", "TimedExampleConnector"]


class _Recorder:
    def __init__(self) -> None:
        self.path = os.environ.get(TIMINGS_ENV) or ""

    def write(self, rec: Dict[str, Any]) -> None:
        if not self.path:
            return
        rec["pid"] = os.getpid()
        rec.setdefault("at", time.monotonic())   # one clock for every process (Linux)
        line = json.dumps(rec) + "\n"
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, line.encode())
        finally:
            os.close(fd)


class _TimedLookup:
    """The scheduler's lookup, timed the same way for both connectors."""

    _rec: _Recorder

    def on_new_request(self, request: Any) -> None:
        t = time.perf_counter()
        start_at = time.monotonic()
        super().on_new_request(request)  # type: ignore[misc]
        self._rec.write({"event": "new_request", "dur": time.perf_counter() - t,
                         "start_at": start_at})

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> Any:
        t = time.perf_counter()
        start_at = time.monotonic()
        out = super().get_num_new_matched_tokens(request, num_computed_tokens)  # type: ignore[misc]
        self._rec.write({"event": "lookup", "dur": time.perf_counter() - t,
                         "start_at": start_at, "tokens": (out or (0,))[0] or 0,
                         "pending": bool(out) and out[0] is None})
        return out

    def build_connector_meta(self, scheduler_output: Any) -> Any:
        t = time.perf_counter()
        meta = super().build_connector_meta(scheduler_output)  # type: ignore[misc]
        if getattr(meta, "loads", None) or getattr(meta, "requests", None):
            self._rec.write({"event": "meta", "dur": time.perf_counter() - t})
        return meta


class TimedKVKeeperConnector(_TimedLookup, KVKeeperConnector):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._rec = _Recorder()
        self._bound: Optional[float] = None
        self._load_s = 0.0        # start_load_kv
        self._layer_wait_s = 0.0  # wait_for_layer_load (inside the forward)
        self._loads = 0           # blocks this step loads
        self._load_at = 0.0       # monotonic time start_load_kv began
        self._loading = False     # this step loads (until build_connector_worker_meta)
        super().__init__(*args, **kwargs)

    def register_kv_caches(self, kv_caches: Any) -> None:
        super().register_kv_caches(kv_caches)
        w = self.worker_side
        if w is None or getattr(w, "link", None) is None:
            return
        orig_call, rec = w.link.call, self._rec

        def call(fn: Any, what: str, *a: Any, **k: Any) -> Any:
            if what != "save":
                return orig_call(fn, what, *a, **k)
            t = time.perf_counter()   # the background save thread
            try:
                return orig_call(fn, what, *a, **k)
            finally:
                rec.write({"event": "save_sent", "dur": time.perf_counter() - t})

        w.link.call = call

    def bind_connector_metadata(self, connector_metadata: Any) -> None:
        super().bind_connector_metadata(connector_metadata)
        self._bound = time.perf_counter()
        self._load_s = self._layer_wait_s = 0.0
        loads = getattr(connector_metadata, "loads", None) or ()
        self._loads = sum(s.num_blocks() for s in loads)
        self._loading = bool(self._loads)
        if self._loads:
            self._rec.write({"event": "bind"})

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        t = time.perf_counter()
        self._load_at = time.monotonic()
        try:
            super().start_load_kv(forward_context, **kwargs)
        finally:
            self._load_s += time.perf_counter() - t

    def wait_for_layer_load(self, layer_name: str) -> None:
        t = time.perf_counter()
        try:
            super().wait_for_layer_load(layer_name)
        finally:
            self._layer_wait_s += time.perf_counter() - t

    def wait_for_save(self) -> None:
        t = time.perf_counter()
        try:
            super().wait_for_save()
        finally:
            end = time.perf_counter()
            if self._bound is not None:
                self._rec.write({"event": "step",
                                 "forward": t - self._bound - self._load_s - self._layer_wait_s,
                                 "save": end - t})
                self._bound = None

    def build_connector_worker_meta(self) -> Any:
        out = super().build_connector_worker_meta()
        if self._loading:   # the worker's last hook of a step that loaded
            self._rec.write({"event": "worker_out"})
            self._loading = False
        return out

    def update_connector_output(self, connector_output: Any) -> None:
        t = time.perf_counter()
        super().update_connector_output(connector_output)
        if getattr(connector_output, "kv_connector_worker_meta", None) is not None:
            self._rec.write({"event": "output", "dur": time.perf_counter() - t})

    def get_block_ids_with_load_errors(self) -> Any:
        t = time.perf_counter()
        try:
            return super().get_block_ids_with_load_errors()
        finally:
            check_wait = time.perf_counter() - t
            if self._loads:
                w = self.worker_side   # its load_timings: the step's phases, settled now
                phases = w.load_timings.as_dict() if w is not None else {}
                phases.pop("check_wait", None)
                phases.pop("layer_wait", None)
                self._rec.write({"event": "load", "blocks": self._loads, "start_at": self._load_at,
                                 "dur": self._load_s + self._layer_wait_s + check_wait,
                                 "layer_wait": self._layer_wait_s, "check_wait": check_wait,
                                 **phases})
                self._loads = 0


class TimedExampleConnector(_TimedLookup, ExampleConnector):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._rec = _Recorder()
        self._bound: Optional[float] = None
        self._load_s = 0.0
        self._save_s = 0.0
        super().__init__(*args, **kwargs)

    def bind_connector_metadata(self, connector_metadata: Any) -> None:
        super().bind_connector_metadata(connector_metadata)
        self._bound = time.perf_counter()
        self._load_s = self._save_s = 0.0

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        meta = self._get_connector_metadata() if self.has_connector_metadata() else None
        loads = [r for r in getattr(meta, "requests", ()) if not r.is_store]
        t = time.perf_counter()
        try:
            super().start_load_kv(forward_context, **kwargs)
        finally:
            end = time.perf_counter()
            self._load_s += end - t
            if loads:
                self._rec.write({"event": "load", "dur": end - t,
                                 "tokens": sum(len(r.slot_mapping) for r in loads)})

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any,
                      **kwargs: Any) -> None:
        t = time.perf_counter()
        try:
            super().save_kv_layer(layer_name, kv_layer, attn_metadata, **kwargs)
        finally:
            self._save_s += time.perf_counter() - t

    def wait_for_save(self) -> None:
        t = time.perf_counter()
        try:
            super().wait_for_save()
        finally:
            if self._bound is not None:
                # save_kv_layer runs inside the forward (after each attention
                # layer, writing a safetensors file): count it as save.
                self._rec.write({"event": "step",
                                 "forward": t - self._bound - self._load_s - self._save_s,
                                 "save": self._save_s + time.perf_counter() - t})
                self._bound = None
