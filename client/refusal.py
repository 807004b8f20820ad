"""The daemon's refusal to register a lost session again, remembered so calls fail fast.

When the daemon lost a session (it expired, or a reload of its tokens file
ended it), the next call, heartbeat or watch registers again (session.py).
The daemon may refuse that: PERMISSION_DENIED (the token no longer covers the
model), RESOURCE_EXHAUSTED (the identity holds ledger.max_sessions_per_identity
sessions) or UNAUTHENTICATED (the token was removed). Asked again at once it
refuses the same way, so without a memory every call made one more
RegisterSession (hundreds a second from a busy engine) and the watch one
twice a second, for as long as the refusal lasted.

So a refusal is kept with a not-before time, REFUSED_MIN_S doubling to
REFUSED_MAX_S while refusals go on; until then, a call that would register
again raises the same error without asking (so access granted back is seen
within the backoff, at most REFUSED_MAX_S). A registration that succeeds
forgets the refusal. connect()'s first registration never goes through here:
it raises what the daemon answered.
"""
from __future__ import annotations

import time
from typing import Callable, Optional

import grpc

from .errors import KVKeeperClientError

__all__ = ["Refusal", "REFUSED_CODES", "REFUSED_MIN_S", "REFUSED_MAX_S"]

# Answers that asking again right away would get again (not UNAVAILABLE: a
# daemon coming back up is retried by retry.py and the watch as before).
REFUSED_CODES = frozenset({grpc.StatusCode.PERMISSION_DENIED,
                           grpc.StatusCode.RESOURCE_EXHAUSTED,
                           grpc.StatusCode.UNAUTHENTICATED})
REFUSED_MIN_S = 1.0
REFUSED_MAX_S = 30.0


class Refusal:
    """The last refusal of a run of them, and when to ask again. Used under
    the session's registration lock (one event loop), so no locking here."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.error: Optional[KVKeeperClientError] = None
        self.count = 0              # refusals in a row; also tells waiters one came in
        self.not_before = 0.0       # clock() time
        self._clock = clock

    def wait(self) -> float:
        """Seconds until registering again may be asked (0: now)."""
        if self.error is None:
            return 0.0
        return max(0.0, self.not_before - self._clock())

    def holds(self) -> bool:
        """Whether a call must not ask now (check() would raise)."""
        return self.error is not None and self.wait() > 0

    def check(self) -> None:
        """Raise the remembered refusal while it holds."""
        if self.holds():
            raise self.replay()

    def replay(self) -> KVKeeperClientError:
        """A fresh copy of the remembered refusal: the same class, code and message."""
        assert self.error is not None
        err = self.error
        exc = type(err)(err.details, err.code)
        exc.__cause__ = err.__cause__   # the daemon's original status, for logs
        return exc

    def record(self, err: KVKeeperClientError) -> None:
        """Remember `err` if it is a refusal (REFUSED_CODES); other failures
        (the daemon down, a deadline) leave the state as it was."""
        if err.code not in REFUSED_CODES:
            return
        self.count += 1
        self.error = err
        backoff = min(REFUSED_MAX_S, REFUSED_MIN_S * 2 ** min(self.count - 1, 30))
        self.not_before = self._clock() + backoff

    def clear(self) -> bool:
        """Forget the refusal (a registration succeeded); whether there was one."""
        was = self.error is not None
        self.error, self.count, self.not_before = None, 0, 0.0
        return was
