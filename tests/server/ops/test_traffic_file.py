"""The traffic file (server/ops/traffic_file.py): off by default, a bad path
refuses the start naming the key, lines written by a thread and on close."""
from __future__ import annotations

import json
import os

import pytest

from kvkeeper.server.config import ConfigError, load_config
from kvkeeper.server.ops.traffic import NO_TRAFFIC
from kvkeeper.server.ops.traffic_file import (KEYS, NoTrafficFile, TrafficFile, open_traffic,
                                               reload_traffic)


class Ledger:
    sessions = {"s": type("S", (), {"ns": type("N", (), {"id": b"ns1"})()})()}


def config(**kw):
    return load_config(None, env={}, overrides={f"ledger.{k}": v for k, v in kw.items()})


def test_off_by_default_it_records_nothing():
    t = open_traffic(config(), Ledger())
    assert isinstance(t, NoTrafficFile) and t.recorder is NO_TRAFFIC
    t.tick(0.0)
    t.close()


def test_a_path_that_cannot_be_written_refuses_the_start(tmp_path):
    with pytest.raises(ConfigError, match="ledger.traffic_file") as info:
        open_traffic(config(traffic_file=os.path.join(str(tmp_path), "no", "t.jsonl")), Ledger())
    assert info.value.key == "ledger.traffic_file" and "cannot record traffic" in str(info.value)


def test_lines_reach_the_file_on_ticks_and_on_close_and_a_restart_appends(tmp_path):
    path = os.path.join(str(tmp_path), "t.jsonl")
    t = open_traffic(config(traffic_file=path, traffic_requests=3), Ledger())
    assert isinstance(t, TrafficFile)
    t.recorder.match("s", [b"a" * 8], 1, 0.0)
    t.recorder.match("s", [b"b" * 8], 2, 0.0)
    t.tick(1e9)                                   # both idle: to the writer thread
    t.recorder.match("s", [b"c" * 8], 3, 1e9)     # open until close
    t.recorder.match("s", [b"d" * 8], 4, 1e9)     # past traffic_requests: not recorded
    t.close()
    t.close()                                     # twice: nothing more
    with open(path) as fh:
        got = [json.loads(x)["keys"] for x in fh]
    assert got == [[(c * 8).hex()] for c in (b"a", b"b", b"c")]
    again = TrafficFile(path, 1, lambda sid: "ns1")
    again.recorder.match("s", [b"e" * 8], 5, 0.0)
    again.close()                                 # no tick: written on close, appended
    with open(path) as fh:
        assert len(fh.readlines()) == 4


class Plan:
    def __init__(self, applied):
        self.applied = list(applied)


def wait_lines(path, n, timeout=10.0):
    import time
    deadline = time.monotonic() + timeout
    while True:
        with open(path) as fh:
            got = fh.readlines()
        if len(got) >= n or time.monotonic() > deadline:
            return got
        time.sleep(0.01)


def test_a_reload_turns_recording_on_moves_it_and_turns_it_off(tmp_path):
    first, second = (os.path.join(str(tmp_path), n) for n in ("a.jsonl", "b.jsonl"))
    off = config()
    t = open_traffic(off, Ledger())
    same, cfg = reload_traffic(t, off, config(), Ledger(), Plan([]))
    assert same is t and cfg == config()
    on = config(traffic_file=first)
    t1, cfg = reload_traffic(t, off, on, Ledger(), Plan(KEYS[:1]))
    assert isinstance(t1, TrafficFile) and cfg.ledger.traffic_file == first
    t1.recorder.match("s", [b"a" * 8], 1, 0.0)            # open when the file moves
    moved = config(traffic_file=second, traffic_requests=5)
    t2, cfg = reload_traffic(t1, on, moved, Ledger(), Plan(KEYS))
    assert isinstance(t2, TrafficFile) and t2.recorder.limit == 5
    assert [json.loads(x)["ns"] for x in wait_lines(first, 1)] == ["6e7331"]   # closed, written
    t2.recorder.match("s", [b"b" * 8], 1, 0.0)
    t3, cfg = reload_traffic(t2, moved, off, Ledger(), Plan(KEYS))
    assert isinstance(t3, NoTrafficFile) and cfg.ledger.traffic_file == ""
    assert len(wait_lines(second, 1)) == 1


def test_a_reload_to_a_path_that_cannot_be_written_keeps_the_running_file(tmp_path):
    path = os.path.join(str(tmp_path), "a.jsonl")
    on = config(traffic_file=path)
    t = open_traffic(on, Ledger())
    bad = config(traffic_file=os.path.join(str(tmp_path), "no", "b.jsonl"), traffic_requests=9)
    plan = Plan(["server.log_level", *KEYS])
    kept, cfg = reload_traffic(t, on, bad, Ledger(), plan)
    assert kept is t and plan.applied == ["server.log_level"]
    assert (cfg.ledger.traffic_file, cfg.ledger.traffic_requests) == (path, 100000)
    t.recorder.match("s", [b"a" * 8], 1, 0.0)
    t.close()
    assert len(wait_lines(path, 1)) == 1
