"""Registering the servicer with the gRPC server, bulk messages by hand.

The generated add_KVKeeperServicer_to_server serializes every message with
protobuf; the two that carry block bytes instead go through
kvkeeper.client.wire (the same wire format, fewer copies): LoadStream's
handler yields frames it built from the arena in one copy, and WriteBlocks
reads each chunk's data as a view of the received message. The generated
table stays the one list of methods: only those two entries are changed.
"""
from __future__ import annotations

from typing import Any, Dict

import grpc

from kvkeeper.client.wire import parse_write_chunk
from kvkeeper.v1 import kvkeeper_pb2_grpc as pb_grpc

__all__ = ["add_servicer_to_server", "serialize_frame"]


def serialize_frame(msg: Any) -> bytes:
    """LoadStream's response serializer: frames (bytes) as they are, and
    protobuf messages (a subclass's handler may yield them) serialized."""
    return msg if type(msg) is bytes else msg.SerializeToString()


class _Capture:
    """Stands in for the server to take the generated method table."""

    service = ""
    handlers: Dict[str, grpc.RpcMethodHandler] = {}

    def add_generic_rpc_handlers(self, handlers: Any) -> None:
        pass

    def add_registered_method_handlers(self, service: str,
                                       handlers: Dict[str, grpc.RpcMethodHandler]) -> None:
        self.service, self.handlers = service, dict(handlers)


def add_servicer_to_server(servicer: Any, server: Any) -> None:
    """What kvkeeper_pb2_grpc.add_KVKeeperServicer_to_server does, with the
    hand-written (de)serializers of the bulk messages."""
    cap = _Capture()
    pb_grpc.add_KVKeeperServicer_to_server(servicer, cap)
    h = cap.handlers
    h["LoadStream"] = h["LoadStream"]._replace(response_serializer=serialize_frame)
    h["WriteBlocks"] = h["WriteBlocks"]._replace(request_deserializer=parse_write_chunk)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(cap.service, h),))
    server.add_registered_method_handlers(cap.service, h)
