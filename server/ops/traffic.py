"""Recording the daemon's traffic as a policy-bench trace (pure: lines in, lines out).

`[ledger] traffic_file` turns it on (ops/traffic_file.py writes the lines),
so an operator can replay their own traffic through every eviction policy
and the offline optimum: `kvkeeper bench policy --trace FILE`. A line is one
request in the trace format of server/bench/policy_trace.py:

    {"keys": [hex, ...], "prompt_blocks": N, "last_turn": true, "ns": "<namespace>"}

* keys: what a Match looked up (its prompt's blocks), then the keys saved
  after them that continue the same chain (the answer's decode blocks, later
  prefill steps). A save is joined to a request by chain, never by timing: a
  ReserveSave whose parent is a request's last key, or that holds it, extends
  that request by the keys after it. Saves inside a prompt (the blocks the
  Match missed) add nothing: the replay saves what a lookup missed itself.
  A request whose chain a later Match continues (a conversation's next turn)
  is extended no more, so the next turn's saves are never its previous
  turn's.
* prompt_blocks: how many keys the Match looked up.
* last_turn: the request's lease was released with last_turn.
* ns: the namespace, which a replay folds into the keys (namespaces that
  share no block stay apart there too).

A request is written once no call touched it for `idle_s` (its saves and its
release follow its Match within seconds), or when the requests still
open hold more than `open_bytes` of keys (the oldest first: keys are held
until written, 32 B a key),
always in the order of the Matches, which is the order a replay looks them
up. After `limit` requests recording stops: a setting left on cannot fill a
disk. Keys are the connector's chained digests, never tokens; `ns` is a
digest too.
"""
from __future__ import annotations

import json
from typing import Callable, Optional, Sequence

from ..ids import SessionId

IDLE_S = 120.0
# Open requests hold their keys (32 B a key of 32 B), at most this many bytes
# of them: 64 MiB is 8192 open requests of 256 keys.
OPEN_BYTES = 64 << 20


class Request:
    """One recorded request while it is open: its keys joined in one bytes
    (half the memory of a list of them; every key has the daemon's key_bytes)."""

    __slots__ = ("ns", "data", "width", "prompt", "touched", "last_turn", "lease")

    def __init__(self, ns: str, keys: Sequence[bytes], touched: float, lease: int) -> None:
        self.ns = ns
        self.data = b"".join(keys)
        self.width = len(keys[0])
        self.prompt = len(keys)
        self.touched = touched
        self.last_turn = False
        self.lease = lease

    @property
    def last(self) -> bytes:
        return self.data[-self.width:]

    def line(self) -> str:
        h, w = self.data.hex(), 2 * self.width
        d: dict[str, object] = {"keys": [h[i:i + w] for i in range(0, len(h), w)],
                                "prompt_blocks": self.prompt}
        if self.last_turn:
            d["last_turn"] = True
        d["ns"] = self.ns
        return json.dumps(d, separators=(",", ":"))


class TrafficRecorder:
    """Match, ReserveSave and Release as the servicer sees them, in; trace lines out (take)."""

    def __init__(self, namespace_of: Callable[[SessionId], Optional[str]], limit: int,
                 idle_s: float = IDLE_S, open_bytes: int = OPEN_BYTES) -> None:
        self.namespace_of = namespace_of
        self.limit = limit
        self.idle_s = idle_s
        self.open_bytes = open_bytes
        self.held = 0               # bytes of keys the open requests hold
        self.requests = 0           # recorded so far (written or open)
        self.written = 0
        self._seq = 0
        self._open: dict[int, Request] = {}                 # by Match order
        self._ends: dict[tuple[str, bytes], Request] = {}   # (ns, its last key) -> request
        self._leases: dict[int, Request] = {}
        self._ready: list[str] = []

    @property
    def finished(self) -> bool:
        """`limit` requests recorded and all of them written."""
        return self.requests >= self.limit and not self._open

    def match(self, sid: SessionId, keys: Sequence[bytes], lease_id: Optional[int],
              now: float) -> None:
        ns = self.namespace_of(sid) if keys and self.requests < self.limit else None
        if ns is None:
            return
        self.requests += 1
        r = Request(ns, keys, now, lease_id or 0)
        self.held += len(r.data)
        ends = self._ends
        for k in keys[:-1]:
            # A request whose chain this prompt continues (a conversation's
            # previous turn) is extended no more: a save under its last key is
            # now this request's (the missed blocks of its prompt).
            ends.pop((ns, k), None)
        self._seq += 1
        self._open[self._seq] = r
        ends[(ns, r.last)] = r
        if r.lease:
            self._leases[r.lease] = r
        self._close(now)

    def saved(self, sid: SessionId, keys: Sequence[bytes], parent: Optional[bytes],
              now: float) -> None:
        """A ReserveSave of `keys` under `parent` (None: not named), kept or
        refused: what the client asked to save, which a replay saves again."""
        ns = self.namespace_of(sid) if keys and self._ends else None
        if ns is None:   # nothing open, or a session the ledger does not know (refused)
            return
        ends = self._ends
        r = ends.get((ns, parent)) if parent else None
        start = 0
        if r is None:   # a save that holds a request's last key and goes on past it
            for i in range(len(keys) - 1):
                r = ends.get((ns, keys[i]))
                if r is not None:
                    start = i + 1
                    break
        if r is None or any(len(k) != r.width for k in keys[start:]):
            return   # nobody's, or keys the ledger refused (key_bytes is one for all)
        del ends[(ns, r.last)]
        more = b"".join(keys[start:])
        r.data += more
        self.held += len(more)
        r.touched = now
        ends[(ns, r.last)] = r

    def released(self, lease_id: int, last_turn: bool, now: float) -> None:
        r = self._leases.pop(lease_id, None)
        if r is not None:
            r.last_turn = r.last_turn or last_turn
            r.touched = now

    def take(self, now: float) -> list[str]:
        """The lines of the requests closed by `now`, in Match order."""
        self._close(now)
        out, self._ready = self._ready, []
        return out

    def drain(self) -> list[str]:
        """Every request's line, open ones too (the daemon stops)."""
        while self._open:
            self._write(next(iter(self._open)))
        out, self._ready = self._ready, []
        return out

    def _close(self, now: float) -> None:
        opened = self._open
        while opened:
            seq = next(iter(opened))
            if self.held <= self.open_bytes and now - opened[seq].touched < self.idle_s:
                return
            self._write(seq)

    def _write(self, seq: int) -> None:
        r = self._open.pop(seq)
        self.held -= len(r.data)
        end = (r.ns, r.last)
        if self._ends.get(end) is r:
            del self._ends[end]
        if r.lease and self._leases.get(r.lease) is r:
            del self._leases[r.lease]
        self._ready.append(r.line())
        self.written += 1


class NoTraffic:
    """What the servicer calls when nothing records (the default): nothing."""

    def match(self, sid: SessionId, keys: Sequence[bytes], lease_id: Optional[int],
              now: float) -> None:
        pass

    def saved(self, sid: SessionId, keys: Sequence[bytes], parent: Optional[bytes],
              now: float) -> None:
        pass

    def released(self, lease_id: int, last_turn: bool, now: float) -> None:
        pass


NO_TRAFFIC = NoTraffic()
