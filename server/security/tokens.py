"""The tokens file (`auth.tokens_file`): bearer tokens, what each may use, and quotas.

    # mode 0600, owned by the daemon's user
    [tokens.tenant-a]                 # a name: logs and errors show it, never the token
    token = "a-long-random-string"    # at least 16 characters, no whitespace
    models = ["org/model-a"]          # model ids whose namespaces it may register; ["*"]: any
    admin = false                     # may call kvkeeper.v1.KVKeeperAdmin (default false)

    [tokens.ops]
    token = "another-long-random-string"
    models = ["*"]
    admin = true

    [quotas]                          # host-tier bytes per namespace, by model id
    "org/model-a" = "16GiB"           # each namespace of it (each TP rank ...) gets 16 GiB
    "*" = "64GiB"                     # every model not named

Only a digest of each token is kept in memory, and lookups compare digests
with hmac.compare_digest over every entry, so the time taken does not depend
on which entry (if any) matched.
"""
from __future__ import annotations

import hashlib
import hmac
import logging
import os
import stat
import sys
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

from ..config import ConfigError, parse_size
from ..ledger.quota import ANY_MODEL

log = logging.getLogger("kvkeeper.auth")

KEY = "auth.tokens_file"
MIN_TOKEN_CHARS = 16
_ENTRY_KEYS = ("token", "models", "admin")


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode()).digest()


@dataclass(frozen=True)
class Grant:
    """What one token allows."""

    name: str
    models: Optional[frozenset[str]]      # None: every model
    admin: bool
    digest: bytes = field(repr=False)

    def allows_model(self, model_id: str) -> bool:
        return self.models is None or model_id in self.models


@dataclass(frozen=True)
class TokenTable:
    grants: tuple[Grant, ...] = ()
    quotas: Mapping[str, int] = field(default_factory=dict)

    def find(self, token: str) -> Optional[Grant]:
        """The grant of `token`, or None. Compares against every entry (see module doc)."""
        presented = _digest(token)
        found = None
        for g in self.grants:
            if hmac.compare_digest(g.digest, presented):
                found = g
        return found


def _fail(path: str, problem: str) -> ConfigError:
    return ConfigError(f"{KEY} = {path!r}: {problem}", key=KEY, source=f"tokens file {path}")


def _grant(path: str, name: str, entry: Any) -> Grant:
    where = f"[tokens.{name}]"
    if not isinstance(entry, dict):
        raise _fail(path, f"{where} must be a table with token, models and admin")
    unknown = sorted(set(entry) - set(_ENTRY_KEYS))
    if unknown:
        raise _fail(path, f"{where}: unknown key {unknown[0]!r}; keys are {', '.join(_ENTRY_KEYS)}")
    token = entry.get("token")
    # The messages below never quote the token itself.
    if not isinstance(token, str):
        raise _fail(path, f"{where}: token must be a string")
    if len(token) < MIN_TOKEN_CHARS or any(c.isspace() or not c.isprintable() for c in token) \
            or not token.isascii():
        raise _fail(path, f"{where}: the token must be at least {MIN_TOKEN_CHARS} printable ASCII "
                    "characters without whitespace (e.g. `openssl rand -hex 32`)")
    models = entry.get("models")
    if not isinstance(models, list) or not models or \
            not all(isinstance(m, str) and m for m in models):
        raise _fail(path, f"{where}: models must be a non-empty list of model ids, or [\"*\"]")
    admin = entry.get("admin", False)
    if not isinstance(admin, bool):
        raise _fail(path, f"{where}: admin must be true or false")
    return Grant(name, None if ANY_MODEL in models else frozenset(models), admin, _digest(token))


def _quotas(path: str, table: Any) -> dict[str, int]:
    if not isinstance(table, dict):
        raise _fail(path, "[quotas] must be a table of model id = size")
    out = {}
    for model, raw in table.items():
        try:
            out[model] = parse_size(raw)
        except ValueError as e:
            raise _fail(path, f"[quotas] {model!r}: {e}") from None
        if out[model] < 0:
            raise _fail(path, f"[quotas] {model!r}: a quota cannot be negative")
    return out


def parse_tokens(data: Mapping[str, Any], path: str = "<tokens>") -> TokenTable:
    unknown = sorted(set(data) - {"tokens", "quotas"})
    if unknown:
        raise _fail(path, f"unknown table {unknown[0]!r}; the file has [tokens.NAME] tables "
                    "and one [quotas] table")
    tokens = data.get("tokens", {})
    if not isinstance(tokens, dict):
        raise _fail(path, "tokens must be tables: [tokens.NAME]")
    grants = tuple(_grant(path, name, entry) for name, entry in tokens.items())
    seen: dict[bytes, str] = {}
    for g in grants:
        if g.digest in seen:
            raise _fail(path, f"[tokens.{seen[g.digest]}] and [tokens.{g.name}] have the same "
                        "token; give each its own")
        seen[g.digest] = g.name
    return TokenTable(grants, _quotas(path, data.get("quotas", {})))


def load_tokens(path: str) -> TokenTable:
    """Read and check the tokens file; ConfigError (key auth.tokens_file) on any problem."""
    try:
        with open(path, "rb") as fh:
            mode = os.fstat(fh.fileno()).st_mode
            data = tomllib.load(fh)
    except FileNotFoundError:
        raise _fail(path, "no such file") from None
    except OSError as e:
        raise _fail(path, f"cannot read it: {e.strerror or e}") from None
    except tomllib.TOMLDecodeError as e:
        # tomllib's message names a line and column, never the value.
        raise _fail(path, f"not valid TOML: {e}") from None
    except UnicodeDecodeError as e:
        # The offset only: the bytes around it may be a token.
        raise _fail(path, f"not UTF-8 (at byte offset {e.start}); TOML files are UTF-8") from None
    table = parse_tokens(data, path)
    if stat.S_IMODE(mode) & 0o077:
        log.warning("tokens file %s is readable by group or others (mode %04o); chmod 600 it",
                    path, stat.S_IMODE(mode), extra={"event": "auth_file_mode"})
    return table
