"""Start-up failures that are the configuration's fault, as a ConfigError naming its key.

Why. `kvkeeper serve` exits 2 on a ConfigError and 1 on any other failure,
and the systemd unit restarts on 1 but not on 2 (RestartPreventExitStatus=2).
An OSError from creating the arena, opening the disk tier or binding the
metrics listener used to end in a traceback and status 1: a restart every
RestartSec, forever, for a mistake only an edit of the file can fix (a
host_tier.shm_dir that does not exist, a disk_tier.path that is a file, a
metrics port that is taken). So is a listen.tcp that is taken: gRPC says
only that it could not bind, so bind_error() asks the system why.

Only errors about what the key names are converted: for a path, the errno
must be one a wrong path gives and the error must name that path or a
directory above it; EMFILE, EIO and errors on files inside a directory (a
disk tier's blocks) stay runtime failures, which a restart may cure.
"""
from __future__ import annotations

import errno
import os
import socket
from contextlib import contextmanager
from typing import Any, Collection, Iterator, Optional

from ..config import Config, ConfigError

# A path that does not exist, is not a directory, is a file, or may not be written.
PATH_ERRNOS = frozenset({errno.ENOENT, errno.ENOTDIR, errno.EEXIST, errno.EISDIR, errno.EACCES,
                         errno.EPERM, errno.EROFS, errno.ELOOP, errno.ENAMETOOLONG})
# A size the filesystem (EFBIG, EINVAL) or the address space (ENOMEM: mmap) cannot take.
SIZE_ERRNOS = frozenset({errno.EFBIG, errno.EINVAL, errno.ENOMEM})
# An address taken, not on this host, or privileged; a host or port that does not
# resolve (socket.gaierror's EAI_* codes, negative: no clash with errno). Not
# EAI_AGAIN: the resolver failed for now (DNS not up yet at boot), a restart cures it.
ADDRESS_ERRNOS = frozenset({errno.EADDRINUSE, errno.EADDRNOTAVAIL, errno.EACCES,
                            socket.EAI_NONAME, socket.EAI_SERVICE, socket.EAI_FAMILY,
                            getattr(socket, "EAI_NODATA", socket.EAI_NONAME)})


def _value(config: Config, key: str) -> Any:
    section, name = key.split(".")
    return getattr(getattr(config, section), name)


def _names(filename: Any, path: str) -> bool:
    """Whether an error's filename is `path` or a directory above it."""
    if not isinstance(filename, str) or not filename:
        return False
    f, p = os.path.abspath(filename), os.path.abspath(path)
    return p == f or p.startswith(f.rstrip("/") + "/")


@contextmanager
def blame(config: Config, key: str, what: str, errnos: Collection[int],
          path: Optional[str] = None) -> Iterator[None]:
    """Turn an OSError of `errnos` (about `path`, when given) into a ConfigError
    for `key`, saying `what` failed; any other error passes unchanged."""
    try:
        yield
    except OSError as e:
        err = fault(config, key, what, errnos, e, path)
        if err is None:
            raise
        raise err from None


def fault(config: Config, key: str, what: str, errnos: Collection[int], e: OSError,
          path: Optional[str] = None) -> Optional[ConfigError]:
    """The ConfigError for `key` that `e` is (blame's), or None where it is
    not one of `errnos` (or not about `path`, when given)."""
    if e.errno not in errnos or (path is not None and not _names(e.filename, path)):
        return None
    source = config.source_of(key)
    return ConfigError(f"{key} = {_value(config, key)!r} (from {source}): {what}: "
                       f"{e.strerror or e}", key=key, source=source)


def bind_error(address: str) -> Optional[OSError]:
    """The OSError that binding `address` (host:port, as gRPC takes it) here
    gives, or None where it binds. gRPC says only that it failed to bind."""
    host, _, port = address.rpartition(":")
    try:
        infos = socket.getaddrinfo(host.strip("[]") or None, port, type=socket.SOCK_STREAM,
                                   flags=socket.AI_PASSIVE)
    except OSError as e:   # socket.gaierror: errno is an EAI_* code
        return e
    for family, kind, proto, _, sockaddr in infos:
        with socket.socket(family, kind, proto) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)   # as gRPC binds
            try:
                s.bind(sockaddr)
            except OSError as e:
                return e
    return None


def listen_failure(config: Config, key: str, address: str) -> Exception:
    """What to raise where gRPC could not listen on `address` (the value of
    `key`): a ConfigError when binding it fails with one of ADDRESS_ERRNOS (a
    port taken, an address not of this host, a name that does not resolve),
    a RuntimeError otherwise (a restart may cure it)."""
    err = bind_error(address)
    if err is not None:
        blamed = fault(config, key, "cannot listen there", ADDRESS_ERRNOS, err)
        if blamed is not None:
            return blamed
    return RuntimeError(f"could not listen on {address}" + (f": {err}" if err else ""))
