"""The peer socket's framing: JSON messages with file descriptors beside them.

Same-host engines hand the daemon their KV cache memory as file
descriptors, and get a peer's back, over a unix socket of their own (the
daemon's socket path plus PEER_SUFFIX): gRPC cannot carry descriptors, the
kernel can (SCM_RIGHTS). One message is a 4-byte little-endian length and
that many bytes of UTF-8 JSON (an object); its descriptors ride on the
sendmsg that carries the length, so the receiver gets them with the first
recvmsg of the message. At most MAX_FDS per message and MAX_MESSAGE_BYTES
of JSON: anything larger is a protocol error and ends the connection.

Requests name an "op" and the caller's "session" (its gRPC session id: the
capability, as on the main socket); answers carry "ok" and, when false,
"code" (ERR_INVALID, ERR_NOT_FOUND, ERR_UNAVAILABLE) and "error".
Both sides import only this module for the format.
"""
from __future__ import annotations

import array
import json
import os
import socket
import struct
from typing import Any, Dict, List, Sequence, Tuple

__all__ = ["ERR_INVALID", "ERR_NOT_FOUND", "ERR_UNAVAILABLE", "MAX_FDS", "MAX_MESSAGE_BYTES",
           "PEER_SUFFIX", "PeerProtocolError", "close_fds", "decode_body", "encode", "parse_head",
           "peer_socket_path", "recv_message", "send_message"]

PEER_SUFFIX = ".peer"
MAX_FDS = 4
MAX_MESSAGE_BYTES = 16 << 20
ERR_INVALID, ERR_NOT_FOUND, ERR_UNAVAILABLE = "invalid", "not_found", "unavailable"
_LEN = struct.Struct("<I")


class PeerProtocolError(ConnectionError):
    """The other side broke the framing (or went away mid-message)."""


def peer_socket_path(socket_path: str) -> str:
    """Where the daemon listening on `socket_path` takes peer handles."""
    return socket_path + PEER_SUFFIX


def encode(obj: Dict[str, Any]) -> bytes:
    body = json.dumps(obj, separators=(",", ":")).encode()
    if len(body) > MAX_MESSAGE_BYTES:
        raise ValueError(f"a peer message of {len(body)} bytes exceeds {MAX_MESSAGE_BYTES}")
    return _LEN.pack(len(body)) + body


def decode_body(body: bytes) -> Dict[str, Any]:
    try:
        obj = json.loads(body.decode())
    except (UnicodeDecodeError, ValueError) as e:
        raise PeerProtocolError(f"a peer message is not JSON: {e}") from None
    if not isinstance(obj, dict):
        raise PeerProtocolError("a peer message must be a JSON object")
    return obj


def parse_head(data: bytes, ancdata: Sequence[Tuple[int, int, bytes]], flags: int
               ) -> Tuple[int, List[int]]:
    """The length in a message's first bytes and the descriptors beside them."""
    fds: List[int] = []
    for level, kind, payload in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            a = array.array("i")
            a.frombytes(payload[:len(payload) - len(payload) % a.itemsize])
            fds.extend(a)
    if flags & socket.MSG_CTRUNC or len(fds) > MAX_FDS:
        close_fds(fds)
        raise PeerProtocolError(f"more than {MAX_FDS} descriptors in one peer message")
    if len(data) != _LEN.size:
        close_fds(fds)
        raise PeerProtocolError("the peer connection ended inside a message")
    (n,) = _LEN.unpack(data)
    if n > MAX_MESSAGE_BYTES:
        close_fds(fds)
        raise PeerProtocolError(f"a peer message of {n} bytes exceeds {MAX_MESSAGE_BYTES}")
    return n, fds


def close_fds(fds: Sequence[int]) -> None:
    """Close received descriptors nobody will use."""
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass


def send_message(sock: socket.socket, obj: Dict[str, Any], fds: Sequence[int] = ()) -> None:
    """Send one message on a blocking socket (descriptors are duplicated by the kernel)."""
    data = encode(obj)
    if len(fds) > MAX_FDS:
        raise ValueError(f"at most {MAX_FDS} descriptors per peer message")
    anc = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds).tobytes())] if fds else []
    sent = sock.sendmsg([data[:_LEN.size]], anc)
    if sent != _LEN.size:
        raise PeerProtocolError("the peer socket took a partial header")
    sock.sendall(data[_LEN.size:])


def recv_message(sock: socket.socket) -> Tuple[Dict[str, Any], List[int]]:
    """Receive one message on a blocking socket: (object, descriptors received,
    which the caller owns and must close)."""
    data, anc, flags, _ = sock.recvmsg(_LEN.size, socket.CMSG_SPACE(MAX_FDS * 4))
    if not data:
        raise PeerProtocolError("the peer connection was closed")
    if len(data) < _LEN.size:   # a header split across reads: rare, but legal
        data += _recv_exact(sock, _LEN.size - len(data))
    n, fds = parse_head(data, anc, flags)
    try:
        return decode_body(_recv_exact(sock, n)), fds
    except BaseException:
        close_fds(fds)
        raise


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise PeerProtocolError("the peer connection ended inside a message")
        buf += chunk
    return bytes(buf)
