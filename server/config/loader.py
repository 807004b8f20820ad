"""Where values come from: defaults < TOML file < environment < flags, key by key.

load_config collects each source's raw values with a label saying where they came from,
converts them by the schema's kinds (parsers.convert), resolves relative paths, then runs
the checks that involve more than one value (validation.validate).
"""
from __future__ import annotations

import difflib
import os
import sys
from dataclasses import replace
from typing import Any, Mapping, Optional

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

from .parsers import convert, show_raw, type_name
from .schema import SCHEMA, SECTIONS, Config, ConfigError
from .validation import validate

ENV_PREFIX = "KVKEEPER_"
CONFIG_ENV = "KVKEEPER_CONFIG"

# Dedicated `kvkeeper serve` flags; the CLI builds its parser from this table.
CLI_FLAGS: dict[str, str] = {
    "listen.socket": "--socket",
    "listen.tcp": "--tcp",
    "metrics.address": "--metrics",
    "host_tier.capacity_bytes": "--capacity",
    "host_tier.page_bytes": "--page-size",
    "disk_tier.path": "--disk-path",
    "disk_tier.capacity_bytes": "--disk-capacity",
    "cluster_tier.url": "--cluster-url",
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


def _suggest(word: str, options: list[str]) -> str:
    hit = difflib.get_close_matches(word, options, n=1, cutoff=0.6)
    return f"; did you mean {hit[0]!r}?" if hit else ""


class _Builder:
    """Collects the converted values of every source, and the source of each."""

    def __init__(self) -> None:
        self.values: dict[str, dict[str, Any]] = {s: {} for s in SCHEMA}
        self.sources: dict[str, str] = {}

    def set(self, key: str, raw: Any, source: str, text: bool) -> None:
        section, _, name = key.partition(".")
        f = SCHEMA[section][name]
        try:
            value = convert(f, raw, text)
        except ValueError as e:
            raise ConfigError(f"{key} = {show_raw(raw)} (from {source}): {e}",
                              key=key, source=source) from None
        self.values[section][name] = value
        self.sources[key] = source



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
    except UnicodeDecodeError as e:
        # tomllib decodes the whole file first: a latin-1 comment fails before any line.
        raise ConfigError(f"{where}: not UTF-8 (byte {e.object[e.start]:#04x} at offset "
                          f"{e.start}); TOML files are UTF-8", source=where) from None


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
                                      f"{type_name(table)}", key=section, source=where)
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
    validate(config)
    return config


def _resolve_paths(config: Config, cwd: str) -> Config:
    sock = config.listen.socket
    if sock:
        sock = os.path.normpath(os.path.join(cwd, os.path.expanduser(sock)))
    shm = os.path.normpath(os.path.join(cwd, os.path.expanduser(config.host_tier.shm_dir)))
    def resolve(path: str) -> str:
        return os.path.normpath(os.path.join(cwd, os.path.expanduser(path))) if path else ""

    tls, ct = config.tls, config.cluster_tier
    return replace(config, listen=replace(config.listen, socket=sock),
                   host_tier=replace(config.host_tier, shm_dir=shm),
                   disk_tier=replace(config.disk_tier, path=resolve(config.disk_tier.path)),
                   auth=replace(config.auth, tokens_file=resolve(config.auth.tokens_file)),
                   tls=replace(tls, cert_file=resolve(tls.cert_file), key_file=resolve(tls.key_file),
                               client_ca_file=resolve(tls.client_ca_file)),
                   cluster_tier=replace(ct, password_file=resolve(ct.password_file),
                                        ca_file=resolve(ct.ca_file), cert_file=resolve(ct.cert_file),
                                        key_file=resolve(ct.key_file)))


