"""kvkeeper.server.security.access: the socket's group."""
from __future__ import annotations

import grp
import os

import pytest

from kvkeeper.server.security.access import give_group, resolve_group
from kvkeeper.server.config import ConfigError


def test_resolve_group() -> None:
    assert resolve_group("") is None
    assert resolve_group(str(os.getegid())) == os.getegid()
    name = grp.getgrgid(os.getegid()).gr_name
    assert resolve_group(name) == os.getegid()
    with pytest.raises(ConfigError) as info:
        resolve_group("no-such-group-kvk", "flag --set listen.socket_group")
    assert info.value.key == "listen.socket_group" and "no such group" in str(info.value)


def test_a_group_the_daemon_is_not_in(monkeypatch) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    monkeypatch.setattr(os, "getegid", lambda: 1000)
    monkeypatch.setattr(os, "getgroups", lambda: [1000, 1001])
    assert resolve_group("1001") == 1001
    with pytest.raises(ConfigError, match="not a member of group 1002"):
        resolve_group("1002")


def other_group() -> int:
    """A gid this process may chgrp to that is not its own; skip when there is none."""
    mine = os.getegid()
    if os.geteuid() == 0:
        return next((g.gr_gid for g in grp.getgrall() if g.gr_gid != mine), -1)
    return next((g for g in os.getgroups() if g != mine), -1)


def test_give_group(tmp_path) -> None:
    gid = other_group()
    if gid < 0:
        pytest.skip("no second group to hand files to")
    f = tmp_path / "f"
    f.write_text("")
    give_group(str(f), None)
    assert f.stat().st_gid == os.getegid()
    give_group(str(f), gid)
    assert f.stat().st_gid == gid
