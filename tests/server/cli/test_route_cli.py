"""`kvkeeper route --tokens FILE` and the client's routing helpers
(client/route.py) against a real daemon: keys from token ids as the
connector makes them, Locate as a table, WatchEvents resumed by EventStream
after the daemon restarts."""
from __future__ import annotations

import asyncio
import json
import queue
import threading
from typing import Any

import pytest

from kvkeeper.client import AsyncClient
from kvkeeper.client.keys import chain_keys, namespace_seed
from kvkeeper.client.route import Router, keys_for_tokens
from kvkeeper.server.app import create_server
from kvkeeper.server.cli.main import main

NS = {"model_id": "route-test", "block_tokens": 32, "block_bytes": 4096, "dtype": "float32"}


def test_keys_for_tokens_are_the_connectors_keys() -> None:
    tokens = list(range(100))
    want = chain_keys(namespace_seed(NS, cache_salt="s"), tokens, 32)
    assert keys_for_tokens(NS, tokens, cache_salt="s") == want and len(want) == 3
    assert keys_for_tokens(NS, tokens) != want            # the salt is in the seed
    with pytest.raises(ValueError, match="unknown namespace fields"):
        keys_for_tokens({**NS, "colour": "red"}, tokens)


async def engine(daemon: Any, tokens: list[int], blocks: int) -> tuple[Any, str]:
    """A session of NS whose engine reports the first `blocks` blocks of `tokens`."""
    c = await AsyncClient.connect(f"unix://{daemon.socket_path}", NS, instance_id="engine a")
    keys = keys_for_tokens(NS, tokens)[:blocks]
    resp, _ = await c.report_residency([("stored", keys)], capacity_blocks=16)
    return c, resp.engine


async def test_route_prints_the_engines_prefix(daemon: Any, tmp_path: Any, capsys: Any) -> None:
    tokens = list(range(1000, 1000 + 32 * 5))
    c, eng = await engine(daemon, tokens, 3)
    try:
        path = tmp_path / "tokens.json"
        path.write_text(json.dumps(tokens))
        url = f"unix://{daemon.socket_path}"
        code = await asyncio.to_thread(main, ["route", "--url", url, "--tokens", str(path)])
        out = capsys.readouterr().out
        assert code == 0, out
        row = next(line for line in out.splitlines() if eng in line)
        assert row.split()[:4] == ["gpu", eng, "3", str(3 * 32)]
        assert "5 full blocks of 32 tokens" in out
        code = await asyncio.to_thread(main, ["route", "--url", url, "--tokens", str(path),
                                              "--namespace", json.dumps(NS), "--json"])
        d = json.loads(capsys.readouterr().out)
        assert code == 0 and d["engines"][0]["prefix"] == 3 and d["keys"] == 5
        assert d["tiers"] == [{"tier": "host", "prefix": 0}]
        # `kvkeeper status` lists the engine's book.
        assert await asyncio.to_thread(main, ["status", "--url", url, "--json"]) == 0
        (e,) = json.loads(capsys.readouterr().out)["engines"]
        assert (e["engine"], e["resident_blocks"], e["resident_bytes"], e["capacity_blocks"]) == \
            (eng, 3, 3 * 4096, 16)
        assert await asyncio.to_thread(main, ["status", "--url", url]) == 0
        assert f"{eng} " in capsys.readouterr().out
        # Other tokens: a prefix nobody holds.
        path.write_text(" ".join(str(t) for t in range(32 * 2)))
        assert await asyncio.to_thread(main, ["route", "--url", url, "--tokens", str(path),
                                              "--json"]) == 0
        assert json.loads(capsys.readouterr().out)["engines"][0]["prefix"] == 0
    finally:
        await c.close()


async def test_route_refuses_bad_tokens_and_an_ambiguous_namespace(daemon: Any, tmp_path: Any,
                                                                   capsys: Any) -> None:
    url = f"unix://{daemon.socket_path}"
    bad = tmp_path / "bad"
    bad.write_text("1 2 three")
    assert await asyncio.to_thread(main, ["route", "--url", url, "--tokens", str(bad)]) == 2
    assert "not a JSON list" in capsys.readouterr().err
    good = tmp_path / "good"
    good.write_text("[1, 2, 3]")
    # No namespace registered: nothing to pick.
    assert await asyncio.to_thread(main, ["route", "--url", url, "--tokens", str(good)]) == 2
    assert "0 registered namespaces match" in capsys.readouterr().err


async def test_event_stream_resumes_after_a_restart_and_reports_the_gap(daemon_config: Any) -> None:
    config = daemon_config()
    d, _ = create_server(config)
    await d.start()
    url = f"unix://{d.socket_path}"
    got: "queue.Queue[Any]" = queue.Queue()
    router = Router.connect(url)
    stream = router.watch(reconnect_s=0.05)

    def read() -> None:
        try:
            for msg in stream:
                got.put(msg)
        except Exception as e:  # noqa: BLE001 - handed to the test
            got.put(e)

    t = threading.Thread(target=read, daemon=True)
    t.start()
    try:
        head = await asyncio.to_thread(got.get, True, 10)
        assert not head.HasField("gap")
        c = await AsyncClient.connect(url, NS)
        await c.report_residency([("stored", keys_for_tokens(NS, range(64)))], capacity_blocks=8)
        msg = await asyncio.to_thread(got.get, True, 10)
        assert [e.seq for e in msg.events] == [1] and stream.last_seq == 1
        await c.close()
        msg = await asyncio.to_thread(got.get, True, 10)   # its session ended: cleared
        assert [e.seq for e in msg.events] == [2]
        await d.stop(0)
        d, _ = create_server(config)
        await d.start()
        msg = await asyncio.to_thread(got.get, True, 20)
        assert not isinstance(msg, Exception), msg
        assert msg.gap.restarted and msg.epoch != head.epoch and stream.reconnects >= 1
    finally:
        stream.cancel()
        router.close()
        await d.stop(0)
        t.join(5)
