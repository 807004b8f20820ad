"""MatchLane (client/match_lane.py) against scripted servers: where it gives way to
gRPC (None), and how an answer that never comes whole is the call's error."""
from __future__ import annotations

import socket
import struct
import threading
from typing import Any, Callable

import grpc
import pytest

import kvkeeper.client.match_lane as ml

from kvkeeper.client.errors import NotFoundError, from_rpc_error, is_session_lost
from kvkeeper.client.match_lane import (LEN, LaneError, MatchLane, answer_frame, lane_for,
                                        lane_path)


def serve(path: str, script: Callable[[socket.socket], None]) -> threading.Thread:
    """A one-connection server running `script` on its thread, which closes
    the listening socket when the script ends."""
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(path)
    srv.listen(1)

    def run() -> None:
        conn, _ = srv.accept()
        with conn:
            script(conn)
        srv.close()

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def read_request(conn: socket.socket) -> bytes:
    n = LEN.unpack(conn.recv(4, socket.MSG_WAITALL))[0]
    return conn.recv(n, socket.MSG_WAITALL)


def test_no_socket_gives_way_to_grpc_and_backs_off(path: str, clock: Any) -> None:
    lane = MatchLane(path, clock=clock)
    assert lane.call(b"req", 1.0) is None
    answers = [answer_frame(grpc.StatusCode.OK, b"resp")]
    serve(path, lambda c: (read_request(c), c.sendall(answers[0])))
    assert lane.call(b"req", 1.0) is None   # within the back-off: not even tried
    clock.now += 1.01
    assert lane.call(b"req", 1.0) == b"resp" and lane.calls == 1


def test_a_status_is_the_calls_error_as_grpcs_would_be(path: str) -> None:
    details = "unknown session 'x'; RegisterSession first"

    def script(c: socket.socket) -> None:
        assert read_request(c) == b"abc"
        c.sendall(answer_frame(grpc.StatusCode.NOT_FOUND, details.encode()))
        assert read_request(c) == b"again"   # the connection stays for the next call
        c.sendall(answer_frame(grpc.StatusCode.OK, b""))

    serve(path, script)
    lane = MatchLane(path)
    with pytest.raises(LaneError) as e:
        lane.call(b"abc", 2.0)
    assert e.value.code() == grpc.StatusCode.NOT_FOUND and is_session_lost(e.value)
    err = from_rpc_error(e.value, "Match")
    assert isinstance(err, NotFoundError) and "RegisterSession first" in str(err)
    assert lane.call(b"again", 2.0) == b"" and lane.calls == 1


@pytest.mark.parametrize("reply, code", [
    (b"", grpc.StatusCode.UNAVAILABLE),                  # closed after the request
    (LEN.pack(10) + b"\x00abc", grpc.StatusCode.UNAVAILABLE),   # closed mid-answer
    (None, grpc.StatusCode.DEADLINE_EXCEEDED),           # never answers
])
def test_an_answer_that_never_comes_whole_fails_the_call(path: str, reply: Any,
                                                         code: grpc.StatusCode) -> None:
    done = threading.Event()

    def script(c: socket.socket) -> None:
        read_request(c)
        if reply is None:
            done.wait(5)
        else:
            c.sendall(reply)

    server = serve(path, script)
    lane = MatchLane(path)
    try:
        with pytest.raises(LaneError) as e:
            lane.call(b"req", 0.2)
        assert e.value.code() == code
    finally:
        done.set()
        server.join(5)
    # The connection was dropped: a late answer is never read as the next call's.
    assert lane.call(b"req", 0.2) is None


def test_only_a_plain_unix_target_has_a_lane() -> None:
    assert lane_for("unix:/run/kvk.sock", None, None).path == lane_path("/run/kvk.sock")
    assert lane_for("127.0.0.1:7000", None, None) is None
    assert lane_for("unix:/run/kvk.sock", None, "a-token") is None
    assert lane_for("unix:/run/kvk.sock", object(), None) is None


class Interrupted(BaseException):
    """What a signal handler raising mid-call looks like (KeyboardInterrupt)."""


@pytest.mark.parametrize("where", ["send", "recv"])
def test_an_interrupted_call_drops_its_connection(path: str, where: str,
                                                  monkeypatch: Any) -> None:
    # The server answers each request on one connection, in order: a kept
    # connection would hand call 1's answer to call 2.
    def script(c: socket.socket) -> None:
        try:
            while True:
                c.sendall(answer_frame(grpc.StatusCode.OK, read_request(c)))
        except (OSError, struct.error):
            pass

    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(path)
    srv.listen(4)

    def run() -> None:
        while True:
            try:
                conn, _ = srv.accept()
            except OSError:
                return
            threading.Thread(target=lambda c=conn: (script(c), c.close()), daemon=True).start()

    threading.Thread(target=run, daemon=True).start()
    lane = MatchLane(path)
    try:
        assert lane.call(b"warm", 1.0) == b"warm"

        def interrupt(*a: Any) -> Any:
            if where == "send":
                a[0].send(a[1][:3])   # part of the frame goes out first
            raise Interrupted()
        if where == "send":
            monkeypatch.setattr(socket.socket, "sendall", interrupt)
        else:
            monkeypatch.setattr(ml, "_recv", interrupt)
        with pytest.raises(Interrupted):
            lane.call(b"call 1", 1.0)
        monkeypatch.undo()
        # Its own answer, on a new connection: the old one would have given
        # call 1's answer, or sent call 2's frame after call 1's first bytes.
        assert lane.call(b"call 2", 1.0) == b"call 2"
    finally:
        lane.close()
        srv.close()
