"""Block bytes <-> vLLM's paged KV tensors.

vLLM hands the connector one tensor per attention layer, a logical
[B, H, N, C] view (B kernel blocks, H head slots, N tokens per kernel block,
C content elements) whose strides follow the backend's physical layout. A
vLLM block may span k kernel blocks (N * k == block_tokens) when the kernel
needs smaller blocks than the scheduler's.

A kvkeeper block is the concatenation, layer by layer in the KV cache
group's order, of that layer's page in logical [H, block_tokens, C] order
(see layout.py). `BlockCodec.gather` copies vLLM blocks into rows of a uint8
staging tensor [n, block_bytes]; `scatter` copies rows back. Both work for
any strides and any device (copy_ moves across devices).

The direct load path skips the staging tensor: `copy_layer_in` copies one
layer of each block straight from its source bytes (views of the daemon's
shared-memory arena) into the KV tensors, one layer at a time so a layer's
attention can start once that layer is in (`copy_block_in`: every layer of
one block, so that its check reads the source from the cache); where a
layer's block is one span of host memory (vLLM's CPU layout), with one
memmove per block and layer. `block_checksum` hashes a block
as it is in the KV cache, layer piece by layer piece (the loads check the
bytes they copied from instead: load/copy_in.py).
"""
from __future__ import annotations

import ctypes
import warnings
from typing import Any, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple

import torch

from kvkeeper.client.checksum import checksum_parts

from .layout import KVLayout

__all__ = ["BlockCodec", "LayoutMismatch", "block_source", "block_sources"]


def block_source(pieces: Sequence[memoryview], block_bytes: int) -> torch.Tensor:
    """A block's bytes (pieces in order: arena extents, a received chunk) as
    a uint8 tensor for copy_layer_in: a view when it is one piece (the usual
    case), else a copy joining them."""
    return block_sources([pieces], block_bytes)[0]


def block_sources(blocks: Sequence[Sequence[memoryview]], block_bytes: int) -> List[torch.Tensor]:
    """block_source of each block's pieces (one warnings filter for all: per
    block it cost five times the views themselves)."""
    with warnings.catch_warnings():
        # Read-only views are only read; torch warns about any non-writable buffer.
        warnings.simplefilter("ignore", UserWarning)
        return [_joined([torch.frombuffer(p, dtype=torch.uint8) for p in pieces if len(p)],
                        block_bytes) for pieces in blocks]


def _joined(parts: List[torch.Tensor], block_bytes: int) -> torch.Tensor:
    if len(parts) == 1 and parts[0].numel() == block_bytes:
        return parts[0]
    out = torch.cat(parts) if parts else torch.empty(0, dtype=torch.uint8)
    if out.numel() != block_bytes:
        raise ValueError(f"a block's extents hold {out.numel()} bytes, not {block_bytes}")
    return out


class LayoutMismatch(ValueError):
    """The real KV tensors do not match the layout derived from the config."""


class _Layer:
    __slots__ = ("name", "tensor", "offset", "split", "kernel_tokens", "elem_bytes", "flat")

    def __init__(self, name: str, tensor: torch.Tensor, offset: int, split: int) -> None:
        self.name = name
        self.tensor = tensor
        self.offset = offset
        self.split = split  # kernel blocks per vLLM block
        self.kernel_tokens = tensor.shape[2]
        self.elem_bytes = tensor.element_size()
        # A vLLM block of this layer is one span of host memory holding its
        # logical [H, N, C] bytes in order (one kernel block, row-major
        # inside): then a block's layer is copied in with one memmove.
        self.flat = (tensor.device.type == "cpu" and split == 1 and tensor.shape[0] > 0
                     and tensor[0].is_contiguous()
                     and tensor.stride(0) * self.elem_bytes >= tensor[0].numel() * self.elem_bytes)


_memmove = ctypes.memmove


class BlockCodec:
    """Copies whole vLLM blocks of every layer between the KV cache and
    contiguous block buffers."""

    def __init__(self, layout: KVLayout, kv_caches: Mapping[str, torch.Tensor],
                 num_blocks: int) -> None:
        problems = self.check(layout, kv_caches, num_blocks)
        if problems:
            raise LayoutMismatch("; ".join(problems))
        self.layout = layout
        self.block_bytes = layout.block_bytes
        self._layers: List[_Layer] = []
        for i, name in enumerate(layout.layer_names):
            t = kv_caches[name]
            self._layers.append(_Layer(name, t, i * layout.layer_bytes, t.shape[0] // num_blocks))
        self.device = self._layers[0].tensor.device
        # Flat layers' (base address, bytes per block, blocks, offset in a block).
        self._spans = [(l.tensor.data_ptr(), l.tensor.stride(0) * l.elem_bytes,
                        l.tensor.shape[0], l.offset) if l.flat else (0, 0, 0, 0)
                       for l in self._layers]

    @staticmethod
    def check(layout: KVLayout, kv_caches: Mapping[str, torch.Tensor],
              num_blocks: int) -> List[str]:
        """What differs between `layout` and the tensors (empty: they match)."""
        problems: List[str] = []
        missing = [n for n in layout.layer_names if n not in kv_caches]
        if missing:
            problems.append(f"layers {missing[:3]} of the KV cache group have no KV tensor")
        extra = [n for n in kv_caches if n not in layout.layer_names]
        if extra:
            problems.append(f"KV tensors {extra[:3]} are not in the KV cache group")
        if num_blocks <= 0:
            problems.append(f"num_blocks is {num_blocks}")
            return problems
        for name in layout.layer_names:
            t = kv_caches.get(name)
            if t is None:
                continue
            if not isinstance(t, torch.Tensor):
                problems.append(f"{name}: KV cache is a {type(t).__name__}, not one tensor")
                continue
            if t.dim() != 4:
                problems.append(f"{name}: KV tensor has shape {tuple(t.shape)}, expected a 4-d "
                                "[blocks, heads, tokens, content] view")
                continue
            blocks, heads, tokens, content = t.shape
            if blocks % num_blocks:
                problems.append(f"{name}: {blocks} kernel blocks is not a multiple of "
                                f"{num_blocks} blocks")
                continue
            split = blocks // num_blocks
            if heads != layout.num_heads:
                problems.append(f"{name}: {heads} head slots, the config says {layout.num_heads}")
            if tokens * split != layout.block_tokens:
                problems.append(f"{name}: {split} kernel block(s) of {tokens} tokens, the config "
                                f"says blocks of {layout.block_tokens}")
            if content * t.element_size() != layout.content_bytes:
                problems.append(f"{name}: {content * t.element_size()} content bytes per head "
                                f"and token, the config says {layout.content_bytes}")
            dtype = str(t.dtype).replace("torch.", "")
            if dtype != layout.dtype.split("/")[0]:
                problems.append(f"{name}: dtype {dtype}, the config says {layout.dtype}")
        return problems

    # ---- helpers

    def _row_view(self, layer: _Layer, rows: torch.Tensor) -> torch.Tensor:
        """rows' bytes of `layer` as [n, H, split, kernel_tokens, C] of the layer's dtype."""
        n = rows.shape[0]
        lb = self.layout.layer_bytes
        part = rows[:, layer.offset:layer.offset + lb].view(layer.tensor.dtype)
        t = layer.tensor
        return part.view(n, t.shape[1], layer.split, layer.kernel_tokens, t.shape[3])

    def new_rows(self, n: int, pin: bool = False) -> torch.Tensor:
        """A staging tensor for n blocks: uint8 [n, block_bytes] on the CPU."""
        return torch.empty((n, self.block_bytes), dtype=torch.uint8, pin_memory=pin)

    def _check_rows(self, block_ids: Sequence[int], rows: torch.Tensor) -> None:
        if rows.dtype != torch.uint8 or rows.dim() != 2 or rows.shape[1] != self.block_bytes:
            raise ValueError(f"rows must be uint8 [n, {self.block_bytes}], got "
                             f"{rows.dtype} {tuple(rows.shape)}")
        if rows.shape[0] != len(block_ids):
            raise ValueError(f"{len(block_ids)} block ids but {rows.shape[0]} rows")
        if rows.stride(1) != 1:
            raise ValueError("rows must be contiguous within a row")

    # ---- API

    def gather(self, block_ids: Sequence[int], rows: torch.Tensor) -> None:
        """Copy vLLM blocks `block_ids` (all layers) into rows[i]."""
        self._check_rows(block_ids, rows)
        if not len(block_ids):
            return
        for i, layer in enumerate(self._layers):
            self.gather_layer(i, self.kernel_ids(i, block_ids).to(layer.tensor.device), rows)

    def scatter(self, block_ids: Sequence[int], rows: torch.Tensor) -> None:
        """Copy rows[i] into vLLM block block_ids[i] (all layers)."""
        self._check_rows(block_ids, rows)
        if not len(block_ids):
            return
        for i, layer in enumerate(self._layers):
            self.scatter_layer(i, self.kernel_ids(i, block_ids).to(layer.tensor.device), rows)

    # ---- one layer, kernel block ids given (the device path: kvkeeper.connector.gpu)

    def kernel_ids(self, index: int, block_ids: Sequence[int]) -> torch.Tensor:
        """The kernel blocks of vLLM blocks `block_ids` in layer `index`, in
        order, as a CPU long tensor (the device path moves it itself, without
        a synchronous copy)."""
        layer = self._layers[index]
        ids = torch.as_tensor(list(block_ids), dtype=torch.long)
        if layer.split > 1:
            ids = (ids[:, None] * layer.split + torch.arange(layer.split)).reshape(-1)
        return ids

    def gather_layer(self, index: int, kernel_ids: torch.Tensor, rows: torch.Tensor) -> None:
        """Copy layer `index` of the kernel blocks `kernel_ids` (on the KV
        tensor's device) into rows (uint8 [n, block_bytes], any device)."""
        layer = self._layers[index]
        t = layer.tensor
        n = rows.shape[0]
        src = t.index_select(0, kernel_ids)
        # [n*split, H, Nk, C] -> [n, split, H, Nk, C] -> [n, H, split, Nk, C]
        src = src.view(n, layer.split, t.shape[1], layer.kernel_tokens, t.shape[3])
        self._row_view(layer, rows).copy_(src.permute(0, 2, 1, 3, 4))

    def scatter_layer(self, index: int, kernel_ids: torch.Tensor, rows: torch.Tensor) -> None:
        """Copy layer `index` of rows (uint8 [n, block_bytes]) into the kernel
        blocks `kernel_ids` (on the KV tensor's device)."""
        layer = self._layers[index]
        t = layer.tensor
        n = rows.shape[0]
        src = self._row_view(layer, rows).permute(0, 2, 1, 3, 4)
        src = src.reshape(n * layer.split, t.shape[1], layer.kernel_tokens, t.shape[3])
        t.index_copy_(0, kernel_ids, src.to(t.device))

    # ---- direct path (no staging tensor)

    @property
    def num_layers(self) -> int:
        return len(self._layers)

    @property
    def layer_names(self) -> List[str]:
        return [layer.name for layer in self._layers]

    def _block_slice(self, layer: _Layer, block_id: int) -> torch.Tensor:
        """The kernel blocks of vLLM block `block_id` in `layer`: [split, H, Nk, C]."""
        k = layer.split
        return layer.tensor[block_id * k:(block_id + 1) * k]

    def copy_layer_in(self, index: int, block_ids: Sequence[int],
                      sources: Sequence[torch.Tensor]) -> None:
        """Copy layer `index` of sources[i] (a uint8 tensor of block_bytes: one
        whole block, e.g. a view of the arena) into vLLM block block_ids[i]."""
        layer = self._layers[index]
        lb = self.layout.layer_bytes
        t = layer.tensor
        if layer.flat:
            self._memmove_in((self._spans[index],), block_ids, sources)
            return
        shape = (t.shape[1], layer.split, layer.kernel_tokens, t.shape[3])
        for bid, src in zip(block_ids, sources):
            part = src[layer.offset:layer.offset + lb].view(t.dtype).view(shape)
            # logical [H, split, Nk, C] -> the kernel blocks' [split, H, Nk, C];
            # with one kernel block the same bytes in order (a plain copy).
            part = part.view(1, *t.shape[1:]) if layer.split == 1 else part.permute(1, 0, 2, 3)
            self._block_slice(layer, bid).copy_(part)

    def copy_block_in(self, block_id: int, source: torch.Tensor) -> None:
        """Copy every layer of `source` (one whole block) into vLLM block
        `block_id`: a block at a time, so that checking it right after reads
        its source from the cache rather than from memory."""
        if all(layer.flat for layer in self._layers):
            self._memmove_in(self._spans, (block_id,), (source,))
            return
        for i in range(len(self._layers)):
            self.copy_layer_in(i, (block_id,), (source,))

    def _memmove_in(self, spans: Sequence[Tuple[int, int, int, int]], block_ids: Sequence[int],
                    sources: Sequence[torch.Tensor]) -> None:
        """The copy of flat layers: one memmove per block and layer. A torch
        copy_ of each 64 KiB slice (with its views) cost 2-3x the CPU time
        of this on a 25 MB load of a 6-layer model, and ctypes releases the
        GIL, so two threads copy at once. Every address is checked first:
        nothing is written outside the KV tensors."""
        lb, bb = self.layout.layer_bytes, self.block_bytes
        for bid, src in zip(block_ids, sources):
            if not (src.device.type == "cpu" and src.dtype == torch.uint8 and src.dim() == 1
                    and src.numel() == bb and src.is_contiguous()):
                raise ValueError(f"a block source must be {bb} contiguous host bytes, got "
                                 f"{src.dtype} {tuple(src.shape)} on {src.device}")
            p = src.data_ptr()
            for base, stride, n, off in spans:
                if not 0 <= bid < n:
                    raise IndexError(f"block {bid} is outside the KV cache's {n} blocks")
                _memmove(base + bid * stride, p + off, lb)

    def flat_spans(self) -> Optional[List[Tuple[int, int, int, int]]]:
        """Every layer's (address, bytes per block, blocks, offset in a
        kvkeeper block) when every layer is flat (one span of host memory per
        block), else None. The addresses hold for the tensors' current storage."""
        if not all(layer.flat for layer in self._layers):
            return None
        return list(self._spans)

    def block_checksum(self, block_id: int, algo: int) -> int:
        """The checksum with `algo` (a ChecksumAlgo value) of vLLM block
        `block_id` as its block bytes would be (every layer in logical order),
        read from the KV tensors one layer's piece at a time (CRC32 chained,
        XXH3-64 streamed) without building the block. KeyError for an algo
        this process cannot compute."""
        return checksum_parts(algo, self._layer_pieces(block_id))

    def _layer_pieces(self, block_id: int) -> Iterator[Any]:
        """Block `block_id`'s bytes, layer by layer in logical [H, T, C] order:
        views of the KV tensors where the layout allows (one kernel block per
        vLLM block), else a copy of that one layer's piece."""
        for layer in self._layers:
            part = self._block_slice(layer, block_id).permute(1, 0, 2, 3)
            if not part.is_contiguous():
                part = part.contiguous()
            if part.device.type != "cpu":
                part = part.cpu()
            yield part.view(torch.uint8).reshape(-1).numpy()

    def describe(self) -> Dict[str, object]:
        first = self._layers[0].tensor
        return {"layers": len(self._layers), "shape": tuple(first.shape),
                "stride": tuple(first.stride()), "dtype": str(first.dtype),
                "split": self._layers[0].split, "block_bytes": self.block_bytes}
