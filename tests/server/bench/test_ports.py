"""Free ports outside the kernel's ephemeral range, so no outgoing connection
takes one as its source port before the server it was chosen for binds it."""
from __future__ import annotations

import pytest

from kvkeeper.server.bench import ports
from kvkeeper.server.bench.ports import NoFreePort, ephemeral_range, free_port


def test_ports_lie_outside_the_ephemeral_range_with_their_pair() -> None:
    lo, hi = ephemeral_range()
    assert lo <= hi
    for _ in range(50):
        p = free_port()
        assert not lo <= p <= hi and p >= ports.PORT_FLOOR and ports.bindable(p)
        b = free_port(10000)
        assert not lo <= b <= hi and not lo <= b + 10000 <= hi and b + 10000 <= 65535
        assert ports.bindable(b) and ports.bindable(b + 10000)


def test_a_taken_port_is_not_chosen(monkeypatch: pytest.MonkeyPatch) -> None:
    # Only one port is outside the range, and it is taken: a clear error.
    monkeypatch.setattr(ports, "ephemeral_range", lambda: (ports.PORT_FLOOR + 1, 65535))
    monkeypatch.setattr(ports, "bindable", lambda p: False)
    lo = ports.PORT_FLOOR + 1
    with pytest.raises(NoFreePort, match=f"outside the ephemeral range {lo}-65535"):
        free_port()


def test_no_port_left_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ports, "ephemeral_range", lambda: (1, 65535))
    with pytest.raises(NoFreePort, match="port pair outside the ephemeral range 1-65535"):
        free_port(10000)
