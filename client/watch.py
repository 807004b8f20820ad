"""The session's watch: a WatchSession call held open while the session lives.

The daemon ends a session whose last watch ends from the client's side, so a
process that dies without closing its session (SIGKILL, a crash, vLLM
killing its engine right after SIGTERM) has its leases freed as soon as the
kernel closes its connection, not a lease TTL later. The call is a signal
only: the daemon sends one message when it holds the watch and one more if
the session ends; nothing waits for it.

The watch follows the session. When the call ends while the client is open
(the session was closed or expired, the daemon stopped, restarted or cannot
be reached), it is opened again for the session then current: at once after
registering again when the daemon lost the session, else after a backoff
(RETRY_MIN_S doubling to RETRY_MAX_S), so a daemon back from a restart gets
the session registered again within about RETRY_MAX_S of coming back. When
the daemon refused to register the session again (refusal.py), the watch
waits out that refusal's backoff instead: asking sooner is refused the same
way. A daemon without WatchSession (UNIMPLEMENTED) leaves the session to
heartbeats.
"""
from __future__ import annotations

import asyncio
import logging
from typing import Any

import grpc

from kvkeeper.v1 import kvkeeper_pb2 as pb

from .errors import is_session_lost

__all__ = ["hold_watch", "RETRY_MIN_S", "RETRY_MAX_S"]

log = logging.getLogger(__name__)

RETRY_MIN_S = 0.1
RETRY_MAX_S = 0.5


async def hold_watch(session: Any) -> None:
    """Keep a watch open on `session` (a session.Session) until it is closed.
    Never raises but CancelledError: failures are retried or logged."""
    delay = RETRY_MIN_S
    while not session.closed:
        sid = session.id
        lost = False
        try:
            call = session.stub.WatchSession(pb.WatchSessionRequest(session_id=sid),
                                             metadata=session.metadata)
            async for event in call:
                if event.ended == pb.SESSION_END_UNSPECIFIED:
                    delay = RETRY_MIN_S     # held: the daemon answers again
                else:
                    lost = True     # closed or expired: this id is done
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.UNIMPLEMENTED:
                log.info("kvkeeper: this daemon has no WatchSession; session %s lives by "
                         "heartbeats alone", sid)
                return
            lost = is_session_lost(e)
            log.debug("kvkeeper: watch of session %s ended: %s", sid, e.code())
        except Exception as e:  # noqa: BLE001 - e.g. the channel closing: try again unless closed
            log.debug("kvkeeper: watch of session %s failed: %s", sid, e)
        if session.closed:
            return
        if lost:
            try:
                await session.reregister(sid)
                continue
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 - heartbeats and calls try again too
                log.debug("kvkeeper: registering again from the watch failed: %s", e)
        await asyncio.sleep(max(delay, session.refusal.wait()))
        delay = min(RETRY_MAX_S, delay * 2)
