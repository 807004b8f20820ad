"""The effective configuration as text: TOML that loads back to the same values, or JSON."""
from __future__ import annotations

import json

from .parsers import show_size
from .schema import SCHEMA, Config


def toml_string(value: str) -> str:
    """A TOML basic string. JSON's escapes are TOML's, except that JSON writes a
    character beyond U+FFFF as two \\u surrogates, which TOML refuses: such
    characters stay as they are (the output is UTF-8), and DEL, which TOML
    wants escaped and JSON does not, is escaped."""
    return json.dumps(value, ensure_ascii=False).replace("\x7f", "\\u007f")


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
                text = toml_string(value)
            else:
                text = repr(value)
            line = f"{key} = {text}"
            if with_sources:
                src = config.source_of(f"{section}.{key}")
                notes = []
                if SCHEMA[section][key].metadata["kind"] == "size":
                    notes.append(show_size(value))
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
