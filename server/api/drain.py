"""The calls in flight, so that a stop can drain them before gRPC drops connections.

grpc.aio's `server.stop(grace)` destroys the server, and every connection with
it, the moment its last call completes. A call completes once its last bytes
are in the socket, not once the client has read them. A client that then sends
a frame (a flow-control window update, while it still reads the tail of a
LoadStream) gets EPIPE, and its transport fails the stream with messages it
had already received: UNAVAILABLE "Stream removed (sendmsg: Broken pipe)".

So the daemon drains calls itself: it refuses new ones (handler.py), waits for
those in flight, keeps the connections open for a short linger after the last
one ended so that clients read their tails, and only then stops the server.
All of it within the grace period.
"""
from __future__ import annotations

import asyncio
import math
import time

POLL_SECONDS = 0.01


class Calls:
    """Counts every call of the services (handler.py enters and leaves it)."""

    __slots__ = ("active", "last_end")

    def __init__(self) -> None:
        self.active = 0
        # When the most recent call ended (time.monotonic); -inf: none has yet.
        self.last_end = -math.inf

    def leave(self) -> None:
        self.active -= 1
        self.last_end = time.monotonic()

    async def settle(self, deadline: float, linger: float) -> None:
        """Return once no call is in flight and `linger` seconds have passed since
        the last one ended, or at `deadline` (time.monotonic), whichever comes first.
        Polled: a drain happens once, and a wake-up per call would cost every call."""
        while self.active > 0 and time.monotonic() < deadline:
            await asyncio.sleep(POLL_SECONDS)
        wait = min(deadline, self.last_end + linger) - time.monotonic()
        if wait > 0:
            await asyncio.sleep(wait)
