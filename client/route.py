"""Cache-aware routing from outside the engines (kvkeeper.v1.KVKeeperResidency).

* `keys_for_tokens`: a request's block keys from its token ids and its
  engines' namespace, computed exactly as the connector computes them: by
  client/keys.py, the one copy of the key code, which the connector uses.
  A router needs the namespace descriptor the engines registered (`kvkeeper
  ls` shows it) and, per request, what else the connector puts in the seed:
  cache salt, LoRA tag (media identities: requests with media are not
  reported by the connector, see connector/residency.py).
* `Router.locate`: per engine the prefix of the chain its own KV cache holds,
  and the prefix the daemon's tiers hold.
* `Router.watch`: the residency events as an iterator that reconnects and
  resumes after the last message it yielded: no event is lost or repeated
  across a reconnect, and a gap (the daemon's replay buffer no longer held
  them, or the daemon restarted) is yielded as a message with `gap` set.

Needs no session: a router is no engine.
"""
from __future__ import annotations

import time
from typing import Any, Iterator, List, Mapping, Optional, Sequence, Union

import grpc

from kvkeeper.v1 import kvkeeper_pb2 as pb
from kvkeeper.v1 import residency_pb2 as rpb
from kvkeeper.v1 import residency_pb2_grpc as rpb_grpc

from .auth import TLSLike, bearer_metadata, sync_channel
from .keys import NAMESPACE_FIELDS, chain_keys, namespace_seed
from .url import to_grpc_target

__all__ = ["EventStream", "Router", "keys_for_tokens", "namespace_fields"]

NamespaceLike = Union[pb.NamespaceDescriptor, Mapping[str, Any]]
# Codes after which the stream is opened again (the daemon restarting, a broken connection).
_RECONNECT = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED,
              grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL}


def namespace_fields(namespace: NamespaceLike) -> dict:
    """The descriptor's fields as the key seed reads them (keys.NAMESPACE_FIELDS)."""
    if isinstance(namespace, pb.NamespaceDescriptor):
        return {f: getattr(namespace, f) for f in NAMESPACE_FIELDS}
    unknown = set(namespace) - set(NAMESPACE_FIELDS)
    if unknown:
        raise ValueError(f"unknown namespace fields {sorted(unknown)}; known: "
                         f"{', '.join(NAMESPACE_FIELDS)}")
    return dict(namespace)


def keys_for_tokens(namespace: NamespaceLike, tokens: Sequence[int], *,
                    cache_salt: Optional[str] = None, lora: Optional[str] = None,
                    extra: Sequence[str] = ()) -> List[bytes]:
    """The keys of the full blocks of `tokens`, as the connector of an engine
    registered with `namespace` names them."""
    fields = namespace_fields(namespace)
    bt = int(fields.get("block_tokens") or 0)
    if bt <= 0:
        raise ValueError("the namespace's block_tokens must be positive")
    seed = namespace_seed(fields, cache_salt=cache_salt, lora=lora, extra=extra)
    return chain_keys(seed, [int(t) for t in tokens], bt)


def _descriptor(namespace: NamespaceLike) -> pb.NamespaceDescriptor:
    if isinstance(namespace, pb.NamespaceDescriptor):
        return namespace
    return pb.NamespaceDescriptor(**namespace_fields(namespace))


def _namespace_into(msg: Any, namespace: "NamespaceLike | bytes | None") -> None:
    if namespace is None:
        return
    if isinstance(namespace, (bytes, bytearray)):
        msg.namespace_id = bytes(namespace)
    else:
        msg.descriptor.CopyFrom(_descriptor(namespace))


class Router:
    """Blocking calls of the residency service over one channel."""

    def __init__(self, channel: grpc.Channel, *, timeout: float = 5.0,
                 metadata: Optional[Sequence[tuple[str, str]]] = None) -> None:
        self.channel = channel
        self.timeout = timeout
        self.metadata = tuple(metadata or ())
        self.stub = rpb_grpc.KVKeeperResidencyStub(channel)

    @classmethod
    def connect(cls, url: str, *, token: Optional[str] = None, tls: TLSLike = None,
                timeout: float = 5.0) -> "Router":
        channel = sync_channel(to_grpc_target(url), tls, [])
        return cls(channel, timeout=timeout, metadata=bearer_metadata(token))

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> "Router":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def locate(self, namespace: "NamespaceLike | bytes",
               keys: Sequence[bytes]) -> rpb.LocateResponse:
        """Where the chain `keys` is; `namespace`: a descriptor or a namespace id."""
        req = rpb.LocateRequest(keys=list(keys))
        _namespace_into(req, namespace)
        return self.stub.Locate(req, timeout=self.timeout, metadata=self.metadata)

    def locate_tokens(self, namespace: NamespaceLike, tokens: Sequence[int],
                      **seed: Any) -> rpb.LocateResponse:
        """locate() of the keys of `tokens` (seed: cache_salt, lora, extra)."""
        return self.locate(namespace, keys_for_tokens(namespace, tokens, **seed))

    def watch(self, namespace: "NamespaceLike | bytes | None" = None, *,
              epoch: str = "", after_seq: Optional[int] = None,
              reconnect_s: float = 0.2) -> "EventStream":
        """The residency events from now on (or, with after_seq, after that
        event of `epoch`), resumed after every reconnect."""
        return EventStream(self, namespace, epoch, after_seq, reconnect_s)


class EventStream:
    """An iterator of WatchEventsResponse that reopens its call after a
    transport failure, resuming after the last message it yielded. `epoch`
    and `last_seq` are where it stands (what a new EventStream resumes from);
    `reconnects` counts the calls it opened again."""

    def __init__(self, router: Router, namespace: "NamespaceLike | bytes | None", epoch: str,
                 after_seq: Optional[int], reconnect_s: float) -> None:
        self.router = router
        self.namespace = namespace
        self.epoch = epoch
        self.last_seq = after_seq or 0
        self._resume = after_seq is not None
        self.reconnect_s = reconnect_s
        self.reconnects = 0
        self._call: Any = None
        self._closed = False

    def _open(self) -> Any:
        req = rpb.WatchEventsRequest(resume=self._resume, epoch=self.epoch,
                                     after_seq=self.last_seq if self._resume else 0)
        _namespace_into(req, self.namespace)
        return self.router.stub.WatchEvents(req, metadata=self.router.metadata)

    def __iter__(self) -> Iterator[rpb.WatchEventsResponse]:
        while not self._closed:
            self._call = self._open()
            try:
                for msg in self._call:
                    self.epoch, self.last_seq = msg.epoch, msg.last_seq
                    self._resume = True   # from the first message on: resume after it
                    yield msg
                return
            except grpc.RpcError as e:
                if self._closed:
                    return
                if e.code() not in _RECONNECT:
                    raise
            self.reconnects += 1
            time.sleep(self.reconnect_s)

    def cancel(self) -> None:
        """Stop: the iteration ends (from another thread too)."""
        self._closed = True
        if self._call is not None:
            self._call.cancel()
