"""One TP rank's worker side in a process of its own, for the TP test
(test_connector_tp_ranks.py): a WorkerSide with its own KV tensors (a shard
of its own: seeded by its rank) and daemon session, driven through a pipe."""
from __future__ import annotations

import time
from typing import Any, Dict

BS = 32
NUM_BLOCKS = 12


def layout() -> Any:
    from kvkeeper.connector.layout import KVLayout

    return KVLayout(layer_names=("l0", "l1"), num_heads=2, block_tokens=BS, content_bytes=256,
                    dtype="float32", physical="LBHNC", spec_kind="FullAttentionSpec")


def namespace(rank: int, tp: int) -> Dict[str, Any]:
    lay = layout()
    return {"model_id": "tp-test", "model_revision": "", "dtype": "float32",
            "kv_layout": lay.layout_string(), "block_tokens": BS, "block_bytes": lay.block_bytes,
            "tp_rank": rank, "tp_size": tp}


def serve(conn: Any, url: str, rank: int, tp: int) -> None:
    """Answer ("save", meta) -> flushed, ("load", meta) -> (block ids to
    recompute, worker metadata), ("blocks", ids) -> their bytes, ("exit", _)."""
    import torch

    from kvkeeper.connector.blocks import BlockCodec
    from kvkeeper.connector.config import ConnectorConfig
    from kvkeeper.connector.link import DaemonLink
    from kvkeeper.connector.worker import WorkerSide

    g = torch.Generator().manual_seed(1000 + rank)
    kv = {n: torch.randn(NUM_BLOCKS, 2, BS, 64, generator=g) for n in ("l0", "l1")}
    link = DaemonLink(url, namespace(rank, tp), instance_id=f"tp-test rank {rank}", timeout=5.0)
    w = WorkerSide(ConnectorConfig(url=url), layout(), rank, link)
    w.register_kv_caches(kv, NUM_BLOCKS)
    codec = BlockCodec(layout(), kv, NUM_BLOCKS)
    deadline = time.monotonic() + 30
    while True:   # connected (register_kv_caches connects in the background)
        try:
            link.call(lambda c: None, "connect")
            break
        except Exception:  # noqa: BLE001
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)
    conn.send("ready")
    while True:
        cmd, arg = conn.recv()
        if cmd == "save":
            w.wait_for_save(arg)
            w.copy_out_for({s.req_id for s in arg.saves})
            conn.send(w.flush(10.0))
        elif cmd == "load":
            w.start_load_kv(arg)
            conn.send((w.take_load_errors(), w.build_worker_meta()))
        elif cmd == "blocks":
            rows = codec.new_rows(len(arg))
            codec.gather(list(arg), rows)
            conn.send([bytes(rows[i].numpy()) for i in range(len(arg))])
        else:
            w.shutdown()
            conn.send("bye")
            return
