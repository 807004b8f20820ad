"""WatchSession's asyncio side: a session's watch held open as one gRPC call.

What a watch means (the last one to end ends its session; a session that
ends ends its watches) is the ledger's (ledger/sessions.py). Here a watch is
a call: its end, however it comes (the client cancelled it, its process
died, its connection broke, the daemon answered), is the call's done
callback, which tells the ledger. A call has no other way to learn that its
client is gone: grpc.aio cancels the handler and runs the callbacks.
"""
from __future__ import annotations

import asyncio
import logging
from typing import Any, AsyncIterator, Callable

from kvkeeper.v1 import kvkeeper_pb2 as pb

from ..errors import PermissionDenied, Unavailable
from ..ids import Identity, SessionId
from ..ledger import Ledger
from ..ledger.sessions import CLOSED, EXPIRED, REVOKED, Watch, tag

log = logging.getLogger("kvkeeper.api")

END_TO_PB = {CLOSED: pb.SESSION_END_CLOSED, EXPIRED: pb.SESSION_END_EXPIRED}
# Not a way for a session to end: the daemon stops, and its ledger with it.
_STOPPING = "stopping"


class Watches:
    """The open WatchSession calls of one servicer."""

    def __init__(self, ledger: Ledger, clock: Callable[[], float]) -> None:
        self.ledger = ledger
        self.clock = clock
        self._open: dict[Watch, Callable[[str], None]] = {}
        # False once the daemon stops: the calls it ends then end no session.
        self.ending_sessions = True

    def __len__(self) -> int:
        return len(self._open)

    async def hold(self, sid: SessionId, owner: Identity, context: Any) -> AsyncIterator[Any]:
        """The call's messages: one at once, one more if the session ends."""
        ended: asyncio.Future[str] = asyncio.get_running_loop().create_future()

        def end(reason: str) -> None:
            if not ended.done():
                ended.set_result(reason)

        w = self.ledger.watch(sid, self.clock(), owner, end)
        # No await since watch(): the call cannot have ended before its callback is in.
        self._open[w] = end
        context.add_done_callback(lambda _: self._done(w))
        yield pb.SessionEvent()
        reason = await ended
        if reason == _STOPPING:
            raise Unavailable("the daemon is shutting down; register again with the "
                              "restarted daemon")
        if reason == REVOKED:   # no SessionEnd value for it: an older client knows the code
            raise PermissionDenied("the session was ended: the daemon's tokens file was "
                                   "reloaded and this token no longer covers its model")
        yield pb.SessionEvent(ended=END_TO_PB[reason])

    def _done(self, w: Watch) -> None:
        self._open.pop(w, None)
        if self.ending_sessions and self.ledger.unwatch(w):
            log.info("session end %s reason=disconnected", tag(w.session.id))

    def end_all(self) -> None:
        """The daemon stops: answer every open call UNAVAILABLE now, so that none
        holds the shutdown's grace period, and end no session for them."""
        self.ending_sessions = False
        for end in list(self._open.values()):
            end(_STOPPING)
