"""LLM-serving traces for the policy benchmark: a seeded generator and a file format.

A trace is a list of requests; a request is one chain of block keys (each
key names its whole prefix, as the connector's keys do) and how many of
them are the prompt: the prompt's blocks are looked up, then the blocks
after the hit are saved, the decode blocks (the rest of the chain) with them.

The generator mixes five traffic classes, each request drawn by the mix's
weights (`Mix`):

    chat     a turn of a multi-turn conversation: a system prompt, the whole
             previous turn (its prompt and its answer, the decode blocks), and
             a new user message; the turn's chain is the next turn's prefix.
             After each turn a conversation ends with p_end, or its next turn
             is due after the user's think time (gamma-distributed, shape 2,
             mean turn_gap requests); a chat request serves the conversation
             most overdue, or opens a new one when none is due. A turn after
             which its conversation ends is marked last_turn (what a client
             that knows it would say; replays use it only when told to).
    rag      a system prompt, a shared document (Zipf-popular), a question
    unique   a system prompt and a one-off message (never read again)
    scan     a one-off long document read once (64-256 blocks) after a
             system prompt: the scans that flush a recency cache
    every request ends with decode blocks (its answer), saved; only a chat
             turn's are read again (by the conversation's next turn).

System prompts and documents are Zipf-popular (rank r drawn with weight
1/r^s). Everything not shared is unique. Same seed, same trace.

File format (`write_trace`, `read_trace`): JSON lines, one request a line,

    {"keys": ["<hex key>", ...], "prompt_blocks": 12}
    {"keys": ["<hex key>", ...], "prompt_blocks": 12, "last_turn": true}

keys[0] is the first block of a chain; each key's parent is the key before
it; prompt_blocks <= len(keys) (the rest are decode blocks); last_turn
(optional, false when absent): the request said it was its conversation's
last turn; ns (optional): the namespace the request ran in, folded into its
keys (two namespaces' equal keys are different blocks). Keys are hex of any
fixed length (all the same). The daemon records its own traffic in this
shape (`[ledger] traffic_file`, server/ops/traffic.py: the keys of each
Match and the saves that continued them), and an operator replays it:
`kvkeeper bench policy --trace FILE`.
"""
from __future__ import annotations

import hashlib
import heapq
import json
import random
from dataclasses import dataclass, replace
from typing import Iterable, Mapping, Optional

KEY_BYTES = 32


@dataclass(frozen=True)
class Request:
    keys: tuple[bytes, ...]
    prompt_blocks: int
    # The client says so: no request extends this one's chain (a conversation's
    # last turn; the connector's kv_transfer_params "kvkeeper_last_turn").
    last_turn: bool = False


@dataclass(frozen=True)
class Mix:
    """A traffic mix: class weights and the shapes of each class."""

    name: str
    chat: float
    rag: float
    unique: float
    scan: float
    requests: int = 2000
    system_prompts: int = 12
    system_blocks: int = 6
    system_zipf: float = 1.2
    documents: int = 150
    document_blocks: tuple[int, int] = (8, 32)
    document_zipf: float = 1.0
    message_blocks: tuple[int, int] = (1, 3)
    decode_blocks: tuple[int, int] = (1, 4)
    scan_blocks: tuple[int, int] = (64, 256)
    turn_gap: float = 40.0       # mean requests between two turns of one conversation
    p_end: float = 0.2
    max_history_blocks: int = 256

    def scaled(self, requests: int) -> "Mix":
        return replace(self, requests=requests)

    def changed(self, changes: Mapping[str, str]) -> "Mix":
        """This mix with fields set from text (`turn_gap=80`, `scan_blocks=32:128`:
        a range as LOW:HIGH), to check that a result does not hang on one
        shape of the generator. ValueError names a bad field or value."""
        kw: dict[str, object] = {}
        for name, text in changes.items():
            if name not in self.__dataclass_fields__ or name == "name":
                raise ValueError(f"mix field {name!r} does not exist; one of "
                                 f"{sorted(f for f in self.__dataclass_fields__ if f != 'name')}")
            cur = getattr(self, name)
            try:
                kw[name] = (tuple(int(x) for x in text.split(":")) if isinstance(cur, tuple)
                            else type(cur)(text))
            except ValueError:
                raise ValueError(f"mix field {name}={text!r}: not a {type(cur).__name__}"
                                 + (" (LOW:HIGH)" if isinstance(cur, tuple) else "")) from None
            if isinstance(cur, tuple) and len(kw[name]) != 2:  # type: ignore[arg-type]
                raise ValueError(f"mix field {name}={text!r}: a range is LOW:HIGH")
        return replace(self, **kw)  # type: ignore[arg-type]


MIXES: dict[str, Mix] = {m.name: m for m in (
    Mix("chat-heavy", chat=0.70, rag=0.10, unique=0.15, scan=0.05),
    Mix("rag-heavy", chat=0.20, rag=0.60, unique=0.10, scan=0.10),
    Mix("scan-heavy", chat=0.35, rag=0.20, unique=0.10, scan=0.35),
)}


def chain(parent: bytes, content: bytes) -> bytes:
    """The key of a block whose prefix is `parent` (b"" for a chain's first)."""
    return hashlib.blake2b(parent + content, digest_size=KEY_BYTES).digest()


def extend(prefix: list[bytes], contents: Iterable[bytes]) -> list[bytes]:
    out = list(prefix)
    for c in contents:
        out.append(chain(out[-1] if out else b"", c))
    return out


class _Zipf:
    def __init__(self, n: int, s: float, rng: random.Random) -> None:
        self.weights = [1.0 / (r + 1) ** s for r in range(n)]
        self.rng = rng
        self.ranks = list(range(n))

    def __call__(self) -> int:
        return self.rng.choices(self.ranks, self.weights)[0]


def generate(mix: Mix, seed: int = 1) -> list[Request]:
    """A seeded trace of mix.requests requests (see the module docstring)."""
    rng = random.Random(seed)
    pick_system = _Zipf(mix.system_prompts, mix.system_zipf, rng)
    pick_doc = _Zipf(mix.documents, mix.document_zipf, rng)
    doc_len = [rng.randint(*mix.document_blocks) for _ in range(mix.documents)]
    counter = 0

    def unique(n: int) -> list[bytes]:
        nonlocal counter
        counter += n
        return [b"u%d" % i for i in range(counter - n, counter)]

    def system() -> list[bytes]:
        z = pick_system()
        return extend([], (b"s%d.%d" % (z, j) for j in range(mix.system_blocks)))

    # Open conversations: (when the next turn is due, id); their chains so far.
    due: list[tuple[float, int]] = []
    conversations: dict[int, list[bytes]] = {}
    kinds = ("chat", "rag", "unique", "scan")
    weights = (mix.chat, mix.rag, mix.unique, mix.scan)
    out: list[Request] = []
    for now in range(mix.requests):
        kind = rng.choices(kinds, weights)[0]
        if kind == "chat":
            if due and due[0][0] <= now:
                _, i = heapq.heappop(due)
                prefix = conversations[i]
            else:
                i = len(out)
                prefix = system()
            prompt = extend(prefix, unique(rng.randint(*mix.message_blocks)))
        elif kind == "rag":
            z = pick_doc()
            prompt = extend(system(), (b"d%d.%d" % (z, j) for j in range(doc_len[z])))
            prompt = extend(prompt, unique(rng.randint(*mix.message_blocks)))
        elif kind == "unique":
            prompt = extend(system(), unique(rng.randint(*mix.message_blocks)))
        else:
            prompt = extend(system(), unique(rng.randint(*mix.scan_blocks)))
        full = extend(prompt, unique(rng.randint(*mix.decode_blocks)))
        ends = kind == "chat" and (rng.random() < mix.p_end
                                   or len(full) > mix.max_history_blocks)
        out.append(Request(tuple(full), len(prompt), last_turn=ends))
        if kind == "chat":
            if ends:
                conversations.pop(i, None)
            else:
                conversations[i] = full
                # The user's think time: gamma-distributed (shape 2), so a turn
                # comes back after a typical gap, rarely much later.
                heapq.heappush(due, (now + rng.gammavariate(2.0, mix.turn_gap / 2), i))
    return out


def reread_working_set(requests: list[Request]) -> int:
    """Blocks read again: keys in the prompts of a request after the one
    that first named them (the blocks any cache could turn into hits)."""
    first: dict[bytes, int] = {}
    again: set[bytes] = set()
    for i, r in enumerate(requests):
        for j, k in enumerate(r.keys):
            seen = first.setdefault(k, i)
            if seen != i and j < r.prompt_blocks:
                again.add(k)
    return len(again)


# ------------------------------------------------------------------ files
def write_trace(requests: Iterable[Request], path: str) -> None:
    with open(path, "w") as fh:
        for r in requests:
            d: dict[str, object] = {"keys": [k.hex() for k in r.keys],
                                    "prompt_blocks": r.prompt_blocks}
            if r.last_turn:
                d["last_turn"] = True
            fh.write(json.dumps(d) + "\n")


class TraceError(ValueError):
    """A trace file that is not the documented format (the line says where)."""


def read_trace(path: str) -> list[Request]:
    out: list[Request] = []
    width: Optional[int] = None
    with open(path) as fh:
        for n, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                d = json.loads(line)
                keys = tuple(bytes.fromhex(k) for k in d["keys"])
                prompt = int(d["prompt_blocks"])
                last = d.get("last_turn", False)
                ns = d.get("ns")
            except (ValueError, KeyError, TypeError) as e:
                raise TraceError(f"{path}:{n}: not a request line "
                                 f'{{"keys": [hex, ...], "prompt_blocks": N}}: {e}') from None
            if not keys or not 0 < prompt <= len(keys):
                raise TraceError(f"{path}:{n}: prompt_blocks {prompt} must be in 1..{len(keys)} "
                                 "(the number of keys)")
            w = {len(k) for k in keys}
            if len(w) != 1 or (width is not None and w != {width}):
                raise TraceError(f"{path}:{n}: keys of different lengths; all keys have one length")
            if not isinstance(last, bool):
                raise TraceError(f"{path}:{n}: last_turn is {last!r}; true, false or absent")
            if ns is not None:
                if not isinstance(ns, str):
                    raise TraceError(f"{path}:{n}: ns is {ns!r}; a namespace's name or absent")
                keys = tuple(hashlib.blake2b(ns.encode() + k, digest_size=len(k)).digest()
                             for k in keys)
            width = w.pop()
            out.append(Request(keys, prompt, last))
    if not out:
        raise TraceError(f"{path}: no requests")
    return out
