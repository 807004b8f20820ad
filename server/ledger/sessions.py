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

from ..errors import FailedPrecondition, NotFound
from ..ids import Identity, SessionId
from ..quoting import clip
from .records import Session

# How many ended sessions the owner can still be told about; older ones read as unknown.
ENDED_MEMORY = 65536

# Why a session ended: its client closed it, it missed its heartbeats, or the
# last call watching it ended without it being closed (the client is gone).
CLOSED, EXPIRED, DISCONNECTED = "closed", "expired", "disconnected"
END_REASONS: tuple[str, ...] = (CLOSED, EXPIRED, DISCONNECTED)


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

    def __init__(self) -> None:
        self.live: dict[SessionId, Session] = {}
        self._ended: OrderedDict[SessionId, Identity] = OrderedDict()
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

    def add(self, session: Session) -> None:
        self.live[session.id] = session

    def resolve(self, sid: SessionId, owner: Identity) -> Session:
        """The live session `sid` if `owner` registered it; NotFound otherwise."""
        session = self.live.get(sid)
        if session is not None and session.owner == owner:
            return session
        if session is None and self._ended.get(sid) == owner:
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
        self._ended[session.id] = session.owner
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
