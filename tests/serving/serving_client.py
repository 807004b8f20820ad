"""What the serving tests send to and read from servers: streaming completions and /metrics."""
from __future__ import annotations

import json
import time
import urllib.request
from dataclasses import dataclass
from typing import Dict

from prometheus_client.parser import text_string_to_metric_families


@dataclass(frozen=True)
class Completion:
    text: str
    prompt_tokens: int
    completion_tokens: int
    ttft_s: float


def complete(url: str, model: str, prompt: str, max_tokens: int, timeout: float = 120.0
             ) -> Completion:
    """One greedy streaming /v1/completions request (the way a chat front end sends them)."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    req = urllib.request.Request(url + "/v1/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    t0 = time.monotonic()
    ttft = None
    parts = []
    usage: Dict[str, int] = {}
    with urllib.request.urlopen(req, timeout=timeout) as r:
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data:"):])
            if chunk.get("usage"):
                usage = chunk["usage"]
            for choice in chunk.get("choices", []):
                if choice.get("text") and ttft is None:
                    ttft = time.monotonic() - t0
                parts.append(choice.get("text", ""))
    if not usage:
        raise AssertionError("the stream carried no usage chunk")
    return Completion("".join(parts), int(usage["prompt_tokens"]),
                      int(usage["completion_tokens"]), ttft if ttft is not None else float("nan"))


def scrape(metrics_url: str) -> Dict[str, float]:
    """Every sample of a /metrics page, summed over its labels (engines, tiers), by name."""
    with urllib.request.urlopen(metrics_url, timeout=10) as r:
        text = r.read().decode()
    out: Dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[s.name] = out.get(s.name, 0.0) + s.value
    return out
