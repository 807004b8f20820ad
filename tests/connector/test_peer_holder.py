"""PeerHolder without a daemon: the generation published is the one read when
the block was noted (not when it is sent), a segment the daemon forgot is
registered again, and a new session registers again."""
from __future__ import annotations

import os
from typing import Any, List, Tuple

import pytest

pytest.importorskip("torch", reason="torch is not installed (it comes with vllm)")

from kvkeeper.client.peer import PeerError  # noqa: E402
from kvkeeper.client.peer_wire import ERR_NOT_FOUND  # noqa: E402
from kvkeeper.connector.io_thread import IoThread  # noqa: E402
from kvkeeper.connector.peer.gens import Generations  # noqa: E402
from kvkeeper.connector.peer.holder import PeerHolder  # noqa: E402
from kvkeeper.connector.peer.share import SharedKV  # noqa: E402


class FakeLink:
    def __init__(self) -> None:
        self.sid = "s-1"

    def session_id(self) -> str:
        return self.sid

    def call(self, fn: Any, what: str) -> Any:
        raise AssertionError("connected already")


class FakeClient:
    def __init__(self) -> None:
        self.registered: List[Tuple[str, str]] = []
        self.published: List[Tuple[str, str, list]] = []
        self.forget_next = False

    def register(self, session: str, engine: str, desc: Any, kv_fd: int, gens_fd: int) -> str:
        self.registered.append((session, engine))
        return f"seg-{len(self.registered)}"

    def publish(self, session: str, segment: str, blocks: list) -> int:
        if self.forget_next:
            self.forget_next = False
            raise PeerError(ERR_NOT_FOUND, "forgotten")
        self.published.append((session, segment, list(blocks)))
        return len(blocks)

    def close(self) -> None:
        pass


def test_notes_publish_the_generation_read_when_noted(tmp_path: Any) -> None:
    gens, fd = Generations.open_named(str(tmp_path / "g"), 8)
    client, link, io = FakeClient(), FakeLink(), IoThread(None)
    h = PeerHolder(link, client, io, "engine-x", SharedKV(-1, 0, 0),  # type: ignore[arg-type]
                   {"num_blocks": 8}, gens, fd)
    try:
        h.start()
        assert h.flush(5) and client.registered == [("s-1", "engine-x")]
        gens.bump([3])
        h.note([b"k" * 32], [3])
        gens.bump([3])            # reused after the note: what was noted is still g=1
        assert h.flush(5)
        assert client.published[-1] == ("s-1", "seg-1", [(b"k" * 32, 3, 1)])
        client.forget_next = True          # the daemon restarted: register, publish again
        h.note([b"j" * 32], [4])
        assert h.flush(5)
        assert client.registered[-1] == ("s-1", "engine-x")
        assert client.published[-1] == ("s-1", "seg-2", [(b"j" * 32, 4, 0)])
        link.sid = "s-2"                   # a new session: its own registration
        h.note([b"i" * 32], [5])
        assert h.flush(5)
        assert client.published[-1][:2] == ("s-2", "seg-3") and h.published == 3
    finally:
        io.shutdown()
        gens.close()
        os.close(fd)


def test_blocks_computed_over_a_failed_load_are_not_published(tmp_path: Any) -> None:
    """A step that loads and computes: the computed blocks attend to the loaded
    ones, so after a failed load they may be wrong KV until vLLM recomputes them
    in place (no generation bump): peers must not be offered them."""
    from kvkeeper.connector.metadata import KVKeeperConnectorMetadata, LoadSpec, SaveSpec
    from kvkeeper.connector.peer.worker import WorkerPeer
    from kvkeeper.connector.worker import WorkerSide

    gens, fd = Generations.open_named(str(tmp_path / "g"), 16)
    gens.attach()
    client, io = FakeClient(), IoThread(None)
    h = PeerHolder(FakeLink(), client, io, "eng", SharedKV(-1, 0, 0),  # type: ignore[arg-type]
                   {"num_blocks": 16}, gens, fd)
    try:
        h.start()
        assert h.flush(5)

        class Source:
            def trim(self) -> None:
                pass
        peer = WorkerPeer.__new__(WorkerPeer)
        peer.holder, peer.source, peer._rank = h, Source(), 0
        w = WorkerSide(None, None, 0, None)
        w.peer = peer
        load = LoadSpec("r", ((b"a" * 32, b"b" * 32, b"c" * 32),), (10, 11, 12), load_id=7)
        w._results.finish(load, 1)   # 1 of 3 loaded: vLLM recomputes from block 11
        w.wait_for_save(KVKeeperConnectorMetadata(saves=[
            SaveSpec("r", ((b"d" * 32,),), (13,), after_loads=(7,)),
            SaveSpec("q", ((b"e" * 32,),), (14,))]))   # another request's, no load
        assert h.flush(5)
        published = [k for (_, _, entries) in client.published for k, _, _ in entries]
        assert published == [b"e" * 32]
    finally:
        io.shutdown()
