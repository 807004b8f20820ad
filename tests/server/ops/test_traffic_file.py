"""The traffic file (server/ops/traffic_file.py): off by default, a bad path
refuses the start naming the key, lines written by a thread and on close."""
from __future__ import annotations

import json
import os

import pytest

from kvkeeper.server.config import ConfigError, load_config
from kvkeeper.server.ops.traffic import NO_TRAFFIC
from kvkeeper.server.ops.traffic_file import NoTrafficFile, TrafficFile, open_traffic


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
