"""LoadTimings, the worker's observation point: only the phases measured are
reported, and a phase measured in pieces adds up (pure Python, no torch)."""
from __future__ import annotations

from kvkeeper.connector.load.timings import LoadTimings


def test_only_measured_phases_are_reported() -> None:
    t = LoadTimings(fetch=0.5)
    t.copy = 0.0   # measured, if instantly
    assert t.as_dict() == {"fetch": 0.5, "copy": 0.0}
    assert LoadTimings().as_dict() == {}


def test_a_phase_measured_in_pieces_adds_up() -> None:
    t = LoadTimings()
    t.add("layer_wait", 0.25)
    t.add("layer_wait", 0.5)
    assert t.as_dict() == {"layer_wait": 0.75}
