"""clip() keeps client values short in messages and logs; cap() bounds a whole message."""
from __future__ import annotations

from kvkeeper.server.quoting import LIMIT, cap, clip


def test_short_values_are_quoted_whole() -> None:
    assert clip("abc") == "'abc'"
    assert clip(b"\x01\x02") == "0102"
    assert clip(7) == "7"


def test_long_values_are_cut_and_their_length_said() -> None:
    out = clip("y" * 20000)
    assert out.startswith("'yyy") and out.endswith("… (20000 chars)")
    assert len(out) <= LIMIT + 20
    assert clip(bytes(5000)).endswith("… (5000 bytes)")


def test_cap_bounds_a_whole_message() -> None:
    assert cap("x" * 10) == "x" * 10
    out = cap("x" * 50000)
    assert len(out) < 1100 and out.endswith("of 50000 chars)")
