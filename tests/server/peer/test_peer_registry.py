"""PeerRegistry (sans-I/O): registration, publishing, the longest-prefix lookup
over other engines' segments, generations, and forgetting ended sessions."""
from __future__ import annotations

from typing import Dict, List

import pytest

from kvkeeper.client.peer_segment import DESCRIPTOR_VERSION, gens_bytes
from kvkeeper.server.errors import InvalidArgument, NotFound
from kvkeeper.server.ids import NamespaceId, SessionId
from kvkeeper.server.peer.registry import PeerRegistry, Segment

NS = NamespaceId(b"n" * 16)
OTHER_NS = NamespaceId(b"o" * 16)
N = 8
LB = 64
KV = 2 * N * LB


def desc(**over: object) -> Dict[str, object]:
    d: Dict[str, object] = {"version": DESCRIPTOR_VERSION, "num_blocks": N,
                            "block_bytes": 2 * LB, "layer_bytes": LB, "kv_bytes": KV,
                            "layers": [[0, LB], [N * LB, LB]]}
    d.update(over)
    return d


def key(i: int) -> bytes:
    return bytes([i]) * 32


class Holder:
    """A fake holder: its generation array and whether its scheduler attached."""

    def __init__(self) -> None:
        self.gens = [0] * N
        self.attached = True


@pytest.fixture
def reg() -> Dict[str, object]:
    released: List[Segment] = []
    return {"reg": PeerRegistry(released.append), "released": released}


def register(r: PeerRegistry, sid: str, engine: str, h: Holder, ns: NamespaceId = NS,
             fd: int = 10, **over: object) -> Segment:
    return r.register(SessionId(sid), ns, engine, desc(**over), fd, fd + 1, KV, gens_bytes(N),
                      lambda b: h.gens[b], lambda: h.attached)


def test_longest_prefix_of_another_engine(reg: Dict[str, object]) -> None:
    r: PeerRegistry = reg["reg"]  # type: ignore[assignment]
    a, b = Holder(), Holder()
    sa = register(r, "s-a", "engine-a", a)
    sb = register(r, "s-b", "engine-b", b, fd=20)
    assert r.publish(SessionId("s-a"), sa.id, [[key(i).hex(), i, 0] for i in range(3)]) == 3
    r.publish(SessionId("s-b"), sb.id, [[key(i).hex(), 7 - i, 0] for i in range(5)])
    seg, blocks = r.match(NS, "engine-c", [key(i) for i in range(6)])
    assert seg is sb and blocks == [(7, 0), (6, 0), (5, 0), (4, 0), (3, 0)]
    # An engine's own cache is never its peer.
    seg, blocks = r.match(NS, "engine-b", [key(i) for i in range(6)])
    assert seg is sa and len(blocks) == 3
    # Other namespaces see nothing; a chain whose first key nobody holds, nothing.
    assert r.match(OTHER_NS, "engine-c", [key(0)]) == (None, [])
    assert r.match(NS, "engine-c", [key(9), key(0)]) == (None, [])


def test_a_reused_block_ends_the_prefix_and_its_entry(reg: Dict[str, object]) -> None:
    r: PeerRegistry = reg["reg"]  # type: ignore[assignment]
    a = Holder()
    sa = register(r, "s-a", "engine-a", a)
    r.publish(SessionId("s-a"), sa.id, [[key(i).hex(), i, 0] for i in range(4)])
    a.gens[2] = 1   # the holder handed block 2 out again
    assert r.match(NS, "x", [key(i) for i in range(4)])[1] == [(0, 0), (1, 0)]
    assert key(2) not in sa.index and 2 not in sa.key_of
    a.gens[2] = 0   # even back at the old value, the entry is gone: only a new publish counts
    assert len(r.match(NS, "x", [key(i) for i in range(4)])[1]) == 2


def test_nothing_is_answered_before_the_holder_attached(reg: Dict[str, object]) -> None:
    r: PeerRegistry = reg["reg"]  # type: ignore[assignment]
    a = Holder()
    a.attached = False
    sa = register(r, "s-a", "engine-a", a)
    r.publish(SessionId("s-a"), sa.id, [[key(0).hex(), 0, 0]])
    assert r.match(NS, "x", [key(0)]) == (None, [])
    a.attached = True
    assert r.match(NS, "x", [key(0)])[1] == [(0, 0)]


def test_a_block_republished_under_another_key_forgets_the_old_one(
        reg: Dict[str, object]) -> None:
    r: PeerRegistry = reg["reg"]  # type: ignore[assignment]
    a = Holder()
    sa = register(r, "s-a", "engine-a", a)
    r.publish(SessionId("s-a"), sa.id, [[key(0).hex(), 3, 0]])
    r.publish(SessionId("s-a"), sa.id, [[key(1).hex(), 3, 1]])
    assert sa.index == {key(1): (3, 1)} and sa.key_of == {3: key(1)}
    r.publish(SessionId("s-a"), sa.id, [[key(1).hex(), 5, 0]])   # moved to another block
    assert sa.index == {key(1): (5, 0)} and sa.key_of == {5: key(1)}


@pytest.mark.parametrize("entry", [
    ["zz", 0, 0], [key(0).hex(), N, 0], [key(0).hex(), -1, 0], [key(0).hex(), 0, -1],
    [key(0).hex(), 0], "x", [key(0).hex(), True, 0], ["", 0, 0]])
def test_a_bad_entry_changes_nothing(reg: Dict[str, object], entry: object) -> None:
    r: PeerRegistry = reg["reg"]  # type: ignore[assignment]
    sa = register(r, "s-a", "engine-a", Holder())
    with pytest.raises(InvalidArgument):
        r.publish(SessionId("s-a"), sa.id, [[key(1).hex(), 1, 0], entry])
    assert sa.index == {}


def test_publishing_needs_the_sessions_own_segment(reg: Dict[str, object]) -> None:
    r: PeerRegistry = reg["reg"]  # type: ignore[assignment]
    sa = register(r, "s-a", "engine-a", Holder())
    register(r, "s-b", "engine-b", Holder(), fd=20)
    with pytest.raises(NotFound):
        r.publish(SessionId("s-b"), sa.id, [[key(0).hex(), 0, 0]])
    with pytest.raises(NotFound):
        r.publish(SessionId("s-c"), sa.id, [])


@pytest.mark.parametrize("over, why", [
    ({"version": 99}, "version"), ({"num_blocks": 0}, "num_blocks"),
    ({"kv_bytes": KV + 1}, "kv_bytes"), ({"layers": [[0, LB]]}, "do not make blocks"),
    ({"layers": [[0, LB], [N * LB + 1, LB]]}, "past the segment"),
    ({"layers": [[0, LB // 2], [N * LB, LB]]}, "overlaps"),
    ({"num_blocks": N + 1}, "generation array")])
def test_a_bad_descriptor_is_refused(reg: Dict[str, object], over: Dict[str, object],
                                     why: str) -> None:
    r: PeerRegistry = reg["reg"]  # type: ignore[assignment]
    with pytest.raises(InvalidArgument, match=why):
        register(r, "s-a", "engine-a", Holder(), **over)
    assert r.segments == {} and reg["released"] == []


def test_a_session_keeps_one_segment_and_ending_releases_it(reg: Dict[str, object]) -> None:
    r: PeerRegistry = reg["reg"]  # type: ignore[assignment]
    released: List[Segment] = reg["released"]  # type: ignore[assignment]
    first = register(r, "s-a", "engine-a", Holder())
    second = register(r, "s-a", "engine-a", Holder(), fd=30)
    assert released == [first] and list(r.segments) == [second.id]
    assert r.get(NS, second.id) is second
    with pytest.raises(NotFound):
        r.get(OTHER_NS, second.id)
    with pytest.raises(NotFound):
        r.get(NS, first.id)
    register(r, "s-b", "engine-b", Holder(), fd=40)
    assert r.sweep(lambda sid: sid == "s-b") == 1
    assert released[-1] is second and [s.session for s in r.segments.values()] == ["s-b"]
    r.close()
    assert r.segments == {} and len(released) == 3
