"""What `kvkeeper bench ttft` measures: its models, prompt lengths and counts.

A result of one shape can be tuned to that shape (issue 12: a one-layer model
without GQA hid the per-layer and per-byte costs a real model has), so the
benchmark runs a matrix:

  m1  model.M1: one layer, 12 KV heads, vocab 32000    2048 tokens
  m2  model.M2: 6 layers, GQA (4 KV heads), vocab 8192  2048 and 4096 tokens

--model CONFIG.json (repeatable) runs those Llama-like configs instead, each
at 2048 and 4096 tokens (lengths its max_position_embeddings cannot hold are
left out, and said so). --quick: m1 only, 512 tokens, 2 repetitions (a smoke
run of the whole path, not a measurement). The partial hit shares 75% of the
prompt (rounded down to whole blocks).
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from kvkeeper.server.bench.registry import BenchUsageError

from .model import BLOCK_TOKENS, M1, M2, load_config

FULL_LENGTHS = {"m1": (2048,), "m2": (2048, 4096)}
CONFIG_LENGTHS = (2048, 4096)
QUICK_TOKENS = 512
SHARED_FRACTION = 0.75


@dataclass(frozen=True)
class Scale:
    reps: int
    warmups: int
    in_process: bool        # engines in one process each (faster start, not vLLM's layout)

    @classmethod
    def for_mode(cls, quick: bool) -> "Scale":
        if quick:
            return cls(reps=2, warmups=1, in_process=True)
        return cls(reps=9, warmups=2, in_process=False)


@dataclass(frozen=True)
class ModelRun:
    """One model of the matrix and the prompt lengths it runs (one engine set)."""
    label: str
    cfg: Dict[str, Any]
    lengths: Tuple[int, ...]
    source: str             # "M1", "M2" or the --model path

    @property
    def max_model_len(self) -> int:
        # the floor asks for the longest prompt plus one token
        return max(self.lengths) + BLOCK_TOKENS


@dataclass(frozen=True)
class Case:
    """One model at one prompt length: every comparison of the run is per case."""
    model: ModelRun
    prompt_tokens: int

    @property
    def shared_tokens(self) -> int:
        return int(self.prompt_tokens * SHARED_FRACTION) // BLOCK_TOKENS * BLOCK_TOKENS

    @property
    def name(self) -> str:   # in result names: ttft.<name>.full_hit...
        return f"{self.model.label}.{self.prompt_tokens}"


@dataclass(frozen=True)
class Hits:
    """The hit tokens (and blocks) each request of a round must report."""
    full: int           # kvkeeper, full hit
    full_blocks: int
    example_full: int   # ExampleConnector, full hit
    partial: int        # kvkeeper partial hit, and vLLM's own cache on the same prompt
    floor: int          # vLLM's own cache: the served prompt, asked again plus one token

    @classmethod
    def of(cls, c: Case) -> "Hits":
        # kvkeeper loads every full block and reports all but the last token;
        # ExampleConnector stops at the last block boundary before it; vLLM's
        # own cache holds every full block of the prompt it served.
        n = c.prompt_tokens
        full = min(n // BLOCK_TOKENS * BLOCK_TOKENS, n - 1)
        return cls(full=full, full_blocks=-(-full // BLOCK_TOKENS),
                   example_full=(n - 1) // BLOCK_TOKENS * BLOCK_TOKENS,
                   partial=c.shared_tokens, floor=n // BLOCK_TOKENS * BLOCK_TOKENS)


def label_of(path: str, taken: Sequence[str]) -> str:
    """A short result-name label for a --model file: its name, made unique."""
    base = re.sub(r"[^a-z0-9_-]+", "-", os.path.basename(path).lower().removesuffix(".json"))
    base = base.strip("-") or "model"
    label, i = base, 2
    while label in taken or label in FULL_LENGTHS:
        label, i = f"{base}-{i}", i + 1
    return label


def matrix(quick: bool, configs: Optional[Sequence[str]] = None,
           log: Callable[[str], None] = lambda s: None) -> List[ModelRun]:
    """The models to run, in order. BenchUsageError for a config that cannot run."""
    if not configs:
        if quick:
            return [ModelRun("m1", M1, (QUICK_TOKENS,), "M1")]
        return [ModelRun("m1", M1, FULL_LENGTHS["m1"], "M1"),
                ModelRun("m2", M2, FULL_LENGTHS["m2"], "M2")]
    runs: List[ModelRun] = []
    for path in configs:
        cfg = load_config(path)
        wanted = (QUICK_TOKENS,) if quick else CONFIG_LENGTHS
        room = int(cfg["max_position_embeddings"]) - BLOCK_TOKENS
        lengths = tuple(n for n in wanted if n <= room)
        if not lengths:
            raise BenchUsageError(f"--model {path}: max_position_embeddings "
                             f"{cfg['max_position_embeddings']} holds none of the prompt "
                             f"lengths {list(wanted)} (plus {BLOCK_TOKENS} tokens)")
        if lengths != wanted:
            log(f"ttft: {path}: max_position_embeddings {cfg['max_position_embeddings']}: "
                f"only {list(lengths)} of {list(wanted)} tokens")
        runs.append(ModelRun(label_of(path, [r.label for r in runs]), cfg, lengths, path))
    return runs
