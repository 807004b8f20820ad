"""Where everything lives under a disk tier's root, and the LAYOUT file that
fixes the fan-out depth for every daemon sharing the directory.

Layout under `root`
-------------------

    LAYOUT                                              format version, fan-out depth
    blocks/<ns_hex[:16]>/<kh[0:2]>/<kh>.kvb             one block (kh = key hex)
    tmp/<owner>-<pid>-<rand>.tmp                        files being written
    quarantine/<ns_hex[:16]>.<kh>.kvb.<unix_ms>.<rand>  blocks that failed a check
    pins/<ns_hex[:16]>/<kh[0:2]>/<kh>.<owner>           "owner is using this block"
    gc.lock/<generation:020d>                           garbage-collection lease

Blocks fan out over one level of 256 directories per namespace by default;
with fanout_levels=2 (fixed in LAYOUT when the directory is first opened, so
all daemons agree) the path is blocks/<ns_hex[:16]>/<kh[0:2]>/<kh[2:4]>/<kh>.kvb,
for stores of ~1e8 blocks per namespace. Two levels cost start-up time at
smaller sizes: every near-empty leaf directory is one more directory read
(100k blocks: ~84k leaf dirs, measured 3.2 s of listing alone here, against
~0.05 s for one level). A namespace is named by the first 64 bits of its
digest; the header holds all 128, so a (2^-64) collision reads as a miss.

A path is built only from the hex of the 16-byte namespace digest and of the
key (2..64 bytes), plus the owner id, which is daemon configuration checked
against [A-Za-z0-9_.-]; no client string ever reaches a path. Directories are
never removed: a daemon elsewhere may be about to rename a block into one.
"""
from __future__ import annotations

import os
import re
import secrets
import time

from .durability import fsync_dir
from .fileio import CLOEXEC
from .header import FORMAT_VERSION, check_ns_key

# One level of 256 dirs per namespace; 2 levels suit stores of ~1e8 blocks per
# namespace, but each of their up to 65536 near-empty leaf dirs costs a
# directory read at start-up (~38 us here: 2.5 s per namespace).
DEFAULT_FANOUT_LEVELS = 1
BLOCK_SUFFIX = ".kvb"
TMP_SUFFIX = ".tmp"
_OWNER_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,63}\Z")
_HEX_RE = re.compile(r"[0-9a-f]+\Z")
_LAYOUT_MAGIC = "kvkeeper-disk-layout"


def make_dirs(root: str) -> None:
    """Create root and its top-level directories (each daemon at open; idempotent)."""
    for d in (root, *(os.path.join(root, s) for s in ("blocks", "tmp", "quarantine", "pins",
                                                       "gc.lock"))):
        os.makedirs(d, mode=0o750, exist_ok=True)


def check_owner(owner: str) -> str:
    if not isinstance(owner, str) or not _OWNER_RE.match(owner):
        raise ValueError(f"owner id {owner!r} must be 1-64 characters of [A-Za-z0-9_.-], "
                         "not starting with '.' or '-'")
    return owner


def tmp_path(tmp_dir: str, owner: str, pid: int) -> str:
    """A fresh tmp file name that says whose it is (see `tmp_owner`)."""
    return os.path.join(tmp_dir, f"{owner}-{pid}-{secrets.token_hex(8)}{TMP_SUFFIX}")


def tmp_owner(name: str) -> str:
    """The owner id in a `tmp_path` name (owner ids may contain '-', pids and
    the random part do not)."""
    return name[:-len(TMP_SUFFIX)].rsplit("-", 2)[0]


def leaf_dirs(top: str, prefix: str, fanout_levels: int) -> list[tuple[str, str]]:
    """The leaf directories under a first-level fan-out dir `top` (named
    `prefix`), each with the key-hex prefix its blocks' names start with."""
    leaves = [(top, prefix)]
    for _ in range(fanout_levels - 1):
        leaves = [(e.path, pre + e.name) for d, pre in leaves for e in subdirs(d, 2)]
    return leaves


def subdirs(path: str, name_len: int) -> list[os.DirEntry]:
    """Subdirectories of `path` whose names are `name_len` lowercase hex digits."""
    try:
        with os.scandir(path) as it:
            return [e for e in it if len(e.name) == name_len and _HEX_RE.match(e.name)
                    and e.is_dir(follow_symlinks=False)]
    except FileNotFoundError:
        return []


def recorded_fanout_levels(root: str, want: int | None) -> int:
    """The fan-out depth recorded in root/LAYOUT, which the first daemon to
    open the directory writes (O_EXCL): every daemon sharing it must agree."""
    path = os.path.join(root, "LAYOUT")
    text = f"{_LAYOUT_MAGIC} {FORMAT_VERSION} fanout_levels={want or DEFAULT_FANOUT_LEVELS}\n"
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | CLOEXEC, 0o640)
    except FileExistsError:
        pass
    else:
        try:
            os.write(fd, text.encode())
            os.fsync(fd)
        finally:
            os.close(fd)
        fsync_dir(root)
    for _ in range(50):  # another daemon may be writing it right now
        with open(path) as f:
            have = f.read(200)
        if have.endswith("\n"):
            break
        time.sleep(0.05)
    m = re.fullmatch(rf"{_LAYOUT_MAGIC} (\d+) fanout_levels=([12])\n", have)
    if m is None or int(m.group(1)) != FORMAT_VERSION:
        raise ValueError(f"{path} reads {have!r}: not a kvkeeper disk tier of format "
                         f"{FORMAT_VERSION}; point the disk tier at another directory")
    levels = int(m.group(2))
    if want is not None and want != levels:
        raise ValueError(f"{root} was created with fanout_levels={levels}, not {want}; "
                         "use the recorded value or another directory")
    return levels


class Layout:
    """The paths under one root (already created: see `DiskStore.open`)."""

    def __init__(self, root: str, fanout_levels: int) -> None:
        self.root = root
        self.fanout_levels = fanout_levels
        self.blocks_dir = os.path.join(root, "blocks")
        self.tmp_dir = os.path.join(root, "tmp")
        self.quarantine_dir = os.path.join(root, "quarantine")
        self.pins_dir = os.path.join(root, "pins")
        self.gc_dir = os.path.join(root, "gc.lock")

    def block_path(self, ns: bytes, key: bytes) -> str:
        ns, key = check_ns_key(ns, key)
        kh = key.hex()
        # String formatting, not os.path.join: this runs on every read and write.
        if self.fanout_levels == 1:
            return f"{self.blocks_dir}/{ns[:8].hex()}/{kh[:2]}/{kh}{BLOCK_SUFFIX}"
        return f"{self.blocks_dir}/{ns[:8].hex()}/{kh[:2]}/{kh[2:4]}/{kh}{BLOCK_SUFFIX}"

    def pin_dir(self, ns: bytes, key: bytes) -> str:
        return os.path.join(self.pins_dir, ns.hex()[:16], key.hex()[0:2])

    def quarantine_path(self, block_path: str) -> str:
        """Where a bad block file goes: its name kept, plus a timestamp."""
        ns_name = os.path.relpath(block_path, self.blocks_dir).split(os.sep)[0]
        return os.path.join(self.quarantine_dir, f"{ns_name}.{os.path.basename(block_path)}."
                                                 f"{int(time.time() * 1000)}.{secrets.token_hex(4)}")
