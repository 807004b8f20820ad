"""The paired workloads of the prefix experiment, as reviewable JSONL files.

Both workloads have the same number of requests, the same output length and
the same task text per request, and prompts of the same length; only the
prefix relationship differs:

* unique prefix (the baseline): request i opens with its own context document;
* shared prefix (the candidate): every request opens with one shared document.

A prompt is `<context document>\\n\\n<task i>`. Documents are drawn from a
fixed vocabulary by a PRNG seeded with their name, so the files are the same
on every run; a pass tag in every name makes the swapped pass's prompts new
(neither vLLM's cache nor the daemon holds them from the first pass). 400
words of plain English are ~450-550 tokens with a typical BPE tokenizer,
i.e. 14-17 blocks of 32 tokens.
"""
from __future__ import annotations

import hashlib
import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, Iterable, List, Optional

WORKLOAD_ID = "kvkeeper-prefix-lifecycle"
WORKLOAD_VERSION = "v1"
DEFAULT_PREFIX_WORDS = 400

_VOCAB = (
    "cache block token prefix layer memory engine request decode prefill batch tensor page "
    "lease ledger arena shared host disk tier evict reclaim append allocate release share "
    "reference counter capacity budget scheduler worker stream socket daemon model weight "
    "attention kernel latency throughput queue admit reject preempt swap recompute restart "
    "replay verify metric label sample snapshot window sliding chunk sequence position "
    "offset hash chain seed namespace layout shape dtype precision rounding checksum record "
    "state lifecycle event table policy value cold warm hot idle busy pinned free used full "
    "partial boundary tail head first last next previous step round phase pass run"
).split()


@dataclass(frozen=True)
class Row:
    """One request of a workload file."""
    id: str
    prompt: str
    max_tokens: int
    prefix_id: str

    def to_json(self) -> Dict[str, Any]:
        return {"id": self.id, "prefix_id": self.prefix_id, "max_tokens": self.max_tokens,
                "prompt": self.prompt}


def document(name: str, words: int) -> str:
    """A deterministic pseudo-text of `words` words; its first line names it, so two
    documents differ from their first tokens on."""
    rng = random.Random(f"kvkeeper-doc:{name}")
    body = []
    for i in range(words):
        w = rng.choice(_VOCAB)
        body.append(w.capitalize() if i % 12 == 0 else w)
        if i % 12 == 11:
            body[-1] += "."
    return f"Context document {name}.\n" + " ".join(body)


def task(i: int) -> str:
    return (f"Request {i}: in one sentence, say which lifecycle event of the KV cache "
            f"the context above describes most often.")


def pair(num_prompts: int, max_tokens: int, pass_tag: str,
         prefix_words: int = DEFAULT_PREFIX_WORDS) -> Dict[str, List[Row]]:
    """{"unique": rows, "shared": rows}: the two workloads of one pass."""
    if num_prompts < 1 or max_tokens < 1 or prefix_words < 1:
        raise ValueError("num_prompts, max_tokens and prefix_words must be positive")
    shared_name = f"{pass_tag}-shared"
    shared_doc = document(shared_name, prefix_words)
    unique, shared = [], []
    for i in range(num_prompts):
        name = f"{pass_tag}-unique-{i:03d}"
        unique.append(Row(f"{pass_tag}-unique-{i:03d}", f"{document(name, prefix_words)}\n\n{task(i)}",
                          max_tokens, name))
        shared.append(Row(f"{pass_tag}-shared-{i:03d}", f"{shared_doc}\n\n{task(i)}",
                          max_tokens, shared_name))
    return {"unique": unique, "shared": shared}


def warmup_rows(count: int, max_tokens: int, tag: str,
                prefix_words: int = DEFAULT_PREFIX_WORDS) -> List[Row]:
    """Requests that warm the server up (first-request costs) without priming
    the cache for the measured run: their documents share nothing with it."""
    return [Row(f"{tag}-warmup-{i}", f"{document(f'{tag}-warmup-{i}', prefix_words)}\n\n{task(i)}",
                max_tokens, f"{tag}-warmup-{i}") for i in range(count)]


def write_jsonl(path: Path, rows: Iterable[Row]) -> str:
    """Write rows, one JSON object a line; returns the file's sha256."""
    text = "".join(json.dumps(r.to_json(), ensure_ascii=False) + "\n" for r in rows)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    return hashlib.sha256(text.encode()).hexdigest()


def read_jsonl(path: Path, default_max_tokens: int, override_max_tokens: Optional[int] = None
               ) -> List[Row]:
    """Rows of a prompt file: one JSON object a line with a "prompt" string and
    optionally "id", "max_tokens" (else default_max_tokens; override_max_tokens
    wins over both) and "prefix_id"; blank lines are skipped. ValueError names
    the line of a bad entry."""
    rows: List[Row] = []
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as e:
        raise ValueError(f"cannot read {path}: {e.strerror or e}") from None
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{n}: not JSON: {e.msg}") from None
        if not isinstance(obj, dict) or not isinstance(obj.get("prompt"), str) or not obj["prompt"]:
            raise ValueError(f"{path}:{n}: expected an object with a non-empty \"prompt\" string")
        mt = override_max_tokens or obj.get("max_tokens", default_max_tokens)
        if not isinstance(mt, int) or isinstance(mt, bool) or mt < 1:
            raise ValueError(f"{path}:{n}: \"max_tokens\" must be a positive integer")
        rid = str(obj.get("id", f"line-{n}"))
        rows.append(Row(rid, obj["prompt"], mt, str(obj.get("prefix_id", rid))))
    if not rows:
        raise ValueError(f"{path}: no prompts")
    return rows


def sha256_file(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()
