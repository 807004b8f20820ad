"""The daemon's configuration: typed sections, where each value comes from, and validation.

Precedence, lowest first (a later source overrides an earlier one, key by key):

1. defaults   -- the field defaults of the dataclasses below;
2. TOML file  -- ``--config PATH``, or the file named by ``KVKEEPER_CONFIG`` when
   ``--config`` is absent; one table per section::

       [host_tier]
       capacity_bytes = "8GiB"

3. environment -- ``KVKEEPER_<SECTION>_<KEY>``, upper-case, e.g.
   ``KVKEEPER_HOST_TIER_CAPACITY_BYTES=8GiB`` or ``KVKEEPER_LISTEN_TCP=""``;
4. command-line flags -- ``kvkeeper serve --capacity 8GiB`` (and ``--set section.key=value``).

Value syntax:

* sizes: an integer number of bytes, or a string with a unit: ``"64KiB"``, ``"512MiB"``,
  ``"1.5GiB"``, ``"2TiB"``. Units are case-insensitive and *all binary* (powers of 1024):
  ``K``/``KB``/``KiB`` = 1024, ``M``/``MB``/``MiB`` = 1024**2, ``G``/``GB``/``GiB`` = 1024**3,
  ``T``/``TB``/``TiB`` = 1024**4; ``B`` or no unit = bytes. A fraction must come out to a
  whole number of bytes.
* durations: a number of seconds (``30``, ``0.5``), or a string with units ``ms``, ``s``,
  ``m``, ``h``: ``"30s"``, ``"2m"``, ``"1m30s"``, ``"250ms"``.
* addresses: ``"host:port"`` (``"[::1]:50051"`` for IPv6); ``""`` disables that listener.
* ``listen.socket_mode``: an integer (write ``0o660`` in TOML) or an octal string ``"0660"``.
* ``listen.socket``: relative paths are resolved against the working directory when the
  configuration is loaded; ``""`` disables the unix socket. So are ``auth.tokens_file`` and the
  ``tls.*`` files.
* booleans: ``true``/``false`` in TOML; ``true``/``false``/``1``/``0``/``yes``/``no`` in the
  environment and flags.

The file is strict about types (``key_bytes = "32"`` is an error); environment variables and
flags are text, so there ``"32"`` is read as an integer. Environment variables whose name starts
with a known section prefix (``KVKEEPER_LISTEN_`` ...) but names no key are an error; other
``KVKEEPER_*`` variables (``KVKEEPER_CONFIG``, ``KVKEEPER_URL``, the client's own) are ignored.

Every mistake raises ConfigError naming the key, where its value came from, and what is wrong.
"""
from __future__ import annotations

import difflib
import json
import os
import re
import sys
from dataclasses import dataclass, field, fields, replace
from fractions import Fraction
from typing import Any, Mapping, Optional

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

from .ids import HOST
from .ledger.ledger import LedgerConfig
from .ledger.policy import POLICIES
from .ledger.tier import TierSpec

ENV_PREFIX = "KVKEEPER_"
CONFIG_ENV = "KVKEEPER_CONFIG"
# Bytes at the start of the host segment kept for its header; the rest holds pages.
HOST_HEADER_BYTES = 4096
PAGE_ALIGN = 4096
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
LOG_FORMATS = ("text", "json")

KiB = 1024
MiB = 1024 * KiB
GiB = 1024 * MiB
TiB = 1024 * GiB


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


@dataclass(frozen=True)
class LedgerSection:
    eviction_policy: str = _opt("lru", "choice", "eviction order of unreferenced blocks",
                                choices=tuple(sorted(POLICIES)))
    key_bytes: int = _opt(32, "int", "length of every block key", min=8, max=1024)
    max_keys_per_call: int = _opt(4096, "int", "most keys one RPC may carry",
                                  min=1, max=1 << 20)
    lease_ttl_seconds: float = _opt(30.0, "duration",
                                    "a session without a call for this long expires", min_excl=0)
    reservation_timeout_seconds: float = _opt(60.0, "duration",
                                              "an uncommitted save is aborted after this",
                                              min_excl=0)


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

# Dedicated `kvkeeper serve` flags; cli.py builds its parser from this table.
CLI_FLAGS: dict[str, str] = {
    "listen.socket": "--socket",
    "listen.tcp": "--tcp",
    "metrics.address": "--metrics",
    "host_tier.capacity_bytes": "--capacity",
    "host_tier.page_bytes": "--page-size",
    "disk_tier.path": "--disk-path",
    "disk_tier.capacity_bytes": "--disk-capacity",
    "ledger.eviction_policy": "--policy",
    "server.log_level": "--log-level",
    "server.log_format": "--log-format",
}


def env_var(key: str) -> str:
    """The environment variable for "section.key": host_tier.capacity_bytes ->
    KVKEEPER_HOST_TIER_CAPACITY_BYTES."""
    return ENV_PREFIX + key.replace(".", "_").upper()


def describe_precedence() -> str:
    """The sources of configuration values, lowest precedence first, as text."""
    return "\n".join([
        "Configuration precedence (later overrides earlier, key by key):",
        "  1. defaults",
        f"  2. TOML file: --config PATH, else ${CONFIG_ENV}",
        "  3. environment: KVKEEPER_<SECTION>_<KEY>, e.g. "
        f"{env_var('host_tier.capacity_bytes')}=8GiB",
        "  4. command-line flags: " + ", ".join(sorted(CLI_FLAGS.values())) +
        ", --set SECTION.KEY=VALUE",
        "Sizes take binary units (64KiB, 512MiB, 1G = 1GiB); durations take seconds or "
        "30s, 2m, 1m30s, 250ms.",
    ])


# --------------------------------------------------------------------------- value parsing
_SIZE_UNITS = {"": 1, "b": 1,
               "k": KiB, "kb": KiB, "kib": KiB,
               "m": MiB, "mb": MiB, "mib": MiB,
               "g": GiB, "gb": GiB, "gib": GiB,
               "t": TiB, "tb": TiB, "tib": TiB}
_SIZE_RE = re.compile(r"^\s*(\d[\d_]*(?:\.\d+)?|\.\d+)\s*([A-Za-z]*)\s*$")
_NUM_RE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*$")
_DUR_PART_RE = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*(ms|s|m|h)", re.IGNORECASE)
_DUR_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}
_SHM_NAME_RE = re.compile(r"^[A-Za-z0-9._-]{1,200}$")
_GROUP_RE = re.compile(r"^([A-Za-z_][A-Za-z0-9._-]{0,31}\$?|\d+)$")
_TRUE = ("true", "1", "yes", "on")
_FALSE = ("false", "0", "no", "off")


def _type_name(v: Any) -> str:
    return {bool: "boolean", int: "integer", float: "float", str: "string", dict: "table",
            list: "array"}.get(type(v), type(v).__name__)


def parse_size(value: Any) -> int:
    """Bytes from an int or a string like "64KiB", "1.5GiB", "1G" (binary units). ValueError."""
    if isinstance(value, bool):
        raise ValueError("expected a size (bytes, or a string like \"512MiB\"), got a boolean")
    if isinstance(value, int):
        return value
    if isinstance(value, float):
        if not value.is_integer():
            raise ValueError(f"{value} is not a whole number of bytes")
        return int(value)
    if not isinstance(value, str):
        raise ValueError(f"expected a size (bytes, or a string like \"512MiB\"), "
                         f"got {_type_name(value)}")
    m = _SIZE_RE.match(value)
    if not m:
        raise ValueError(f"{value!r} is not a size; write bytes or a number with a unit, "
                         "e.g. \"65536\", \"64KiB\", \"512MiB\", \"1GiB\"")
    unit = m.group(2).lower()
    if unit not in _SIZE_UNITS:
        raise ValueError(f"unknown size unit {m.group(2)!r} in {value!r}; use B, KiB, MiB, GiB "
                         "or TiB (K/KB, M/MB, G/GB, T/TB mean the same binary units)")
    n = Fraction(m.group(1).replace("_", "")) * _SIZE_UNITS[unit]
    if n.denominator != 1:
        raise ValueError(f"{value!r} is not a whole number of bytes")
    return int(n)


def parse_duration(value: Any) -> float:
    """Seconds from a number or a string like "30s", "2m", "1m30s", "250ms". ValueError."""
    if isinstance(value, bool):
        raise ValueError("expected a duration (seconds, or a string like \"30s\"), got a boolean")
    if isinstance(value, (int, float)):
        seconds = float(value)
    elif isinstance(value, str):
        if _NUM_RE.match(value):
            seconds = float(value)
        else:
            pos, seconds, text = 0, 0.0, value.rstrip()
            for m in _DUR_PART_RE.finditer(text):
                if m.start() != pos:
                    break
                seconds += float(m.group(1)) * _DUR_UNITS[m.group(2).lower()]
                pos = m.end()
            if pos != len(text) or pos == 0:
                raise ValueError(f"{value!r} is not a duration; write seconds or a number with "
                                 "a unit, e.g. \"30\", \"30s\", \"2m\", \"1m30s\", \"250ms\"")
    else:
        raise ValueError(f"expected a duration (seconds, or a string like \"30s\"), "
                         f"got {_type_name(value)}")
    if seconds != seconds or seconds in (float("inf"), float("-inf")):
        raise ValueError(f"{value!r} is not a finite duration")
    return seconds


def parse_address(value: str) -> tuple[str, int]:
    """("host", port) from "host:port" or "[v6]:port". ValueError."""
    host, sep, port = value.rpartition(":")
    if not sep or not host:
        raise ValueError(f"{value!r} is not \"host:port\" (e.g. \"127.0.0.1:50051\", "
                         "\"[::1]:50051\"); use \"\" to disable")
    if host.startswith("["):
        if not host.endswith("]") or len(host) < 3:
            raise ValueError(f"{value!r}: an IPv6 host needs brackets, e.g. \"[::1]:50051\"")
    elif ":" in host or "]" in host:
        raise ValueError(f"{value!r}: write an IPv6 host in brackets, e.g. \"[::1]:50051\"")
    if not port.isdigit():
        raise ValueError(f"{value!r}: port {port!r} is not a number")
    if not 0 <= int(port) <= 65535:
        raise ValueError(f"{value!r}: port {port} is outside 0..65535")
    return host, int(port)


def _parse_int(value: Any, text: bool) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, str)) or \
            (isinstance(value, str) and not text):
        raise ValueError(f"expected an integer, got {_type_name(value)}")
    if isinstance(value, str):
        try:
            return int(value.strip())
        except ValueError:
            raise ValueError(f"{value!r} is not an integer") from None
    return value


def _parse_bool(value: Any, text: bool) -> bool:
    if isinstance(value, bool):
        return value
    if text and isinstance(value, str):
        v = value.strip().lower()
        if v in _TRUE:
            return True
        if v in _FALSE:
            return False
        raise ValueError(f"{value!r} is not a boolean; write true or false")
    raise ValueError(f"expected a boolean (true or false), got {_type_name(value)}")


def _parse_mode(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise ValueError(f"expected permission bits (0o660 or \"0660\"), got {_type_name(value)}")
    if isinstance(value, str):
        s = value.strip().lower()
        s = s[2:] if s.startswith("0o") else s
        if not s or any(c not in "01234567" for c in s):
            raise ValueError(f"{value!r} is not an octal mode like \"0660\"")
        value = int(s, 8)
    elif value > 0o777:
        raise ValueError(f"{value} (octal {value:o}) is above 0o777; in TOML write an octal "
                         "integer (0o660) or a string (\"0660\"), not 660")
    if not 0 <= value <= 0o777:
        raise ValueError(f"mode {value:o} is outside 0..0777")
    return value


def _convert(f: Any, raw: Any, text: bool) -> Any:
    """Convert one raw value for field `f`; `text` is True for env/flag sources. ValueError."""
    meta = f.metadata
    kind = meta["kind"]
    if kind in ("path", "address", "dir", "shm_name", "choice", "group"):
        if not isinstance(raw, str):
            raise ValueError(f"expected a string, got {_type_name(raw)}")
        value: Any = raw
        if kind == "address" and value:
            parse_address(value)
        elif kind == "dir" and not value:
            raise ValueError("must not be empty")
        elif kind == "shm_name" and value and not _SHM_NAME_RE.match(value):
            raise ValueError(f"{value!r} is not a segment name: use 1-200 of A-Z a-z 0-9 . _ -")
        elif kind == "group" and value and not _GROUP_RE.match(value):
            raise ValueError(f"{value!r} is not a group name or a numeric gid")
        elif kind == "choice":
            value = value.strip().lower()
            value = meta.get("aliases", {}).get(value, value)
            if value not in meta["choices"]:
                hint = difflib.get_close_matches(value, meta["choices"], n=1)
                raise ValueError(f"unknown value {raw!r}; choose one of "
                                 f"{', '.join(meta['choices'])}"
                                 + (f"; did you mean {hint[0]!r}?" if hint else ""))
    elif kind == "size":
        if isinstance(raw, str) and not raw.strip():
            raise ValueError("empty size")
        value = parse_size(raw)
    elif kind == "duration":
        value = parse_duration(raw)
    elif kind == "int":
        value = _parse_int(raw, text)
    elif kind == "mode":
        value = _parse_mode(raw)
    elif kind == "bool":
        value = _parse_bool(raw, text)
    else:  # pragma: no cover
        raise AssertionError(kind)
    if kind in ("size", "duration", "int"):
        lo, hi, lo_excl = meta.get("min"), meta.get("max"), meta.get("min_excl")
        show = _show_size if kind == "size" else str
        if lo is not None and value < lo:
            raise ValueError(f"{show(value)} is below the minimum {show(lo)}")
        if lo_excl is not None and value <= lo_excl:
            raise ValueError(f"must be greater than {lo_excl}, got {value:g}")
        if hi is not None and value > hi:
            raise ValueError(f"{show(value)} is above the maximum {show(hi)}")
    return value


def _show_size(n: int) -> str:
    for unit, size in (("TiB", TiB), ("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if n >= size and n % size == 0:
            return f"{n // size}{unit}"
    return f"{n} B"


# --------------------------------------------------------------------------- loading
def _suggest(word: str, options: list[str]) -> str:
    hit = difflib.get_close_matches(word, options, n=1, cutoff=0.6)
    return f"; did you mean {hit[0]!r}?" if hit else ""


class _Builder:
    """Collects raw values with their sources, then converts and validates them."""

    def __init__(self) -> None:
        self.values: dict[str, dict[str, Any]] = {s: {} for s in SCHEMA}
        self.sources: dict[str, str] = {}

    def set(self, key: str, raw: Any, source: str, text: bool) -> None:
        section, _, name = key.partition(".")
        f = SCHEMA[section][name]
        try:
            value = _convert(f, raw, text)
        except ValueError as e:
            raise ConfigError(f"{key} = {_show_raw(raw)} (from {source}): {e}",
                              key=key, source=source) from None
        self.values[section][name] = value
        self.sources[key] = source

    def source(self, key: str) -> str:
        return self.sources.get(key, "default")

    def fail(self, key: str, problem: str, value: Any) -> ConfigError:
        src = self.source(key)
        return ConfigError(f"{key} = {_show_raw(value)} (from {src}): {problem}",
                           key=key, source=src)


def _show_raw(raw: Any) -> str:
    return json.dumps(raw) if isinstance(raw, str) else repr(raw)


def _check_key(section: str, name: str, where: str) -> str:
    """'section.key', or ConfigError for an unknown section/key."""
    if section not in SCHEMA:
        owners = [s for s, keys in SCHEMA.items() if section in keys]
        hint = (f"; {section!r} is a key of [{owners[0]}]" if owners
                else _suggest(section, list(SCHEMA)))
        raise ConfigError(f"unknown section {section!r} (from {where}); sections are "
                          f"{', '.join(SCHEMA)}{hint}", key=section, source=where)
    if name not in SCHEMA[section]:
        owners = [s for s, keys in SCHEMA.items() if name in keys and s != section]
        hint = (f"; {name!r} belongs to [{owners[0]}]" if owners
                else _suggest(name, list(SCHEMA[section])))
        raise ConfigError(f"unknown key {name!r} in section [{section}] (from {where}); "
                          f"keys of [{section}] are {', '.join(SCHEMA[section])}{hint}",
                          key=f"{section}.{name}", source=where)
    return f"{section}.{name}"


def _read_file(path: str, named_by: str) -> dict[str, Any]:
    where = f"config file {path}" + (f" (named by {named_by})" if named_by else "")
    try:
        with open(path, "rb") as fh:
            return tomllib.load(fh)
    except FileNotFoundError:
        raise ConfigError(f"{where}: no such file", source=where) from None
    except IsADirectoryError:
        raise ConfigError(f"{where}: is a directory, not a TOML file", source=where) from None
    except OSError as e:
        raise ConfigError(f"{where}: cannot read it: {e.strerror or e}", source=where) from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{where}: not valid TOML: {e}", source=where) from None


def _env_keys(env: Mapping[str, str]) -> list[tuple[str, str, str]]:
    """(section.key, variable, value) for every KVKEEPER_<SECTION>_* variable."""
    out = []
    by_len = sorted(SCHEMA, key=len, reverse=True)
    for var in sorted(env):
        if not var.startswith(ENV_PREFIX):
            continue
        rest = var[len(ENV_PREFIX):]
        for section in by_len:
            head = section.upper() + "_"
            if rest.startswith(head):
                name = rest[len(head):].lower()
                if name not in SCHEMA[section]:
                    known = [env_var(f"{section}.{k}") for k in SCHEMA[section]]
                    raise ConfigError(
                        f"unknown key {name!r} in section [{section}] (from environment "
                        f"variable {var}); known: {', '.join(known)}{_suggest(var, known)}",
                        key=f"{section}.{name}", source=f"environment variable {var}")
                out.append((f"{section}.{name}", var, env[var]))
                break
    return out


def load_config(path: Optional[str] = None,
                env: Optional[Mapping[str, str]] = None,
                overrides: Optional[Mapping[str, Any]] = None,
                *,
                override_sources: Optional[Mapping[str, str]] = None,
                cwd: Optional[str] = None) -> Config:
    """Build the effective Config: defaults < TOML file < environment < overrides.

    path: the TOML file (--config); when None, env[KVKEEPER_CONFIG] if set and non-empty.
    env: the environment (None: os.environ).
    overrides: {"section.key": value} (command-line flags; a None value means "not given");
      strings are parsed like environment values, typed values are taken as they are.
    override_sources: {"section.key": label} for error messages; by default the flag from
      CLI_FLAGS ("flag --capacity") or "override section.key".
    cwd: the directory relative socket paths are resolved against (None: os.getcwd()).
    Raises ConfigError.
    """
    env = os.environ if env is None else env
    b = _Builder()

    named_by = ""
    if path is None and env.get(CONFIG_ENV):
        path, named_by = env[CONFIG_ENV], CONFIG_ENV
    if path is not None:
        where = f"config file {path}"
        data = _read_file(path, named_by)
        for section, table in data.items():
            if not isinstance(table, dict):
                if section in SCHEMA:
                    raise ConfigError(f"[{section}] (in {where}): expected a table, got "
                                      f"{_type_name(table)}", key=section, source=where)
                _check_key(section, "", where)
            for name, raw in table.items():
                key = _check_key(section, name, where)
                if isinstance(raw, dict):
                    raise ConfigError(f"{key} (from {where}): expected a value, got a table",
                                      key=key, source=where)
                b.set(key, raw, where, text=False)

    for key, var, raw in _env_keys(env):
        b.set(key, raw, f"environment variable {var}", text=True)

    labels = dict(override_sources or {})
    for okey, raw in (overrides or {}).items():
        if raw is None:
            continue
        section, _, name = okey.partition(".")
        label = labels.get(okey) or (f"flag {CLI_FLAGS[okey]}" if okey in CLI_FLAGS
                                     else f"override {okey}")
        key = _check_key(section, name, label)
        b.set(key, raw, label, text=isinstance(raw, str))

    config = Config(**{s: SECTIONS[s](**b.values[s]) for s in SCHEMA}, sources=dict(b.sources))
    config = _resolve_paths(config, cwd or os.getcwd())
    _validate(config, b)
    return config


def _resolve_paths(config: Config, cwd: str) -> Config:
    sock = config.listen.socket
    if sock:
        sock = os.path.normpath(os.path.join(cwd, os.path.expanduser(sock)))
    shm = os.path.normpath(os.path.join(cwd, os.path.expanduser(config.host_tier.shm_dir)))
    def resolve(path: str) -> str:
        return os.path.normpath(os.path.join(cwd, os.path.expanduser(path))) if path else ""

    tls = config.tls
    return replace(config, listen=replace(config.listen, socket=sock),
                   host_tier=replace(config.host_tier, shm_dir=shm),
                   disk_tier=replace(config.disk_tier, path=resolve(config.disk_tier.path)),
                   auth=replace(config.auth, tokens_file=resolve(config.auth.tokens_file)),
                   tls=replace(tls, cert_file=resolve(tls.cert_file), key_file=resolve(tls.key_file),
                               client_ca_file=resolve(tls.client_ca_file)))


def _validate(c: Config, b: _Builder) -> None:
    """Checks that involve more than one value."""
    ht = c.host_tier
    if ht.page_bytes % PAGE_ALIGN:
        raise b.fail("host_tier.page_bytes", f"{ht.page_bytes} B is not a multiple of "
                     f"{PAGE_ALIGN}; try {_show_size(max(PAGE_ALIGN, ht.page_bytes // PAGE_ALIGN * PAGE_ALIGN))}",
                     ht.page_bytes)
    need = HOST_HEADER_BYTES + ht.page_bytes
    if ht.capacity_bytes < need:
        raise b.fail("host_tier.capacity_bytes",
                     f"capacity {ht.capacity_bytes} B is smaller than one page: it needs at least "
                     f"{need} B (a {HOST_HEADER_BYTES} B header plus one page of "
                     f"{ht.page_bytes} B, host_tier.page_bytes from {b.source('host_tier.page_bytes')})",
                     ht.capacity_bytes)
    if not c.listen.socket and not c.listen.tcp:
        raise ConfigError(
            "no listener enabled: listen.socket (from "
            f"{b.source('listen.socket')}) and listen.tcp (from {b.source('listen.tcp')}) are "
            "both empty; set at least one", key="listen", source=b.source("listen.tcp"))
    tls = c.tls
    if bool(tls.cert_file) != bool(tls.key_file):
        key = "tls.key_file" if tls.cert_file else "tls.cert_file"
        raise b.fail(key, "tls.cert_file and tls.key_file go together: set both or neither",
                     getattr(tls, key.split(".")[1]))
    if tls.client_ca_file and not tls.cert_file:
        raise b.fail("tls.client_ca_file", "mutual TLS needs the listener's own certificate: "
                     "set tls.cert_file and tls.key_file too", tls.client_ca_file)
    if tls.cert_file and not c.listen.tcp:
        raise b.fail("tls.cert_file", "TLS applies to listen.tcp, which is disabled",
                     tls.cert_file)
    if c.listen.tcp and c.metrics.address and \
            parse_address(c.listen.tcp) == parse_address(c.metrics.address) and \
            parse_address(c.listen.tcp)[1] != 0:
        raise b.fail("metrics.address", f"the same address as listen.tcp (from "
                     f"{b.source('listen.tcp')}); pick another port", c.metrics.address)


# --------------------------------------------------------------------------- rendering
def render_toml(config: Config, *, with_sources: bool = True) -> str:
    """The config as a TOML file that load_config reads back to the same values."""
    lines = []
    for section, values in config.as_dict().items():
        if lines:
            lines.append("")
        lines.append(f"[{section}]")
        for key, value in values.items():
            if key == "socket_mode":
                text = f"0o{value:03o}"
            elif isinstance(value, bool):
                text = "true" if value else "false"
            elif isinstance(value, str):
                text = json.dumps(value)
            else:
                text = repr(value)
            line = f"{key} = {text}"
            if with_sources:
                src = config.source_of(f"{section}.{key}")
                notes = []
                if SCHEMA[section][key].metadata["kind"] == "size":
                    notes.append(_show_size(value))
                if src != "default":
                    notes.append(f"from {src}")
                note = "; ".join(notes)
                if key == "name" and not value:
                    note = (note + "; " if note else "") + "\"\" = kvkeeper-<pid>"
                if note:
                    line = f"{line:<44} # {note}"
            lines.append(line)
    return "\n".join(lines) + "\n"


def render_json(config: Config) -> str:
    d = config.as_dict()
    d["listen"]["socket_mode"] = f"0{config.listen.socket_mode:03o}"
    return json.dumps(d, indent=2) + "\n"
