"""A model's identity in the namespace: what its files hold, not where they are.

Two engines share blocks only within one namespace, and its first field is
the model id. vLLM names a local model by the path it was given, which
differs for the same files reached through a symlink, a copy, or another
host's mount point, so those engines would share nothing. For a local model
(a directory, or a single weight file such as a GGUF) the default id is
therefore a digest of its content:

* config.json (and params.json, Mistral's format), parsed and written again
  canonically (sorted keys, no whitespace), so formatting does not matter;
  "_name_or_path", which transformers fills with a path, is left out;
* the weight index files (*.index.json: which tensor lives in which file),
  canonically too;
* every weight file (*.safetensors, *.bin, *.pt, *.pth, *.gguf) by name,
  size and a sample of its bytes: 4 KiB at evenly spaced offsets (one per
  4 MiB, 256 to 1024 per file; a small file is read whole). Symlinks are
  followed (a Hugging Face cache snapshot is made of them).

The sample is there because names and sizes alone do not tell apart two
fine-tunes of one base model (same config, same shapes, same sizes): their
KV differs, and sharing it would serve wrong results. Weights that differ
in a fraction f of their bytes escape 256 samples with probability
(1 - f)^256 (f = 5%: 2e-6); it reads at most 4 MiB per file. Set
kvkeeper_model_id when certainty matters or the files are not local.

A model named by a hub id ("org/name") keeps that name: it already is the
same on every host. This module uses only the standard library.
"""
from __future__ import annotations

import functools
import hashlib
import json
import os
import struct
from dataclasses import dataclass
from typing import Any, Iterable, List, Optional

__all__ = ["ModelIdentity", "model_identity", "files_digest"]

_CONFIG_FILES = ("config.json", "params.json")
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
_INDEX_SUFFIX = ".index.json"
_SAMPLE_BYTES = 4096
_BYTES_PER_SAMPLE = 4 << 20
_MIN_SAMPLES, _MAX_SAMPLES = 256, 1024
_DOMAIN = b"kvkeeper/model-identity/v1\x00"


@dataclass(frozen=True)
class ModelIdentity:
    model_id: str
    source: str     # how it was derived, for the start-up log


def _absorb(h: "hashlib._Hash", tag: str, data: bytes) -> None:
    t = tag.encode("utf-8")
    h.update(struct.pack("<Q", len(t)) + t + struct.pack("<Q", len(data)) + data)


def _canonical_json(path: str) -> bytes:
    with open(path, "rb") as f:
        obj = json.load(f)
    if isinstance(obj, dict):
        obj.pop("_name_or_path", None)
    return json.dumps(obj, sort_keys=True, separators=(",", ":")).encode("utf-8")


def _sample(path: str, size: int) -> bytes:
    """The bytes at evenly spaced offsets (all of them for a small file)."""
    n = min(_MAX_SAMPLES, max(_MIN_SAMPLES, size // _BYTES_PER_SAMPLE))
    with open(path, "rb") as f:
        if size <= n * _SAMPLE_BYTES:
            return f.read()
        out = bytearray()
        last = size - _SAMPLE_BYTES
        for i in range(n):
            f.seek(i * last // (n - 1))
            out += f.read(_SAMPLE_BYTES)
        return bytes(out)


def _weight_file(name: str) -> bool:
    return name.endswith(_WEIGHT_SUFFIXES) and not name.endswith(_INDEX_SUFFIX)


def files_digest(path: str) -> Optional[str]:
    """The sha256 (hex) of the model files in directory or file `path`, or None
    when it holds none of them."""
    h = hashlib.sha256(_DOMAIN)
    if os.path.isfile(path):
        size = os.path.getsize(path)
        _absorb(h, "weights", struct.pack("<Q", size) + _sample(path, size))
        return h.hexdigest()
    names = sorted(os.listdir(path))
    found = False
    for name in names:
        full = os.path.join(path, name)
        if not os.path.isfile(full):
            continue
        if name in _CONFIG_FILES or name.endswith(_INDEX_SUFFIX):
            _absorb(h, "json:" + name, _canonical_json(full))
            found = True
        elif _weight_file(name):
            size = os.path.getsize(full)
            _absorb(h, "weights:" + name, struct.pack("<Q", size) + _sample(full, size))
            found = True
    return h.hexdigest() if found else None


def _label(path: str) -> str:
    """A readable prefix for the id: the architecture from config.json."""
    cfg = os.path.join(path, "config.json")
    try:
        with open(cfg, "rb") as f:
            obj = json.load(f)
    except (OSError, ValueError):
        return "model"
    arch: Any = obj.get("architectures") if isinstance(obj, dict) else None
    if isinstance(arch, list) and arch and isinstance(arch[0], str):
        return arch[0]
    mt = obj.get("model_type") if isinstance(obj, dict) else None
    return mt if isinstance(mt, str) and mt else "model"


@functools.lru_cache(maxsize=16)
def _local_identity(real: str, stamp: tuple) -> Optional[str]:
    # `stamp` (names, sizes, mtimes) only invalidates the cache when files change.
    digest = files_digest(real)
    if digest is None:
        return None
    return f"{_label(real)}@sha256:{digest[:32]}"


def _stamp(path: str) -> tuple:
    entries: Iterable[str] = sorted(os.listdir(path)) if os.path.isdir(path) else [""]
    out: List[tuple] = []
    for name in entries:
        try:
            st = os.stat(os.path.join(path, name) if name else path)
        except OSError:
            continue
        out.append((name, st.st_size, st.st_mtime_ns))
    return tuple(out)


def model_identity(model: str, override: Optional[str] = None) -> ModelIdentity:
    """The namespace's model id for vLLM's `model` (a local path or a hub id).

    override (kvkeeper_model_id) wins. A local directory or file is named by
    its content (see the module docstring); anything else, or a local path
    holding no model files, by the name vLLM was given.
    """
    if override is not None:
        return ModelIdentity(override, "kvkeeper_model_id")
    if model and os.path.exists(model):
        real = os.path.realpath(model)
        try:
            mid = _local_identity(real, _stamp(real))
        except (OSError, ValueError) as e:
            return ModelIdentity(model, f"the model path ({model} could not be read: {e})")
        if mid is not None:
            return ModelIdentity(mid, f"the content of the model files in {model}")
        return ModelIdentity(model, f"the model path ({model} holds no config or weights)")
    return ModelIdentity(model, "the model name vLLM was given")
