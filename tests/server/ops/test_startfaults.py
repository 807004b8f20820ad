"""kvkeeper.server.ops.startfaults: which start-up OSErrors are the configuration's
fault (a ConfigError naming the key and its value) and which stay runtime failures."""
from __future__ import annotations

import errno
import os
import socket

import pytest

from kvkeeper.server.config import ConfigError, load_config
from kvkeeper.server.ops.startfaults import ADDRESS_ERRNOS, PATH_ERRNOS, blame

CONFIG = load_config(None, {}, {"disk_tier.path": "/srv/kv/disk",
                                "metrics.address": "example.invalid:9464"})


def _raise(e: BaseException, key: str, errnos, path=None) -> BaseException:
    with pytest.raises(BaseException) as info:
        with blame(CONFIG, key, "cannot do it", errnos, path=path):
            raise e
    return info.value


def test_an_error_about_the_path_or_a_directory_above_it_is_a_config_error() -> None:
    for name in ("/srv/kv/disk", "/srv/kv", "/srv/kv/disk/"):
        e = _raise(FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), name),
                   "disk_tier.path", PATH_ERRNOS, path="/srv/kv/disk")
        assert isinstance(e, ConfigError) and e.key == "disk_tier.path"
        assert str(e) == (f"disk_tier.path = '/srv/kv/disk' (from "
                          f"{CONFIG.source_of('disk_tier.path')}): cannot do it: "
                          "No such file or directory")


def test_errors_about_other_files_or_of_other_kinds_pass_unchanged() -> None:
    inside = FileNotFoundError(errno.ENOENT, "gone", "/srv/kv/disk/blocks/00/ab")  # a race
    neighbour = FileNotFoundError(errno.ENOENT, "gone", "/srv/kv/disk2")
    io = OSError(errno.EIO, "I/O error", "/srv/kv/disk")
    for e in (inside, neighbour, io):
        assert _raise(e, "disk_tier.path", PATH_ERRNOS, path="/srv/kv/disk") is e
    assert _raise(ValueError("x"), "disk_tier.path", PATH_ERRNOS).__class__ is ValueError


def test_addresses_taken_or_unresolvable_are_config_errors_but_not_a_dns_outage() -> None:
    for e in (OSError(errno.EADDRINUSE, "Address already in use"),
              socket.gaierror(socket.EAI_NONAME, "Name or service not known")):
        out = _raise(e, "metrics.address", ADDRESS_ERRNOS)
        assert isinstance(out, ConfigError) and out.key == "metrics.address"
        assert "'example.invalid:9464'" in str(out)
    later = socket.gaierror(socket.EAI_AGAIN, "Temporary failure in name resolution")
    assert _raise(later, "metrics.address", ADDRESS_ERRNOS) is later
