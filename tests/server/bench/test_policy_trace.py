"""The policy benchmark's traces (server/bench/policy_trace.py): seeded, chained,
shaped by the mix; the file format round-trips and bad files are refused."""
from __future__ import annotations

import json

import pytest

from kvkeeper.server.bench.policy_trace import (MIXES, Request, TraceError, generate, read_trace,
                                               reread_working_set, write_trace)


def test_three_named_mixes_and_a_seeded_generator():
    assert {"chat-heavy", "rag-heavy", "scan-heavy"} <= set(MIXES)
    mix = MIXES["chat-heavy"].scaled(200)
    a, b = generate(mix, seed=3), generate(mix, seed=3)
    assert a == b and len(a) == 200
    assert generate(mix, seed=4) != a


@pytest.mark.parametrize("name", sorted(MIXES))
def test_requests_are_chains_with_shared_prefixes(name):
    reqs = generate(MIXES[name].scaled(300), seed=1)
    for r in reqs:
        assert 0 < r.prompt_blocks < len(r.keys)          # decode blocks follow the prompt
        assert len(set(r.keys)) == len(r.keys) and {len(k) for k in r.keys} == {32}
    # Every request starts with one of the system prompts: shared first keys.
    firsts = {r.keys[0] for r in reqs}
    assert len(firsts) <= MIXES[name].system_prompts
    assert 0 < reread_working_set(reqs) < len({k for r in reqs for k in r.keys})


def test_a_conversation_turn_extends_the_previous_turn_whole():
    reqs = generate(MIXES["chat-heavy"].scaled(300), seed=1)
    by_chain = {r.keys: r for r in reqs}
    extended = sum(1 for r in reqs for other in by_chain
                   if len(other) < r.prompt_blocks and r.keys[:len(other)] == other)
    assert extended > 20       # answers included: the next prompt starts with the whole chain


def test_scan_heavy_reads_more_one_off_blocks_than_chat_heavy():
    def one_off_share(name):
        reqs = generate(MIXES[name].scaled(400), seed=1)
        looked = sum(r.prompt_blocks for r in reqs)
        return 1 - reread_working_set(reqs) / looked
    assert one_off_share("scan-heavy") > one_off_share("chat-heavy")


def test_a_conversations_last_turn_is_marked_and_never_extended():
    reqs = generate(MIXES["chat-heavy"].scaled(400), seed=1)
    chains = {r.keys for r in reqs}
    extends = {other for r in reqs for other in chains
               if len(other) < r.prompt_blocks and r.keys[:len(other)] == other}
    last = [r for r in reqs if r.last_turn]
    assert len(last) > 20 and not any(r.keys in extends for r in last)
    # Turns not marked are continued (all but those still open when the trace ends).
    unmarked_turns = [r for r in reqs if not r.last_turn and r.keys in extends]
    assert len(unmarked_turns) > len(last)
    # A one-off request (no conversation) is never marked: its first block is a
    # system prompt's and its chain is not extended, whatever the mix.
    rag = generate(MIXES["rag-heavy"].scaled(400), seed=1)
    assert sum(r.last_turn for r in rag) < sum(1 for r in rag if r.keys not in extends)


@pytest.mark.parametrize("mix", ["rag-heavy", "chat-heavy"])
def test_the_file_format_round_trips(tmp_path, mix):
    reqs = generate(MIXES[mix].scaled(80), seed=2)
    path = str(tmp_path / "t.jsonl")
    write_trace(reqs, path)
    lines = [json.loads(x) for x in open(path)]
    assert set(lines[0]) <= {"keys", "prompt_blocks", "last_turn"}
    assert isinstance(lines[0]["keys"][0], str)
    assert sum("last_turn" in x for x in lines) == sum(r.last_turn for r in reqs)
    assert read_trace(path) == reqs


@pytest.mark.parametrize("line, why", [
    ("not json", "not a request line"),
    ('{"keys": ["00ff"]}', "not a request line"),
    ('{"keys": ["zz"], "prompt_blocks": 1}', "not a request line"),
    ('{"keys": ["00ff"], "prompt_blocks": 2}', "must be in 1..1"),
    ('{"keys": ["00ff", "00"], "prompt_blocks": 1}', "different lengths"),
    ('{"keys": ["00ff"], "prompt_blocks": 1, "last_turn": "yes"}', "last_turn is 'yes'"),
    ('{"keys": ["00ff"], "prompt_blocks": 1, "last_turn": 1}', "last_turn is 1"),
    ('{"keys": ["00ff"], "prompt_blocks": 1, "ns": 7}', "ns is 7"),
])
def test_a_bad_trace_names_its_line(tmp_path, line, why):
    path = tmp_path / "t.jsonl"
    path.write_text('{"keys": ["00ff"], "prompt_blocks": 1}\n' + line + "\n")
    with pytest.raises(TraceError, match=why) as info:
        read_trace(str(path))
    assert ":2:" in str(info.value)
    empty = tmp_path / "e.jsonl"
    empty.write_text("\n")
    with pytest.raises(TraceError, match="no requests"):
        read_trace(str(empty))


def test_request_is_a_plain_record():
    assert Request((b"a",), 1) == Request((b"a",), 1)


def test_a_mix_changed_from_text():
    mix = MIXES["scan-heavy"]
    changed = mix.changed({"turn_gap": "80", "scan_blocks": "32:128", "requests": "10"})
    assert (changed.turn_gap, changed.scan_blocks, changed.requests) == (80.0, (32, 128), 10)
    assert changed.chat == mix.chat and changed.name == mix.name
    for bad, what in ((("nope", "1"), "does not exist"), (("turn_gap", "x"), "not a float"),
                      (("scan_blocks", "1:2:3"), "LOW:HIGH"), (("name", "x"), "does not exist")):
        with pytest.raises(ValueError, match=what):
            mix.changed(dict([bad]))
