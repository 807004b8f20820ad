"""kvkeeper.server.ops.startfaults: which start-up OSErrors are the configuration's
fault (a ConfigError naming the key and its value) and which stay runtime failures."""
from __future__ import annotations

import errno
import os
import socket

import pytest

from kvkeeper.server.config import ConfigError, load_config
from kvkeeper.server.ops.startfaults import (ADDRESS_ERRNOS, PATH_ERRNOS, bind_error, blame,
                                             fault, listen_failure)

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


def test_fault_is_the_error_blame_raises_and_none_where_blame_passes_it_on() -> None:
    taken = OSError(errno.EADDRINUSE, "Address already in use")
    out = fault(CONFIG, "metrics.address", "cannot do it", ADDRESS_ERRNOS, taken)
    assert isinstance(out, ConfigError)
    assert str(out) == str(_raise(taken, "metrics.address", ADDRESS_ERRNOS))
    assert fault(CONFIG, "metrics.address", "x", ADDRESS_ERRNOS, OSError(errno.EIO, "I/O")) is None
    elsewhere = FileNotFoundError(errno.ENOENT, "gone", "/srv/kv/disk2")
    assert fault(CONFIG, "disk_tier.path", "x", PATH_ERRNOS, elsewhere,
                 path="/srv/kv/disk") is None


def test_a_listen_address_taken_or_not_here_is_a_config_error_naming_listen_tcp() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        address = f"127.0.0.1:{taken.getsockname()[1]}"
        config = load_config(None, {}, {"listen.tcp": address})
        assert bind_error(address).errno == errno.EADDRINUSE
        out = listen_failure(config, "listen.tcp", address)
        assert isinstance(out, ConfigError) and out.key == "listen.tcp"
        assert f"listen.tcp = '{address}'" in str(out) and "Address already in use" in str(out)
    # Free again: gRPC failed for a reason of its own, which a restart may cure.
    assert bind_error(address) is None
    out = listen_failure(config, "listen.tcp", address)
    assert type(out) is RuntimeError and str(out) == f"could not listen on {address}"


def test_a_dns_outage_on_the_listen_address_stays_a_runtime_failure(monkeypatch) -> None:
    def outage(*args, **kw):
        raise socket.gaierror(socket.EAI_AGAIN, "Temporary failure in name resolution")

    monkeypatch.setattr(socket, "getaddrinfo", outage)
    config = load_config(None, {}, {"listen.tcp": "kv.example:50051"})
    out = listen_failure(config, "listen.tcp", "kv.example:50051")
    assert type(out) is RuntimeError and "Temporary failure" in str(out)
