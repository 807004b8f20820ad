"""What a configuration is: the typed sections, their keys' kinds, defaults and limits.

Each key is a dataclass field whose metadata says its kind (parsers.convert reads it),
its help text and its limits; SCHEMA is that table, by section and key.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass, field, fields
from typing import Any, Mapping, Optional

from kvkeeper.client.arena_format import HEADER_BYTES, PAGE_ALIGN

from ..ids import HOST
from ..ledger.ledger import LedgerConfig
from ..ledger.policy import DEFAULT_POLICY, POLICIES
from ..ledger.tier import TierSpec
from .parsers import GiB, KiB, MiB

# Bytes at the start of the host segment kept for its header; the rest holds pages.
HOST_HEADER_BYTES = HEADER_BYTES
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
LOG_FORMATS = ("text", "json")


class ConfigError(ValueError):
    """A configuration value is wrong. `key` is "section.key" (None when not about one key),
    `source` says where the value came from."""

    def __init__(self, message: str, key: Optional[str] = None, source: Optional[str] = None):
        super().__init__(message)
        self.key = key
        self.source = source


def _opt(default: Any, kind: str, help: str, **extra: Any) -> Any:
    return field(default=default, metadata={"kind": kind, "help": help, **extra})


# --------------------------------------------------------------------------- sections
@dataclass(frozen=True)
class ListenSection:
    socket: str = _opt("./kvkeeper.sock", "path",
                       "unix socket path, resolved against the working directory; \"\" disables")
    tcp: str = _opt("127.0.0.1:50051", "address", "TCP \"host:port\" for gRPC; \"\" disables")
    socket_mode: int = _opt(0o660, "mode", "permission bits of the unix socket")
    socket_group: str = _opt("", "group", "group (name or gid) given the unix socket and the "
                             "arena, so its members may connect and map; \"\" keeps the daemon's")


@dataclass(frozen=True)
class MetricsSection:
    address: str = _opt("127.0.0.1:9464", "address",
                        "Prometheus \"host:port\" (/metrics); \"\" disables")


@dataclass(frozen=True)
class HostTierSection:
    capacity_bytes: int = _opt(1 * GiB, "size",
                               "size of the shared-memory segment, header included", min=1)
    page_bytes: int = _opt(64 * KiB, "size", "page size, a positive multiple of 4096",
                           min=PAGE_ALIGN)
    shm_dir: str = _opt("/dev/shm", "dir", "directory that holds the segment")
    name: str = _opt("", "shm_name", "segment file name; \"\" means kvkeeper-<pid>")
    prefault: bool = _opt(True, "bool", "allocate and map every page of the segment at start-up "
                          "(~0.4 s per GiB): a too small shm_dir fails the start instead of "
                          "killing a later writer with SIGBUS, and no load or save takes a "
                          "page fault; false: pages are taken as blocks first fill them")

    def segment_name(self, pid: Optional[int] = None) -> str:
        """The segment's file name: `name`, or kvkeeper-<pid> when it is empty."""
        return self.name or f"kvkeeper-{os.getpid() if pid is None else pid}"


@dataclass(frozen=True)
class DiskTierSection:
    path: str = _opt("", "path", "directory of the disk tier (local or a shared mount); \"\" disables")
    capacity_bytes: int = _opt(0, "size", "bytes the disk tier may use; 0 means 90% of the "
                               "filesystem's free space at start-up", min=0)
    write_policy: str = _opt("write-through", "choice",
                             "write-through: a save is acknowledged once on disk; write-back: "
                             "acknowledged in the arena, flushed in the background",
                             choices=("write-back", "write-through"))
    admit_after_hits: int = _opt(0, "int", "write a block to disk only once it was hit this "
                                 "many times (0: every block)", min=0, max=1 << 20)
    owner_id: str = _opt("", "shm_name", "this daemon's name in a shared directory (pins, GC "
                         "lock); \"\" means <hostname>-<pid>")
    shared_capacity_bytes: int = _opt(0, "size", "a directory several daemons share: its GC "
                                      "owner keeps all their block files within this, deleting "
                                      "the least recently used; 0: off", min=0)


@dataclass(frozen=True)
class LedgerSection:
    eviction_policy: str = _opt(DEFAULT_POLICY, "choice", "eviction order of unreferenced blocks",
                                choices=tuple(sorted(POLICIES)))
    key_bytes: int = _opt(32, "int", "length of every block key", min=8, max=1024)
    max_keys_per_call: int = _opt(4096, "int", "most keys one RPC may carry",
                                  min=1, max=1 << 20)
    lease_ttl_seconds: float = _opt(30.0, "duration",
                                    "a session without a call for this long expires", min_excl=0)
    reservation_timeout_seconds: float = _opt(60.0, "duration",
                                              "an uncommitted save is aborted after this",
                                              min_excl=0)
    event_buffer_keys: int = _opt(1 << 18, "int", "keys of residency events kept for "
                                  "WatchEvents resumes (older ones are reported as a gap)",
                                  min=1, max=1 << 26)
    max_sessions_per_identity: int = _opt(4096, "int", "live sessions one identity (a token, "
                                          "the unix socket, ...) may hold; 0: no limit",
                                          min=0, max=1 << 24)
    traffic_file: str = _opt("", "path", "append each request (the keys its lookup asked and "
                             "the saves that continued them) to this file, JSON lines that "
                             "`kvkeeper bench policy --trace FILE` replays through every eviction "
                             "policy and the offline optimum; \"\" records nothing")
    traffic_requests: int = _opt(100000, "int", "requests traffic_file records, then it stops "
                                 "(a request of n blocks takes about 70n bytes)",
                                 min=1, max=1 << 40)


@dataclass(frozen=True)
class ServerSection:
    grace_seconds: float = _opt(5.0, "duration", "how long shutdown waits for RPCs in flight",
                                min=0)
    max_message_bytes: int = _opt(64 * MiB, "size", "largest gRPC message, either direction",
                                  min=64 * KiB, max=(1 << 31) - 1)
    log_level: str = _opt("info", "choice", "logging level", choices=LOG_LEVELS,
                          aliases={"warn": "warning", "fatal": "critical"})
    log_format: str = _opt("text", "choice", "text: one human line per event; json: one JSON "
                           "object per line (ts, level, logger, msg, extra fields)",
                           choices=LOG_FORMATS)
    eviction_storm_blocks: int = _opt(10000, "int", "capacity evictions within 10 s that are "
                                      "logged as an eviction storm; 0 disables", min=0)
    gc_freeze_interval_seconds: float = _opt(
        1.0, "duration", "how often the daemon collects the objects created since the last "
        "time and freezes them (gc.freeze), so that no garbage collection walks the resident "
        "blocks; 0 leaves Python's garbage collector as it is", min=0, max=3600)


@dataclass(frozen=True)
class AdminSection:
    enabled: bool = _opt(True, "bool", "serve kvkeeper.v1.KVKeeperAdmin (ls, inspect, evict, "
                         "drain, verify) on the listeners")


@dataclass(frozen=True)
class AuthSection:
    tokens_file: str = _opt("", "path", "TOML file of bearer tokens (tenants, their models, "
                            "admin) and per-namespace quotas; \"\" disables tokens")
    allow_insecure_tcp: bool = _opt(False, "bool", "let listen.tcp bind a non-loopback address "
                                    "with neither tokens nor mutual TLS (only behind a "
                                    "firewall or a container network you trust)")
    require_token_on_socket: bool = _opt(False, "bool", "unix-socket callers must send a bearer "
                                         "token too (needs auth.tokens_file): for hosts where "
                                         "the socket's group is wider than one trust domain")


@dataclass(frozen=True)
class TlsSection:
    cert_file: str = _opt("", "path", "PEM certificate chain of the TCP listener; \"\": plain TCP")
    key_file: str = _opt("", "path", "PEM private key of cert_file")
    client_ca_file: str = _opt("", "path", "PEM CA bundle: TCP clients must present a "
                               "certificate it signed (mutual TLS); \"\": not asked")


@dataclass(frozen=True)
class ClusterTierSection:
    url: str = _opt("", "cluster_url", "a Redis/Valkey server (redis://host:port, rediss:// for "
                    "TLS) or cluster (redis+cluster://host:port,host:port) shared by the daemons "
                    "of many hosts, below the host and disk tiers; \"\" disables")
    key_prefix: str = _opt("kvk:", "key_prefix", "what every block's Redis key starts with "
                           "(the daemons that share blocks use the same)")
    write_policy: str = _opt("write-through", "choice",
                             "write-through: a save is acknowledged once sent to the cluster "
                             "(or dropped there); write-back: acknowledged in the arena, "
                             "sent in the background", choices=("write-back", "write-through"))
    admit_after_hits: int = _opt(0, "int", "send a block to the cluster only once it was hit "
                                 "this many times (0: every block)", min=0, max=1 << 20)
    timeout_seconds: float = _opt(1.0, "duration", "the most one cluster call may take; past it "
                                  "the call is a miss (or a dropped write)", min_excl=0, max=60)
    max_keys_per_call: int = _opt(256, "int", "keys a chain probe asks the cluster about in "
                                  "one pipelined round trip", min=1, max=1 << 16)
    max_connections: int = _opt(32, "int", "connections to each cluster node", min=1, max=4096)
    username: str = _opt("", "text", "ACL user; \"\" is the default user")
    password_file: str = _opt("", "path", "file holding the password (first line); \"\": none")
    ca_file: str = _opt("", "path", "PEM CA bundle that signed the cluster's certificates "
                        "(rediss://); \"\": the system's")
    cert_file: str = _opt("", "path", "PEM client certificate, for a cluster that asks for one")
    key_file: str = _opt("", "path", "PEM private key of cert_file")


@dataclass(frozen=True)
class Config:
    listen: ListenSection = field(default_factory=ListenSection)
    metrics: MetricsSection = field(default_factory=MetricsSection)
    host_tier: HostTierSection = field(default_factory=HostTierSection)
    disk_tier: DiskTierSection = field(default_factory=DiskTierSection)
    ledger: LedgerSection = field(default_factory=LedgerSection)
    server: ServerSection = field(default_factory=ServerSection)
    admin: AdminSection = field(default_factory=AdminSection)
    auth: AuthSection = field(default_factory=AuthSection)
    tls: TlsSection = field(default_factory=TlsSection)
    cluster_tier: ClusterTierSection = field(default_factory=ClusterTierSection)
    # "section.key" -> where the value came from ("default", "environment variable ...").
    sources: Mapping[str, str] = field(default_factory=dict, compare=False, repr=False)

    def to_ledger_config(self) -> LedgerConfig:
        ht, lg = self.host_tier, self.ledger
        return LedgerConfig(
            tiers=[TierSpec(name=HOST, capacity_bytes=ht.capacity_bytes - HOST_HEADER_BYTES,
                            page_bytes=ht.page_bytes)],
            policy=lg.eviction_policy,
            key_bytes=lg.key_bytes,
            max_keys_per_call=lg.max_keys_per_call,
            lease_ttl_s=lg.lease_ttl_seconds,
            reservation_timeout_s=lg.reservation_timeout_seconds,
            event_buffer_keys=lg.event_buffer_keys,
            first_lease_id=lease_id_epoch(),
            max_sessions_per_identity=lg.max_sessions_per_identity,
        )

    def as_dict(self) -> dict[str, dict[str, Any]]:
        """{section: {key: value}} with plain values (socket_mode is an int)."""
        return {s: {k: getattr(getattr(self, s), k) for k in keys}
                for s, keys in SCHEMA.items()}

    def source_of(self, key: str) -> str:
        return self.sources.get(key, "default")


SECTIONS: dict[str, type] = {f.name: f.default_factory for f in fields(Config)  # type: ignore
                             if f.name != "sources"}
SCHEMA: dict[str, dict[str, Any]] = {s: {f.name: f for f in fields(cls)}
                                     for s, cls in SECTIONS.items()}


def lease_id_epoch() -> int:
    """The first lease id of a daemon starting now: milliseconds since 1970
    times 2^20, above every id of an earlier run (unless it issued over 2^20
    leases a millisecond) and below 2^63 until the year 2248. Clients
    release leases by id alone: a stale release (sent before a restart,
    retried after) must find no lease of the new run rather than free one."""
    return int(time.time() * 1000) << 20
