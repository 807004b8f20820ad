"""The GC lock: a lease naming the one daemon that garbage-collects a shared
directory.

One daemon at a time runs garbage collection, chosen by `GcLock`, a lease in
gc.lock/: each acquisition creates the next generation file with O_EXCL, so
of two daemons that both see the current lease expired exactly one creates
generation g+1, and a daemon with a stale view fails on EEXIST instead of
stealing a live lease (a takeover never replaces the holder's file in place).
O_EXCL create and rename are atomic on local filesystems and on NFSv3+/v4 and
CephFS. Expiry times compare the holder's clock with the reader's, so TTLs
must be generous against clock skew (tens of seconds against NTP's
milliseconds) and a holder renews well before expiry (e.g. every ttl/3); a
holder that cannot renew in time must stop collecting. Safety of leased blocks
never rests on the lock alone: pins protect them whoever collects.
"""
from __future__ import annotations

import os
import secrets
import threading
import time
from dataclasses import dataclass

from .errors import DiskIOError
from .fileio import CLOEXEC, unlink_quiet
from .layout import check_owner, tmp_path


@dataclass(frozen=True)
class LockHolder:
    owner: str
    expires_at: float     # wall clock of the holder; 0 once released
    token: str
    generation: int


class GcLock:
    """A lease naming the one daemon that garbage-collects the shared directory.

    gc.lock/ holds generation files <g:020d>, each "kvkgc1 <owner> <expires_at>
    <token>". The holder is the highest generation. To acquire, a daemon that
    sees no holder, an expired or released one, creates generation g+1 with
    O_EXCL: one winner per generation; losers (and daemons with a stale view
    of g) get EEXIST, and a winner checks afterwards that no newer generation
    exists. Generations only grow (the winner prunes all but the last few
    below it; the newest is never removed, only rewritten by its holder via
    rename), so a number is never reused. The holder renews by rewriting its
    own file, and checks it is still the newest. On NFS a directory listing
    may be cached: `holder` also probes g+1, g+2.. by name.
    """

    _MAGIC = "kvkgc1"
    _WRITE_GRACE_S = 60.0  # a file still empty after this long: its creator died mid-write
    _KEEP = 8              # generations kept below the newest: a stale creator hits EEXIST

    def __init__(self, dir_path: str, tmp_dir: str) -> None:
        self.dir = dir_path
        self.tmp_dir = tmp_dir
        self._held: dict[str, LockHolder] = {}
        self._mu = threading.Lock()

    def holder(self) -> LockHolder | None:
        """The newest generation's content (None if there is none)."""
        for _ in range(8):
            try:
                gens = [int(n) for n in os.listdir(self.dir) if len(n) == 20 and n.isdigit()]
            except FileNotFoundError:
                return None
            if not gens:
                return None
            g = max(gens)
            while os.path.exists(self._path(g + 1)):  # newer than a cached listing showed
                g += 1
            path = self._path(g)
            try:
                with open(path) as f:
                    text = f.read(512)
                mtime = os.stat(path).st_mtime
            except FileNotFoundError:
                continue  # superseded and removed meanwhile: list again
            parts = text.split()
            try:
                if len(parts) != 4 or parts[0] != self._MAGIC:
                    raise ValueError(text)
                return LockHolder(parts[1], float(parts[2]), parts[3], g)
            except ValueError:
                # Being written right now, or its creator died mid-write.
                return LockHolder("?", mtime + self._WRITE_GRACE_S, "", g)
        raise DiskIOError(f"gc lock in {self.dir} keeps changing; try again")

    def try_acquire(self, owner: str, ttl_s: float, now: float | None = None) -> bool:
        """Become the GC owner for ttl_s seconds if no one else holds a live lease."""
        check_owner(owner)
        now = time.time() if now is None else now
        with self._mu:
            cur = self.holder()
            mine = self._held.pop(owner, None)
            if (cur is not None and mine is not None and cur.token == mine.token
                    and now < mine.expires_at):
                self._held[owner] = mine
                return self._renew_locked(owner, ttl_s, now)
            if cur is not None and cur.expires_at > now and cur.owner != owner:
                return False
            # Free, expired, released, or our own (previous incarnation's) lease:
            # the next generation, never the current file in place.
            g = (cur.generation if cur is not None else 0) + 1
            token = secrets.token_hex(8)
            try:
                fd = os.open(self._path(g), os.O_WRONLY | os.O_CREAT | os.O_EXCL | CLOEXEC, 0o640)
            except FileExistsError:
                return False
            try:
                os.write(fd, self._content(owner, now + ttl_s, token).encode())
                os.fsync(fd)
            finally:
                os.close(fd)
            # A daemon whose view was generations behind may have created a
            # generation that the newest winner's pruning had removed: it is
            # not the newest, so it lost.
            cur = self.holder()
            if cur is None or cur.generation != g or cur.token != token:
                return False
            self._held[owner] = LockHolder(owner, now + ttl_s, token, g)
            for name in os.listdir(self.dir):
                if len(name) == 20 and name.isdigit() and int(name) < g - self._KEEP:
                    unlink_quiet(os.path.join(self.dir, name))
            return True

    def renew(self, owner: str, ttl_s: float, now: float | None = None) -> bool:
        """Extend our lease; False if it was lost (expired or taken over): stop collecting."""
        now = time.time() if now is None else now
        with self._mu:
            return self._renew_locked(owner, ttl_s, now)

    def _renew_locked(self, owner: str, ttl_s: float, now: float) -> bool:
        mine = self._held.get(owner)
        if mine is None:
            return False
        cur = self.holder()
        if now >= mine.expires_at or cur is None or cur.token != mine.token:
            del self._held[owner]
            return False
        self._rewrite(mine.generation, owner, now + ttl_s, mine.token)
        cur = self.holder()
        if cur is None or cur.generation != mine.generation:
            del self._held[owner]
            return False
        self._held[owner] = LockHolder(owner, now + ttl_s, mine.token, mine.generation)
        return True

    def release(self, owner: str) -> None:
        """Give the lease up (marks it released so another daemon takes it at once)."""
        with self._mu:
            mine = self._held.pop(owner, None)
            if mine is None:
                return
            cur = self.holder()
            if cur is not None and cur.token == mine.token:
                self._rewrite(mine.generation, owner, 0.0, mine.token)

    def _path(self, g: int) -> str:
        return os.path.join(self.dir, f"{g:020d}")

    def _content(self, owner: str, expires_at: float, token: str) -> str:
        return f"{self._MAGIC} {owner} {expires_at:.3f} {token}\n"

    def _rewrite(self, g: int, owner: str, expires_at: float, token: str) -> None:
        tmp = tmp_path(self.tmp_dir, owner, os.getpid())
        try:
            with open(tmp, "x") as f:
                f.write(self._content(owner, expires_at, token))
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self._path(g))
        except BaseException:
            unlink_quiet(tmp)
            raise
