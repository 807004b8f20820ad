"""PeerRegistry: the KV cache segments same-host engines registered, and what each holds.

Sans-I/O (the service, service.py, does the sockets and mappings): a
session registers one segment (its engine's KV cache and generation array,
as descriptors the registry keeps), publishes (key, block, generation)
entries for the blocks its cache holds, and ends; the registry then closes
the segment's descriptors and forgets its entries. A peer's lookup walks
each other engine's entries in the namespace and answers the longest
prefix, checking each entry's generation against the holder's live array
(`gen_of`): an entry whose block was reused since is dropped on the way, so
a stale entry costs at most a shorter answer. The peer checks the
generations again around its copy (the holder may reuse a block meanwhile):
the registry's answer is a hint, never a lease.

Each segment holds at most one key per block (a block republished under a
new key forgets the old one), so its index is bounded by the cache.
"""
from __future__ import annotations

import secrets
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Set, Tuple

from kvkeeper.client.peer_segment import check_descriptor

from ..errors import InvalidArgument, NotFound
from ..ids import NamespaceId, SessionId

__all__ = ["PeerRegistry", "Segment"]

# Most keys one lookup walks: a longer chain is answered up to here.
MAX_MATCH_KEYS = 1 << 16


@dataclass(eq=False)
class Segment:
    id: str
    session: SessionId
    namespace: NamespaceId
    engine: str
    descriptor: Dict[str, Any]
    kv_fd: int
    gens_fd: int
    gen_of: Callable[[int], int]        # the holder's generation of a block, now
    attached: Callable[[], bool]        # the holder's scheduler bumps generations
    index: Dict[bytes, Tuple[int, int]] = field(default_factory=dict)   # key -> (block, gen)
    key_of: Dict[int, bytes] = field(default_factory=dict)              # block -> key

    @property
    def num_blocks(self) -> int:
        return int(self.descriptor["num_blocks"])

    def forget(self, key: bytes) -> None:
        entry = self.index.pop(key, None)
        if entry is not None and self.key_of.get(entry[0]) == key:
            del self.key_of[entry[0]]


class PeerRegistry:
    """Segments by id, by session and by namespace. `release(segment)` is
    called once for each segment forgotten (the service closes its
    descriptors and unmaps its generations there)."""

    def __init__(self, release: Callable[[Segment], None]) -> None:
        self._release = release
        self.segments: Dict[str, Segment] = {}
        self._by_session: Dict[SessionId, Segment] = {}
        self._by_namespace: Dict[NamespaceId, Set[Segment]] = {}

    def register(self, session: SessionId, namespace: NamespaceId, engine: str,
                 descriptor: Any, kv_fd: int, gens_fd: int, kv_size: int, gens_size: int,
                 gen_of: Callable[[int], int], attached: Callable[[], bool]) -> Segment:
        """The session's segment (replacing one it registered before).
        InvalidArgument for a bad descriptor or engine: nothing changes then,
        and the caller still owns the descriptors."""
        if not isinstance(engine, str) or not engine or len(engine) > 256:
            raise InvalidArgument("engine must be a non-empty string of at most 256 characters")
        problems = check_descriptor(descriptor, kv_size, gens_size)
        if problems:
            raise InvalidArgument("peer segment descriptor: " + "; ".join(problems[:4]))
        self.end_session(session)
        seg = Segment(secrets.token_hex(12), session, namespace, engine, dict(descriptor),
                      kv_fd, gens_fd, gen_of, attached)
        self.segments[seg.id] = seg
        self._by_session[session] = seg
        self._by_namespace.setdefault(namespace, set()).add(seg)
        return seg

    def _own(self, session: SessionId, segment: Any) -> Segment:
        seg = self._by_session.get(session)
        if seg is None or seg.id != segment:
            raise NotFound(f"peer segment {str(segment)[:32]!r} is not registered by this "
                           "session; register it again")
        return seg

    def publish(self, session: SessionId, segment: Any, entries: Any) -> int:
        """Index [key hex, block, generation] entries of the session's segment;
        all or nothing (InvalidArgument names the first bad entry)."""
        seg = self._own(session, segment)
        if not isinstance(entries, list):
            raise InvalidArgument("blocks must be a list of [key hex, block, generation]")
        parsed: List[Tuple[bytes, int, int]] = []
        for i, e in enumerate(entries):
            parsed.append(_entry(i, e, seg.num_blocks))
        for key, block, gen in parsed:
            old = seg.key_of.get(block)
            if old is not None and old != key:
                seg.index.pop(old, None)
            prev = seg.index.get(key)
            if prev is not None and prev[0] != block and seg.key_of.get(prev[0]) == key:
                del seg.key_of[prev[0]]
            seg.index[key] = (block, gen)
            seg.key_of[block] = key
        return len(parsed)

    def match(self, namespace: NamespaceId, engine: str, keys: Sequence[bytes]
              ) -> Tuple[Optional[Segment], List[Tuple[int, int]]]:
        """The segment of another engine than `engine` holding the longest
        prefix of `keys`, and (block, generation) of each key of that prefix."""
        best: Optional[Segment] = None
        best_blocks: List[Tuple[int, int]] = []
        keys = keys[:MAX_MATCH_KEYS]
        for seg in self._by_namespace.get(namespace, ()):
            if seg.engine == engine or not seg.attached():
                continue
            got: List[Tuple[int, int]] = []
            for key in keys:
                entry = seg.index.get(key)
                if entry is None:
                    break
                if seg.gen_of(entry[0]) != entry[1]:
                    seg.forget(key)   # reused since it was published
                    break
                got.append(entry)
            if len(got) > len(best_blocks):
                best, best_blocks = seg, got
        return best, best_blocks

    def get(self, namespace: NamespaceId, segment: Any) -> Segment:
        """Segment `segment` for a session of `namespace`; NotFound otherwise
        (gone, or another namespace's: the same answer)."""
        seg = self.segments.get(segment) if isinstance(segment, str) else None
        if seg is None or seg.namespace != namespace:
            raise NotFound(f"no peer segment {str(segment)[:32]!r} in this namespace (its "
                           "engine may have ended)")
        return seg

    def end_session(self, session: SessionId) -> bool:
        """Forget the session's segment, if any."""
        seg = self._by_session.pop(session, None)
        if seg is None:
            return False
        del self.segments[seg.id]
        peers = self._by_namespace.get(seg.namespace)
        if peers is not None:
            peers.discard(seg)
            if not peers:
                del self._by_namespace[seg.namespace]
        self._release(seg)
        return True

    def sweep(self, live: Callable[[SessionId], bool]) -> int:
        """Forget the segments of sessions that ended; how many."""
        return sum(self.end_session(s) for s in [s for s in self._by_session if not live(s)])

    def close(self) -> None:
        for s in list(self._by_session):
            self.end_session(s)


def _entry(i: int, e: Any, num_blocks: int) -> Tuple[bytes, int, int]:
    if not (isinstance(e, list) and len(e) == 3 and isinstance(e[0], str)
            and all(isinstance(x, int) and not isinstance(x, bool) for x in e[1:])):
        raise InvalidArgument(f"blocks[{i}] must be [key hex, block, generation], got {e!r:.80}")
    try:
        key = bytes.fromhex(e[0])
    except ValueError:
        raise InvalidArgument(f"blocks[{i}]: the key is not hex") from None
    if not 1 <= len(key) <= 64:
        raise InvalidArgument(f"blocks[{i}]: a key of {len(key)} bytes")
    if not 0 <= e[1] < num_blocks:
        raise InvalidArgument(f"blocks[{i}]: block {e[1]} is outside the segment's "
                              f"{num_blocks} blocks")
    if e[2] < 0:
        raise InvalidArgument(f"blocks[{i}]: generation {e[2]} < 0")
    return key, e[1], e[2]
