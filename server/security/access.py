"""Who may use the unix socket and map the arena: their mode and group.

The socket's permissions are the only credential a same-host client needs
(see auth.py), and whoever may connect may also map the arena for the
zero-copy path, so both files get the same group.
"""
from __future__ import annotations

import grp
import os
from typing import Optional

from ..config import ConfigError

KEY = "listen.socket_group"


def resolve_group(value: str, source: str = "default") -> Optional[int]:
    """The gid named by listen.socket_group ("" -> None). ConfigError if there is no such group."""
    if not value:
        return None
    if value.isdigit():
        gid = int(value)
    else:
        try:
            gid = grp.getgrnam(value).gr_gid
        except KeyError:
            raise ConfigError(f"{KEY} = {value!r} (from {source}): no such group on this host; "
                              "create it (e.g. systemd-sysusers) or name an existing one",
                              key=KEY, source=source) from None
    # Checked now, not when the socket exists: a failed chgrp then would leave a running server.
    if os.geteuid() != 0 and gid != os.getegid() and gid not in os.getgroups():
        raise ConfigError(f"{KEY} = {value!r} (from {source}): the daemon (uid {os.geteuid()}) "
                          f"is not a member of group {gid}, so it cannot give it the socket; "
                          "add the user to the group or run with it as a supplementary group",
                          key=KEY, source=source)
    return gid


def give_group(path: str, gid: Optional[int]) -> None:
    """chgrp `path` to `gid` (None: leave it). The daemon must own the file and, unless it
    is root, belong to the group; PermissionError otherwise."""
    if gid is not None:
        os.chown(path, -1, gid)
