"""Rounding between tokens, bytes, blocks and pages. A partial unit takes a whole one."""
from __future__ import annotations

from ..errors import InvalidArgument


def ceil_div(n: int, unit: int) -> int:
    return -(-n // unit)


def blocks_for_tokens(tokens: int, block_tokens: int) -> int:
    """Blocks needed to hold `tokens`; a partial tail block still takes a block."""
    if block_tokens <= 0:
        raise InvalidArgument(f"block_tokens must be positive, got {block_tokens}")
    if tokens <= 0:
        raise InvalidArgument(f"token count must be positive, got {tokens}")
    return ceil_div(tokens, block_tokens)


def full_blocks(tokens: int, block_tokens: int) -> int:
    """Blocks that are completely filled by `tokens`: only these are saved."""
    if block_tokens <= 0:
        raise InvalidArgument(f"block_tokens must be positive, got {block_tokens}")
    return max(tokens, 0) // block_tokens


def pages_for_bytes(nbytes: int, page_bytes: int) -> int:
    if page_bytes <= 0:
        raise InvalidArgument(f"page_bytes must be positive, got {page_bytes}")
    if nbytes <= 0:
        raise InvalidArgument(f"byte count must be positive, got {nbytes}")
    return ceil_div(nbytes, page_bytes)
