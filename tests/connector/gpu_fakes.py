"""A fake of kvkeeper.connector.gpu.ops.CudaOps for CPU tests: the same
calls, logged in order, with copies on CPU tensors (immediate)."""
from __future__ import annotations

import contextlib
import os
from typing import Any, Dict, List, Tuple

import torch

from kvkeeper.connector.blocks import BlockCodec
from kvkeeper.connector.layout import KVLayout


class FakeOps:
    pin = False
    side = "side"

    def __init__(self) -> None:
        self.log: List[Tuple[Any, ...]] = []
        self.cur = "compute"
        self._n = 0

    def on_side(self) -> Any:
        return contextlib.nullcontext()

    def current(self) -> str:
        return self.cur

    def record(self, stream: str) -> Tuple[str, int, str]:
        self._n += 1
        ev = ("ev", self._n, stream)
        self.log.append(("record", stream, ev))
        return ev

    def wait(self, stream: str, event: Any) -> None:
        self.log.append(("wait", stream, event))

    def synchronize(self, event: Any) -> None:
        self.log.append(("sync", event))

    def done(self, event: Any) -> bool:
        return True

    def to_device(self, t: torch.Tensor) -> torch.Tensor:
        return t


def small_codec(layers: int = 3, num_blocks: int = 8, split: int = 1
                ) -> Tuple[BlockCodec, Dict[str, torch.Tensor]]:
    """A codec over CPU KV tensors of `layers` layers of 16 KiB pages, zeroed."""
    layout = KVLayout(layer_names=tuple(f"l{i}" for i in range(layers)), num_heads=2,
                      block_tokens=32, content_bytes=64 * 4, dtype="float32", physical="LBHNC",
                      spec_kind="FullAttentionSpec")
    kv = {n: torch.zeros(num_blocks * split, 2, 32 // split, 64) for n in layout.layer_names}
    return BlockCodec(layout, kv, num_blocks), kv


def random_blocks(codec: BlockCodec, n: int) -> List[torch.Tensor]:
    return [torch.frombuffer(bytearray(os.urandom(codec.block_bytes)), dtype=torch.uint8)
            for _ in range(n)]
