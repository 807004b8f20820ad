"""The daemon's configuration: typed sections, where each value comes from, and validation.

Precedence, lowest first (a later source overrides an earlier one, key by key):

1. defaults   -- the field defaults of the dataclasses in schema.py;
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

The package, by concept: schema (the sections and their keys), parsers (value syntax),
loader (the sources and their precedence), validation (checks across keys), rendering
(the effective configuration as TOML or JSON).
"""
from .loader import CLI_FLAGS, CONFIG_ENV, ENV_PREFIX, describe_precedence, env_var, load_config
from .parsers import GiB, KiB, MiB, TiB, parse_address, parse_duration, parse_size
from .rendering import render_json, render_toml
from .schema import (HOST_HEADER_BYTES, LOG_FORMATS, LOG_LEVELS, PAGE_ALIGN, SCHEMA, SECTIONS,
                     AdminSection, AuthSection, ClusterTierSection, Config, ConfigError,
                     DiskTierSection, HostTierSection, LedgerSection, ListenSection, MetricsSection,
                     ServerSection, TlsSection)

__all__ = [
    "CLI_FLAGS", "CONFIG_ENV", "ENV_PREFIX", "describe_precedence", "env_var", "load_config",
    "GiB", "KiB", "MiB", "TiB", "parse_address", "parse_duration", "parse_size",
    "render_json", "render_toml",
    "HOST_HEADER_BYTES", "LOG_FORMATS", "LOG_LEVELS", "PAGE_ALIGN", "SCHEMA", "SECTIONS",
    "AdminSection", "AuthSection", "ClusterTierSection", "Config", "ConfigError",
    "DiskTierSection", "HostTierSection",
    "LedgerSection", "ListenSection", "MetricsSection", "ServerSection", "TlsSection",
]
