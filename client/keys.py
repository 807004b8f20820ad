"""Chained block keys: what names a block of KV in the daemon.

A key names one FULL block of `block_tokens` tokens *and everything before it*:

    seed    = sha256(DOMAIN || canonical(namespace) || request salt, LoRA, media ids)
    key_0   = sha256(seed    || le64(tokens of block 0))
    key_i   = sha256(key_i-1 || le64(tokens of block i))

so two requests share key_i only when they share the whole prefix up to the
end of block i, in the same namespace (model, dtype, layout, block size, TP
rank...), with the same cache salt and LoRA adapter. Token ids are encoded as
little-endian int64 and every field of the seed has a fixed, length-prefixed
encoding, so keys are identical across processes, hosts and PYTHONHASHSEED
values (unlike Python's hash()). Only hashlib and struct are used: importing
this module never imports torch or vLLM.

The daemon never sees tokens: it only compares these 32-byte digests.

The one copy of this code: the connector uses it (kvkeeper.connector.keys
re-exports it) and so does a router outside the engines (client/route.py),
which is why it lives in the client, which the daemon's install has too.
"""
from __future__ import annotations

import hashlib
import struct
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

__all__ = [
    "KEY_BYTES", "NAMESPACE_FIELDS", "namespace_seed", "block_tokens_bytes", "chain_keys",
    "KeyChain", "RequestSeeds", "full_blocks", "matchable_blocks", "hit_tokens",
]

KEY_BYTES = 32
_DOMAIN = b"kvkeeper/block-key/v1\x00"

# The descriptor fields that take part in the seed, in this fixed order. The
# daemon's own cache_salt / lora_tag fields stay empty for a connector session:
# per-request salts and adapters go into the seed instead, so one session per
# namespace serves every request.
NAMESPACE_FIELDS = ("model_id", "model_revision", "dtype", "kv_layout", "block_tokens",
                    "block_bytes", "tp_rank", "tp_size", "cache_salt", "lora_tag")


def _field(h: "hashlib._Hash", value: Any) -> None:
    """Absorb one field as tag + length + bytes, so no two field lists collide."""
    if value is None:
        h.update(b"N")
        return
    if isinstance(value, bool):
        raise TypeError("booleans are not namespace fields")
    if isinstance(value, int):
        h.update(b"I" + struct.pack("<q", value))
        return
    data = value.encode("utf-8") if isinstance(value, str) else bytes(value)
    h.update(b"S" + struct.pack("<Q", len(data)) + data)


def namespace_seed(namespace: Mapping[str, Any], *, cache_salt: Optional[str] = None,
                   lora: Optional[str] = None, extra: Sequence[str] = ()) -> bytes:
    """The 32-byte seed of a request's key chain.

    namespace: the session's descriptor fields (see NAMESPACE_FIELDS; missing
    ones count as empty). cache_salt: the request's cache salt. lora: a tag
    naming the request's LoRA adapter. extra: further identities that change
    the KV of the same tokens (e.g. multimodal content hashes), in order.
    """
    h = hashlib.sha256(_DOMAIN)
    for name in NAMESPACE_FIELDS:
        v = namespace.get(name)
        if name in ("block_tokens", "block_bytes", "tp_rank"):
            v = int(v or 0)
        elif name == "tp_size":
            v = int(v or 1)  # the proto reads 0 as 1
        else:
            v = str(v or "")
        _field(h, v)
    _field(h, cache_salt or "")
    _field(h, lora or "")
    _field(h, len(extra))
    for e in extra:
        _field(h, str(e))
    return h.digest()


class RequestSeeds:
    """namespace_seed of each of `namespaces` (a TP rank's, or a KV cache
    group's, each) for a request's cache salt, LoRA tag and extra
    identities, remembered: every request of one tenant and adapter without
    multimodal content has the same seeds, which cost ~30 us a namespace to
    compute on the scheduler's path of each new request. At most `limit`
    combinations are kept (then forgotten all at once)."""

    __slots__ = ("namespaces", "_memo", "_limit")

    def __init__(self, namespaces: Sequence[Mapping[str, Any]], limit: int = 1024) -> None:
        self.namespaces = [dict(ns) for ns in namespaces]
        self._memo: Dict[Tuple[Any, ...], Tuple[bytes, ...]] = {}
        self._limit = limit

    def __call__(self, cache_salt: Optional[str] = None, lora: Optional[str] = None,
                 extra: Sequence[str] = ()) -> Tuple[bytes, ...]:
        key = (cache_salt, lora, tuple(extra))
        got = self._memo.get(key)
        if got is None:
            got = tuple(namespace_seed(ns, cache_salt=cache_salt, lora=lora, extra=extra)
                        for ns in self.namespaces)
            if len(self._memo) >= self._limit:
                self._memo.clear()
            self._memo[key] = got
        return got


def block_tokens_bytes(tokens: Sequence[int]) -> bytes:
    """Token ids as little-endian int64."""
    return struct.pack(f"<{len(tokens)}q", *tokens)


def chain_keys(seed: bytes, tokens: Sequence[int], block_tokens: int,
               num_blocks: Optional[int] = None) -> List[bytes]:
    """Keys of the leading full blocks of `tokens` (at most num_blocks)."""
    chain = KeyChain(seed, block_tokens)
    return chain.keys(tokens, full_blocks(len(tokens), block_tokens)
                      if num_blocks is None else num_blocks)


def full_blocks(num_tokens: int, block_tokens: int) -> int:
    """Blocks completely filled by num_tokens tokens."""
    return max(0, num_tokens) // block_tokens


def matchable_blocks(num_tokens: int, block_tokens: int) -> int:
    """Blocks a lookup may match and load for a sequence of num_tokens tokens:
    every full block, the one holding the last token included (see hit_tokens)."""
    return full_blocks(num_tokens, block_tokens)


def hit_tokens(num_tokens: int, matched_blocks: int, block_tokens: int) -> int:
    """Tokens a hit of the leading matched_blocks blocks may report to vLLM.

    vLLM must compute at least the last token itself (to sample the next
    one), so a hit never covers all of them: at most num_tokens - 1. When
    the block holding the last token is matched too it is loaded whole, and
    vLLM computes only that token, not the whole last block: it writes that
    token's KV over the loaded copy (the same values up to floating-point
    rounding: a one-token forward need not reproduce a long prefill's bits).
    """
    return max(0, min(matched_blocks * block_tokens, num_tokens - 1))


class KeyChain:
    """The keys of one request, extended incrementally as its tokens grow.

    Tokens only ever get appended to a request, so the keys computed so far
    stay valid; `keys(tokens, n)` computes only the missing ones.
    """

    __slots__ = ("seed", "block_tokens", "_keys")

    def __init__(self, seed: bytes, block_tokens: int) -> None:
        if len(seed) != KEY_BYTES:
            raise ValueError(f"seed must be {KEY_BYTES} bytes, got {len(seed)}")
        if block_tokens <= 0:
            raise ValueError(f"block_tokens must be > 0, got {block_tokens}")
        self.seed = seed
        self.block_tokens = block_tokens
        self._keys: List[bytes] = []

    def __len__(self) -> int:
        return len(self._keys)

    def keys(self, tokens: Sequence[int], num_blocks: int) -> List[bytes]:
        """The first num_blocks keys; raises ValueError if `tokens` does not
        fill that many blocks."""
        bt = self.block_tokens
        if num_blocks * bt > len(tokens):
            raise ValueError(f"{len(tokens)} tokens fill only {len(tokens) // bt} blocks of "
                             f"{bt}, not {num_blocks}")
        prev = self._keys[-1] if self._keys else self.seed
        first = len(self._keys)
        if first < num_blocks:
            # One pack of every new block's tokens (a pack per block cost as
            # much as the hashing: ~1 us each), then a slice per block.
            data = block_tokens_bytes(tokens[first * bt:num_blocks * bt])
            step = bt * 8
            for off in range(0, len(data), step):
                prev = hashlib.sha256(prev + data[off:off + step]).digest()
                self._keys.append(prev)
        return self._keys[:num_blocks]

    def computed(self) -> List[bytes]:
        """The keys computed so far, in block order (a copy)."""
        return list(self._keys)
