"""S3-FIFO (Yang et al., SOSP 2023) over evictable blocks, with a ghost table.

Three queues: small (S, probation, a share of the evictable blocks), main
(M) and ghosts of keys recently evicted from S (G) and from M (GM). A new
block enters S, or M when its key is in G or GM (it was evicted too early:
it came back). S's share adapts as ARC's target does: a G hit grows it, a
GM hit and each unhit block S lets go shrink it (see the class constants). A hit only
counts: a 2-bit frequency, capped at 3; nothing moves, so a hit is O(1) and
touches no list. Eviction, while S holds at least its share, takes S's front:
hit while in S -> moved to M (frequency reset); not -> evicted, its key into
G. Otherwise M's front: frequency > 0 -> reinserted at M's back with the
frequency one lower (so frequency decays: a block must keep being hit to
stay), else evicted. Each reinsertion lowers a bounded count, so pop() is
O(1) amortised.

Why it fits LLM traffic: the one-off blocks (unique tails, decode blocks of
requests that end) pass through S and leave without displacing M, where the
re-read prefixes (system prompts, shared documents, conversations' history)
live. A long one-off document would still flush S, and with it the newest
turns of conversations waiting there for their next turn, so a cold run
never enters S: a reserve of more than RUN fresh keys (none a ghost in G
or GM), or one continuing a cold run, is cold (admit_run). On a full tier
it is refused, its keys remembered in G (a save of the same document again
is admitted); with free room it is filed COLD, in a fourth FIFO (C) evicted
before anything else, its keys going to G as S's do; a hit moves a cold
block to M. That is the host tier's
admission rule for cold blocks; admits() is the disk book's (a cold key,
never hit and not in G, does not displace a full disk on its first arrival:
it is remembered in G and admitted when it comes again). A run is cold by
its length, not its content: a prefill step that brings more than RUN new
blocks (256 tokens of 16-token blocks) that nobody saved lately is a new
document, while a conversation's next turn adds its user message to
blocks saved before, and decode saves a block or two a step.

A conversation's next turn is the one run known to be read again soon: its
parent is the leaf the turn just read back (its first hit, no cached
children), where a one-off message hangs under a shared prefix that has
children already. Such a run is WARM: filed with a frequency of 1, so
probation hands it to main instead of letting it go before the turn after.
On the policy benchmark (seeds 1 and 2) that raised the 10% points by up to
0.05 of the optimum (scan-heavy 0.75 -> 0.80) and no point fell by more than
0.01; counting a run that holds a ghost key as warm too did worse.

A hit that is a reread (EvictionPolicy.reread: a lookup reading its own
chain back down to a leaf, a conversation's history read by its next turn)
raises the frequency to 1 at most; hits by other chains count in full.
On the policy benchmark (seeds 1-4) that raised the unhinted shares of the
optimum by up to 0.02 (every mix at 10% and 20%). Where last-turn hints
reclaim ended conversations it cost up to 0.012, so a namespace that has
sent one counts rereads as hits (Namespace.says_last_turn).

A ghost is a table of 16-bit fingerprints indexed by the key's hash, two
slots per evictable block (grown by doubling, which forgets it): a new
fingerprint overwrites whatever shared its slot, so old ghosts age out at
random, holding about as many keys as the cache. 8-16 bytes per block for
both. A false positive (1 in 32768 per occupied slot) sends a new block to M,
where it holds its ancestors parked behind it; with 1-byte fingerprints (1 in
128) that was one new block in a few hundred, and the parking it caused made
eviction at 1M blocks cost 2.6x its cost at 10k (README, ledger bench).
"""
from __future__ import annotations

import struct
from array import array
from typing import Any, Iterator, Sequence

from .chains import GONE
from .freelist import FreeList
from .recency import (ADMIT, COLD, COLD_RUN, FREQ, MAX_FREQ, Q1, Q2, QUEUE, REFUSE, WARM_RUN,
                      EvictionPolicy)

SMALL, MAIN = Q1, Q2


_LO = struct.Struct("<Q").unpack_from
_HI = struct.Struct(">Q").unpack_from
_M64 = 0xFFFFFFFFFFFFFFFF


def key_hash(key: Any) -> int:
    """A key's 64-bit hash, the same in every process. hash() of bytes, str
    and tuples of them is salted per process (PYTHONHASHSEED), which made
    which ghosts collide, and so admissions, the policy bench's ratios and
    a test's ghost lookup, differ run to run. Both ends of a key of 8 bytes
    or more are mixed in (chains use digests), a shorter one whole with its
    length (tests name blocks b"c0"); a tuple (the disk book's (namespace,
    key)) folds its parts; then Fibonacci hashing spreads it. Ints hash the
    same everywhere already. A saved and evicted block's key is hashed
    several times (admission, filing, the ghost it leaves), so the usual
    case, a bytes key of 8 bytes or more, is read with two struct unpacks in
    place: half the cost of slicing and int.from_bytes (~0.33 vs ~0.69 us)."""
    if isinstance(key, bytes):   # the usual case first
        if len(key) >= 8:
            x = _LO(key)[0] ^ _HI(key, len(key) - 8)[0]   # both ends, little / big endian
        else:
            x = int.from_bytes(key, "little") | (len(key) << 56)
        h = (x * 0x9E3779B97F4A7C15) & _M64
        return h ^ (h >> 29)
    if isinstance(key, tuple):
        h = len(key)
        for part in key:
            h = ((h * 0x100000001B3) ^ key_hash(part)) & _M64
        return h
    if isinstance(key, str):
        return key_hash(key.encode())
    return hash(key)


class Ghost:
    """A bounded, forgetful set of key hashes (see the module docstring)."""

    __slots__ = ("_table", "_mask")

    def __init__(self, slots: int = 1024) -> None:
        self._table = array("H", bytes(2 * slots))
        self._mask = slots - 1

    def fit(self, blocks: int) -> None:
        """Hold at least one slot per block of a cache of `blocks`."""
        if blocks > len(self._table):
            n = len(self._table)
            while n < blocks:
                n *= 2
            self._table = array("H", bytes(2 * n))
            self._mask = n - 1

    def put(self, key: Any) -> None:
        self.put_hash(key_hash(key))

    def __contains__(self, key: Any) -> bool:
        return self.has_hash(key_hash(key))

    def take(self, key: Any) -> bool:
        """Whether `key` is a ghost; it stops being one."""
        return self.take_hash(key_hash(key))

    # The same by key_hash(key): the policy hashes a key once for both tables.
    # A slot holds the fingerprint ((h >> 40) & 0xFFFF) or 1: the hash's high
    # bits (the slot takes the low ones), never 0 ("empty"). Written out in
    # each, not called: these run for every saved and every evicted block.
    def put_hash(self, h: int) -> None:
        self._table[h & self._mask] = ((h >> 40) & 0xFFFF) or 1

    def has_hash(self, h: int) -> bool:
        return self._table[h & self._mask] == (((h >> 40) & 0xFFFF) or 1)

    def take_hash(self, h: int) -> bool:
        i = h & self._mask
        if self._table[i] == (((h >> 40) & 0xFFFF) or 1):
            self._table[i] = 0
            return True
        return False


def _key(node: Any) -> Any:
    # What a ghost remembers a node by: (namespace, key), a block's and a disk
    # entry's alike. By the bare key, one tenant's saves could read another's
    # evictions through admission (a guessed key RESERVED or NOT_ADMITTED).
    return node.where


class S3FIFOPolicy(EvictionPolicy):
    name = "s3fifo"
    # Probation's share of the evictable blocks, where it starts (the paper
    # fixes 10%; fixed shares of 0-20% and these steps were measured on the
    # policy benchmark's mixes, README "Eviction policies").
    SMALL_SHARE = 0.05
    MIN_SHARE, MAX_SHARE = 0.01, 0.9
    # ARC's adaptation of its target: a key probation let go came back (its
    # ghost hit): probation is too small, +GROW; a key main let go came back:
    # main is too small, -SHRINK_M; each block probation lets go unhit (what
    # it is for: scans, one-off tails), -SHRINK.
    GROW, SHRINK, SHRINK_M = 0.01, 0.001, 0.02
    # Ghost slots per evictable block in each of the two ghost tables (2 B
    # each): 2, so a conversation's next turn (tens of requests later, behind
    # scans) still finds its ghost.
    GHOST_SLOTS = 2
    # More fresh keys than this in one reserve make a cold run (see the
    # module docstring); 8, 16 and 32 measured alike on the policy benchmark.
    RUN = 16

    def __init__(self, key: Any = _key) -> None:
        self._small = FreeList()
        self._main = FreeList()
        self._cold = FreeList()
        self.ghost = Ghost()
        self.main_ghost = Ghost()
        self._key = key
        self._peak = 0
        self._count = 0   # blocks in the three queues (len() on every add)
        # Probation's share, adapted as ARC adapts its target: a ghost hit (a
        # block probation let go too early came back) grows it by GROW, a block
        # probation lets go unhit shrinks it by SHRINK, within [MIN, MAX].
        self.share = self.SMALL_SHARE

    def _list(self, block: Any) -> FreeList:
        q = block.pq & QUEUE
        if q == MAIN:
            return self._main
        return self._cold if block.pq & COLD else self._small

    def add(self, block: Any) -> None:
        if not block.pq & QUEUE:    # new: probation (or C), unless evicted lately
            q = SMALL
            h = key_hash(self._key(block))
            if self.ghost.take_hash(h):
                q = MAIN
                self.share = min(self.MAX_SHARE, self.share + self.GROW)
            elif self.main_ghost.take_hash(h):
                q = MAIN
                self.share = max(self.MIN_SHARE, self.share - self.SHRINK_M)
            # A warm run's blocks (admit_run) keep their frequency of 1 on probation.
            drop = QUEUE | COLD | FREQ if q == MAIN else QUEUE
            block.pq = (block.pq & ~drop) | q
        self._list(block).append(block)
        n = self._count = self._count + 1
        if n > self._peak:
            self._peak = n
            self.ghost.fit(n * self.GHOST_SLOTS)
            self.main_ghost.fit(n * self.GHOST_SLOTS)

    def remove(self, block: Any) -> None:
        self._list(block).remove(block)
        self._count -= 1

    def hit(self, block: Any) -> None:
        block.hits += 1
        if block.pq & COLD:        # not a one-off after all: to main
            self._cold.remove(block)
            block.pq = (block.pq & ~(COLD | QUEUE | FREQ)) | MAIN
            self._main.append(block)
        elif block.pq & FREQ < MAX_FREQ:
            block.pq += 1

    def reread(self, block: Any) -> None:
        """No frequency (EvictionPolicy.reread): a conversation's history
        re-read by its next turn is one client's correlated reference. Counted
        as hits, such reads pushed the 2-bit frequency of a long conversation's
        blocks to 3, which kept them through three passes of main after the
        conversation ended. A cold block read back is no one-off: to main,
        as hit() does."""
        if block.pq & COLD:
            self.hit(block)
        else:
            block.hits += 1
            if not block.pq & FREQ:
                block.pq += 1

    def hit_all(self, blocks: Sequence[Any], rereads: int = 0) -> None:
        """reread() the first `rereads`, hit() the rest, in one pass: a
        Match's hits (256 keys and more) cost a method call each otherwise.
        The same moves: a cold block goes to main (hit()), any other only
        counts."""
        for i, b in enumerate(blocks):
            pq = b.pq
            if pq & COLD:
                self.hit(b)
                continue
            b.hits += 1
            if (pq & FREQ < MAX_FREQ) if i >= rereads else not pq & FREQ:
                b.pq = pq + 1

    @staticmethod
    def _take_small(s: int, m: int, share: float) -> bool:
        return s > 0 and (m == 0 or s >= share * (s + m))

    def pop(self) -> Any:
        b = self._cold.popleft()
        if b is not None:
            self.ghost.put_hash(key_hash(self._key(b)))
            self._count -= 1
            return b
        small, main = self._small, self._main
        while True:
            s, m = len(small), len(main)
            if not s and not m:
                return None
            if self._take_small(s, m, self.share):
                b = small.popleft()
                if b.pq & FREQ:          # hit while on probation: keep it
                    b.pq = (b.pq & ~(QUEUE | FREQ)) | MAIN
                    main.append(b)
                    continue
                self.ghost.put_hash(key_hash(self._key(b)))
                self.share = max(self.MIN_SHARE, self.share - self.SHRINK)
                self._count -= 1
                return b
            b = main.popleft()
            if b.pq & FREQ:              # reinserted, one hit the poorer
                b.pq -= 1
                main.append(b)
                continue
            self.main_ghost.put_hash(key_hash(self._key(b)))
            self._count -= 1
            return b

    def demote(self, block: Any) -> None:
        """Into C, the cold FIFO evicted before anything else (a hit moves it
        to main, as it does a cold run's block), with no frequency left."""
        self._list(block).remove(block)
        block.pq = (block.pq & ~(QUEUE | FREQ)) | SMALL | COLD
        self._cold.append(block)

    def admits(self, node: Any, key: Any, hits: int) -> bool:
        if hits:
            return True
        h = key_hash(key)
        if self.ghost.take_hash(h):
            return True
        self.ghost.put_hash(h)
        return False

    def admit_run(self, keys: Sequence[Any], parent: Any, evicts: bool) -> str:
        ghost, main_ghost = self.ghost, self.main_ghost
        fresh = [h for h in map(key_hash, keys)
                 if not ghost.has_hash(h) and not main_ghost.has_hash(h)]
        # GONE (chains.py) has no pq: a save under a lost parent is filed
        # stranded, and goes first anyway.
        cold = len(fresh) > self.RUN or (parent is not None and parent is not GONE
                                         and parent.pq & COLD)
        if not cold:
            return WARM_RUN if self._continues(parent) else ADMIT
        if not evicts:
            return COLD_RUN
        for h in fresh:
            ghost.put_hash(h)
        return REFUSE

    @staticmethod
    def _continues(parent: Any) -> bool:
        """A run under a leaf that was just read for the first time: a
        conversation's next turn under the turn it read back (see the module
        docstring). A shared prefix has children already (the messages that
        followed it), and a shared document read again has been hit before."""
        return (parent is not None and parent is not GONE and parent.child is None
                and parent.hits == 1)

    def __len__(self) -> int:
        return self._count

    def __iter__(self) -> Iterator[Any]:
        """pop()'s order, simulated on copies (frequencies and queues as they
        would change); the ghost does not change the order."""
        yield from list(self._cold)
        small = [[b, b.pq & FREQ] for b in self._small]
        main = [[b, b.pq & FREQ] for b in self._main]
        si = mi = 0
        share = self.share
        while True:
            s, m = len(small) - si, len(main) - mi
            if not s and not m:
                return
            if self._take_small(s, m, share):
                b, f = small[si]
                si += 1
                if f:
                    main.append([b, 0])
                    continue
                share = max(self.MIN_SHARE, share - self.SHRINK)
                yield b
                continue
            entry = main[mi]
            mi += 1
            if entry[1]:
                main.append([entry[0], entry[1] - 1])
                continue
            yield entry[0]
