"""The session table: session ids, who owns each, and how an id is answered.

A session id is a capability only together with the identity that registered
it. A live session asked for by another identity, a closed or expired one, and
an id nobody issued all get one answer, NotFound with one message shape, so
neither the code nor the text tells a caller which ids exist. Only the owner
presenting the exact id of a session it recently ended is told that it ended
(FailedPrecondition), since it already holds that id.

Log lines name a session by tag(): the issue counter, which is not secret and
useless without the random part of the id.

A session may also be watched: its client holds a call open (WatchSession)
for as long as it lives. A connection that is gone ends that call, and the
end of a session's last watch ends the session ("disconnected"), so a client
process killed outright frees its leases at once rather than a lease TTL
later. Sessions nobody watches end as before: closed, or expired.
"""
from __future__ import annotations

import secrets
from collections import Counter, OrderedDict
from dataclasses import dataclass
from typing import Callable, Optional

from ..errors import FailedPrecondition, NotFound, ResourceExhausted
from ..ids import Identity, SessionId
from ..quoting import clip
from .records import Session

# How many ended sessions the owner can still be told about; older ones read as unknown.
ENDED_MEMORY = 65536

# Why a session ended: its client closed it, it missed its heartbeats, the
# last call watching it ended without it being closed (the client is gone), or
# a reload took its model away from the token that registered it.
CLOSED, EXPIRED, DISCONNECTED, REVOKED = "closed", "expired", "disconnected", "revoked"
END_REASONS: tuple[str, ...] = (CLOSED, EXPIRED, DISCONNECTED, REVOKED)


class ForeignSession(NotFound):
    """A live session asked for by another identity. Its caller sees a plain
    NotFound (same text as an unknown id); the class lets the adapter log it."""


def tag(sid: str) -> str:
    """The non-secret part of a session id, for logs: 's1a' for '1a-<random>'."""
    head = sid.split("-", 1)[0]
    return "s" + (head if len(head) <= 12 and head.isalnum() else "?")


def _unknown(sid: str) -> str:
    return (f"unknown session {clip(sid)}: it expired, was closed or was never issued to this "
            "caller; call RegisterSession first")


@dataclass(eq=False)
class Watch:
    """One call watching `session`. `on_end(reason)` is called once if the
    session ends while the call is open (closed or expired): the caller ends
    the call. It must not raise."""

    session: Session
    on_end: Callable[[str], None]
    open: bool = True


class SessionTable:
    """Live sessions by id, plus a bounded memory of ended ones and their owners."""

    def __init__(self, max_per_owner: int = 0) -> None:
        self.live: dict[SessionId, Session] = {}
        # Live sessions per identity, and how many one may hold (0: no limit): an
        # engine that registers in a loop must not grow the daemon's books and the
        # metrics' engine labels without bound.
        self.per_owner: Counter[Identity] = Counter()
        self.max_per_owner = max_per_owner
        self._ended: OrderedDict[SessionId, tuple[Identity, str]] = OrderedDict()
        self._next = 1
        # Sessions ended, by reason (END_REASONS); read by the metrics collector.
        self.ends: Counter[str] = Counter({r: 0 for r in END_REASONS})

    @property
    def issued(self) -> int:
        return self._next - 1

    def new_id(self) -> SessionId:
        sid = SessionId(f"{self._next:x}-{secrets.token_hex(8)}")
        self._next += 1
        return sid

    def check_room(self, owner: Identity) -> None:
        """ResourceExhausted if `owner` may not register one more session."""
        n = self.per_owner[owner]
        if self.max_per_owner and n >= self.max_per_owner:
            raise ResourceExhausted(
                f"{clip(owner)} already holds {n} live sessions, the most one identity may "
                "(ledger.max_sessions_per_identity); close the sessions it no longer uses "
                "(CloseSession) or wait for them to expire, or raise the limit")

    def add(self, session: Session) -> None:
        """A new live session; its owner's room was checked first (check_room)."""
        self.live[session.id] = session
        self.per_owner[session.owner] += 1

    def resolve(self, sid: SessionId, owner: Identity) -> Session:
        """The live session `sid` if `owner` registered it; NotFound otherwise."""
        session = self.live.get(sid)
        if session is not None and session.owner == owner:
            return session
        ended = self._ended.get(sid) if session is None else None
        if ended is not None and ended[0] == owner:
            if ended[1] == REVOKED:
                # "session ... expired": the proto's wording, so clients register again.
                raise FailedPrecondition(
                    f"session {clip(sid)} expired early: it was revoked, the daemon's tokens "
                    "file was reloaded and this token no longer covers its model; its leases "
                    "and reservations were released; register with a token that covers it")
            raise FailedPrecondition(
                f"session {clip(sid)} expired or was closed; its leases and reservations were "
                "released; call RegisterSession again")
        if session is not None:
            raise ForeignSession(_unknown(sid))
        raise NotFound(_unknown(sid))

    def forget(self, session: Session, reason: str) -> None:
        """`session` ended (its leases and reservations are already released):
        count it and end the calls watching it."""
        del self.live[session.id]
        left = self.per_owner[session.owner] = self.per_owner[session.owner] - 1
        if not left:
            del self.per_owner[session.owner]
        self._ended[session.id] = (session.owner, reason)
        while len(self._ended) > ENDED_MEMORY:
            self._ended.popitem(last=False)
        self.ends[reason] += 1
        watches, session.watches = session.watches, []
        for w in watches:
            w.open = False
            w.on_end(reason)

    def watch(self, session: Session, on_end: Callable[[str], None]) -> Watch:
        w = Watch(session, on_end)
        session.watches.append(w)
        return w

    def unwatch(self, w: Watch) -> Optional[Session]:
        """The call of `w` ended. Returns its session if that was the session's
        last watch and the session is still live: the client is gone, and the
        caller ends the session. A watch already ended with its session, or
        unwatched before, changes nothing."""
        if not w.open:
            return None
        w.open = False
        session = w.session
        session.watches.remove(w)
        if session.watches or self.live.get(session.id) is not session:
            return None
        return session
