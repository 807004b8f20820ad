"""Value syntax: sizes, durations, addresses, integers, booleans and modes, by a key's kind.

Each parser takes what a source gave (a TOML value, or text from the environment or a
flag) and returns the typed value or raises ValueError saying what is wrong; the loader
adds which key and which source. The syntax itself is described in the package docstring.
"""
from __future__ import annotations

import difflib
import json
import re
from fractions import Fraction
from typing import Any

from kvkeeper.client.url import parse_host_port

from ..tiers.cluster.config import check_key_prefix, parse_cluster_url

KiB = 1024
MiB = 1024 * KiB
GiB = 1024 * MiB
TiB = 1024 * GiB

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


def type_name(v: Any) -> str:
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
                         f"got {type_name(value)}")
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
                         f"got {type_name(value)}")
    if seconds != seconds or seconds in (float("inf"), float("-inf")):
        raise ValueError(f"{value!r} is not a finite duration")
    return seconds


def parse_address(value: str) -> tuple[str, int]:
    """("host", port) of a listener address, "host:port" or "[v6]:port"; port 0 binds any
    free port. The host keeps its brackets, as gRPC's bind takes it. ValueError."""
    try:
        host, port = parse_host_port(value, any_port=True)
    except ValueError as e:
        raise ValueError(f"{value!r} is not \"host:port\" ({e}); e.g. \"127.0.0.1:50051\", "
                         "\"[::1]:50051\", or \"\" to disable") from None
    return (f"[{host}]" if ":" in host else host), port


def parse_int(value: Any, text: bool) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, str)) or \
            (isinstance(value, str) and not text):
        raise ValueError(f"expected an integer, got {type_name(value)}")
    if isinstance(value, str):
        try:
            return int(value.strip())
        except ValueError:
            raise ValueError(f"{value!r} is not an integer") from None
    return value


def parse_bool(value: Any, text: bool) -> bool:
    if isinstance(value, bool):
        return value
    if text and isinstance(value, str):
        v = value.strip().lower()
        if v in _TRUE:
            return True
        if v in _FALSE:
            return False
        raise ValueError(f"{value!r} is not a boolean; write true or false")
    raise ValueError(f"expected a boolean (true or false), got {type_name(value)}")


def parse_mode(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise ValueError(f"expected permission bits (0o660 or \"0660\"), got {type_name(value)}")
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


def convert(f: Any, raw: Any, text: bool) -> Any:
    """Convert one raw value for field `f`; `text` is True for env/flag sources. ValueError."""
    meta = f.metadata
    kind = meta["kind"]
    if kind in ("path", "address", "dir", "shm_name", "choice", "group", "cluster_url",
                "key_prefix", "text"):
        if not isinstance(raw, str):
            raise ValueError(f"expected a string, got {type_name(raw)}")
        value: Any = raw
        if kind == "address" and value:
            parse_address(value)
        elif kind == "dir" and not value:
            raise ValueError("must not be empty")
        elif kind == "shm_name" and value and not _SHM_NAME_RE.match(value):
            raise ValueError(f"{value!r} is not a segment name: use 1-200 of A-Z a-z 0-9 . _ -")
        elif kind == "group" and value and not _GROUP_RE.match(value):
            raise ValueError(f"{value!r} is not a group name or a numeric gid")
        elif kind == "cluster_url" and value:
            parse_cluster_url(value)
        elif kind == "key_prefix":
            check_key_prefix(value)
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
        value = parse_int(raw, text)
    elif kind == "mode":
        value = parse_mode(raw)
    elif kind == "bool":
        value = parse_bool(raw, text)
    else:  # pragma: no cover
        raise AssertionError(kind)
    if kind in ("size", "duration", "int"):
        lo, hi, lo_excl = meta.get("min"), meta.get("max"), meta.get("min_excl")
        show = show_size if kind == "size" else str
        if lo is not None and value < lo:
            raise ValueError(f"{show(value)} is below the minimum {show(lo)}")
        if lo_excl is not None and value <= lo_excl:
            raise ValueError(f"must be greater than {lo_excl}, got {value:g}")
        if hi is not None and value > hi:
            raise ValueError(f"{show(value)} is above the maximum {show(hi)}")
    return value


def show_size(n: int) -> str:
    """A size in its largest whole binary unit ("64KiB"), else in bytes."""
    for unit, size in (("TiB", TiB), ("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if n >= size and n % size == 0:
            return f"{n // size}{unit}"
    return f"{n} B"


def show_raw(raw: Any) -> str:
    """A raw value as the user wrote it: strings quoted."""
    return json.dumps(raw) if isinstance(raw, str) else repr(raw)

