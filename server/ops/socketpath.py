"""The daemon's Unix socket path: take it over from a dead daemon, never from a live one."""
from __future__ import annotations

import os
import socket
import stat


def claim_socket_path(path: str) -> None:
    """Remove a stale socket left by a dead daemon; refuse to steal a live one."""
    if not os.path.lexists(path):
        return
    if not stat.S_ISSOCK(os.lstat(path).st_mode):
        raise RuntimeError(f"{path} exists and is not a socket; remove it or choose another --socket")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(path)
    except (ConnectionRefusedError, FileNotFoundError):
        os.unlink(path)
        return
    finally:
        probe.close()
    raise RuntimeError(f"another daemon is listening on {path}; stop it or choose another --socket")
