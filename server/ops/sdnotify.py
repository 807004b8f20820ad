"""sd_notify(3) in a few lines of Python: tell systemd (Type=notify) how the daemon is doing.

systemd hands a `Type=notify` service the address of a datagram socket in
$NOTIFY_SOCKET; the service sends newline-separated assignments to it:

    READY=1        start-up is finished (listeners bound, tiers ready)
    STOPPING=1     shutdown has begun
    STATUS=...     one line of free text shown by `systemctl status`
    EXTEND_TIMEOUT_USEC=N  a long start-up is still going: N more us (systemd 236+)

The address is a filesystem path ("/run/systemd/notify") or, when it starts
with "@", a name in the abstract namespace (the "@" stands for a leading NUL
byte). Without $NOTIFY_SOCKET (not started by systemd, or another Type=) every
call is a no-op, so the daemon calls `notify` unconditionally.

A failed notification is logged and never raised: the daemon serves either
way, and systemd acts on a missing READY=1 by its own start timeout.
"""
from __future__ import annotations

import logging
import os
import socket
import time
from typing import Callable, Mapping, Optional

log = logging.getLogger("kvkeeper")

ENV = "NOTIFY_SOCKET"
# A datagram to systemd's socket is delivered at once or not at all; don't hang shutdown on it.
SEND_TIMEOUT_S = 2.0


def notify_address(env: Optional[Mapping[str, str]] = None) -> Optional[str]:
    """The socket address named by $NOTIFY_SOCKET ("\\0name" for "@name"), or None."""
    value = (os.environ if env is None else env).get(ENV, "")
    if not value:
        return None
    if value[0] == "@":
        return "\0" + value[1:]
    if value[0] == "/":
        return value
    # systemd >= 254 also knows "vsock:CID:PORT" (virtual machines); a daemon on
    # the host never gets one, so it is ignored rather than half-supported.
    log.warning("sd_notify: ignoring unsupported %s=%r", ENV, value)
    return None


def notify(state: str, env: Optional[Mapping[str, str]] = None) -> bool:
    """Send `state` (e.g. "READY=1\\nSTATUS=serving") to $NOTIFY_SOCKET.

    Returns True when a datagram was sent, False when there is no socket to
    send to or sending failed (logged at WARNING)."""
    address = notify_address(env)
    if address is None:
        return False
    data = state.encode("utf-8")
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            sock.settimeout(SEND_TIMEOUT_S)
            sock.connect(address)
            sock.sendall(data)
    except OSError as exc:
        log.warning("sd_notify: could not send %r to %s: %s", state.split("\n", 1)[0],
                    address.replace("\0", "@"), exc)
        return False
    return True


# A long start-up step (prefaulting a large arena: ~0.4 s per GiB) pushes
# systemd's start timeout (the unit's TimeoutStartSec=60) this far ahead every
# START_NOTE_EVERY_S, so it is not killed before READY=1.
START_EXTEND_S = 30.0
START_NOTE_EVERY_S = 5.0


def start_progress(what: str, total: int,
                   clock: Callable[[], float] = time.monotonic,
                   send: Optional[Callable[[str], bool]] = None) -> Callable[[int], None]:
    """A progress(done) callback for a start-up step of `total` bytes: at
    most every START_NOTE_EVERY_S, EXTEND_TIMEOUT_USEC and a STATUS line
    saying how far `what` got."""
    last = [clock()]
    out = send or notify

    def progress(done: int) -> None:
        now = clock()
        if now - last[0] >= START_NOTE_EVERY_S:
            last[0] = now
            out(f"EXTEND_TIMEOUT_USEC={int(START_EXTEND_S * 1e6)}\n"
                f"STATUS={what}: {done / 2**30:.1f} of {total / 2**30:.1f} GiB")
    return progress
