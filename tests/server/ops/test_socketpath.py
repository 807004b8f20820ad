"""Taking over the daemon's socket path: a stale socket yes, anything live or foreign no."""
from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest

from kvkeeper.server.ops.socketpath import claim_socket_path


def test_a_missing_path_is_free(tmp_path: Path) -> None:
    claim_socket_path(str(tmp_path / "k.sock"))
    assert not (tmp_path / "k.sock").exists()


def test_a_stale_socket_of_a_dead_daemon_is_removed(tmp_path: Path) -> None:
    path = str(tmp_path / "k.sock")
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(path)
    s.close()                                      # bound, never listening: nobody answers
    claim_socket_path(path)
    assert not os.path.lexists(path)


def test_a_live_daemons_socket_is_refused_and_kept(tmp_path: Path) -> None:
    path = str(tmp_path / "k.sock")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.bind(path)
        s.listen(1)
        with pytest.raises(RuntimeError, match="another daemon is listening"):
            claim_socket_path(path)
        assert os.path.exists(path)


def test_a_file_that_is_not_a_socket_is_refused_and_kept(tmp_path: Path) -> None:
    path = tmp_path / "k.sock"
    path.write_text("not mine")
    with pytest.raises(RuntimeError, match="not a socket"):
        claim_socket_path(str(path))
    assert path.read_text() == "not mine"
