"""KVKeeperConnector never takes vLLM down once it runs: unsupported layouts, a
missing daemon and exceptions inside hooks become "disabled" / "miss" /
"recompute". Only an invalid configuration stops vLLM, at start-up."""
from __future__ import annotations

import logging
import time
from types import SimpleNamespace

import pytest

from connector_harness import vllm_unavailable
from kvkeeper.connector.config import ConnectorConfig

vllm_only = pytest.mark.skipif(vllm_unavailable() is not None, reason=vllm_unavailable() or "")


def test_config_parsing() -> None:
    c = ConnectorConfig.from_extra({"kvkeeper_url": "unix:///s", "kvkeeper_report": "true",
                                    "kvkeeper_max_pending_save_mib": 8}, "kv_consumer", env={})
    assert c.url == "unix:///s" and c.report and c.load and not c.save
    assert c.max_pending_save_bytes == 8 << 20
    assert ConnectorConfig.from_extra({}, None, env={"KVKEEPER_URL": "h:1"}).url == "h:1"
    producer = ConnectorConfig.from_extra({"kvkeeper_url": "h:1"}, "kv_producer", env={})
    assert producer.save and not producer.load
    for bad, why in (({}, "kvkeeper_url"),
                     ({"kvkeeper_url": "h:1", "kvkeeper_transpor": "shm"}, "unknown"),
                     ({"kvkeeper_url": "h:1", "kvkeeper_transport": "rdma"}, "transport"),
                     ({"kvkeeper_url": "h:1", "kvkeeper_lookup_timeout_s": 0}, "timeout"),
                     ({"kvkeeper_url": "h:1", "kvkeeper_report": "maybe"}, "report")):
        with pytest.raises(ValueError, match=why):
            ConnectorConfig.from_extra(bad, None, env={})


def fake_vllm_config(extra: dict, policy: str = "fail", groups: int = 1):
    import torch

    spec = SimpleNamespace(num_heads=2, block_size=32, dtype=torch.float32, tokens_per_state=1,
                           state_content_size_bytes=256)
    group = SimpleNamespace(layer_names=["l0", "l1"], kv_cache_spec=spec, enable_kv_transfer=True)
    kvc = SimpleNamespace(num_blocks=8, kv_cache_groups=[group] * groups, kv_cache_layout="LBHNC",
                          prefix_cacheable_group_ids=(0,))
    ktc = SimpleNamespace(kv_connector="KVKeeperConnector", kv_role="kv_both",
                          kv_connector_extra_config=extra, kv_load_failure_policy=policy,
                          engine_id="e", is_kv_producer=True)
    vc = SimpleNamespace(
        kv_transfer_config=ktc,
        model_config=SimpleNamespace(model="m", revision=None, quantization=None),
        cache_config=SimpleNamespace(block_size=32, cache_dtype="auto", kv_cache_layout="LBHNC"),
        parallel_config=SimpleNamespace(tensor_parallel_size=1, pipeline_parallel_size=1,
                                        decode_context_parallel_size=1,
                                        prefill_context_parallel_size=1))
    return vc, kvc


def request(tokens):
    return SimpleNamespace(request_id="r", all_token_ids=tokens, num_tokens=len(tokens),
                           num_computed_tokens=0, cache_salt=None, lora_request=None,
                           mm_features=[], prompt_embeds=None)


@vllm_only
@pytest.mark.parametrize("role", ["SCHEDULER", "WORKER"])
@pytest.mark.parametrize("extra,names", [
    ({}, "kvkeeper_url"),
    ({"kvkeeper_url": "unix:///s", "kvkeeper_tranport": "shm"}, "kvkeeper_tranport"),
    ({"kvkeeper_url": "http://h:1"}, "kvkeeper_url"),
    ({"kvkeeper_url": "unix:///s", "kvkeeper_io_timeout_s": "soon"}, "kvkeeper_io_timeout_s"),
], ids=["missing-url", "unknown-key", "bad-url", "bad-value"])
def test_invalid_config_raises_from_the_constructor(role: str, extra: dict, names: str,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM creates the connector while it starts (scheduler and workers) and
    does not catch what the constructor raises: the engine does not start."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from kvkeeper.connector import KVKeeperConnector
    from kvkeeper.connector.config import ConfigError

    monkeypatch.delenv("KVKEEPER_URL", raising=False)
    vc, kvc = fake_vllm_config(extra)
    with pytest.raises(ConfigError, match=names):
        KVKeeperConnector(vc, getattr(KVConnectorRole, role), kvc)


@vllm_only
def test_scheduler_turns_load_failures_into_recomputes() -> None:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from kvkeeper.connector import KVKeeperConnector

    vc, kvc = fake_vllm_config({"kvkeeper_url": "unix:///nowhere.sock"})
    c = KVKeeperConnector(vc, KVConnectorRole.SCHEDULER, kvc)
    assert vc.kv_transfer_config.kv_load_failure_policy == "recompute"
    c.shutdown()
    vc, kvc = fake_vllm_config({"kvkeeper_url": "unix:///nowhere.sock",
                                "kvkeeper_recompute_on_load_failure": False})
    KVKeeperConnector(vc, KVConnectorRole.SCHEDULER, kvc).shutdown()
    assert vc.kv_transfer_config.kv_load_failure_policy == "fail"


@vllm_only
def test_unsupported_layout_disables_and_no_daemon_is_a_miss() -> None:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from kvkeeper.connector import KVKeeperConnector

    vc, kvc = fake_vllm_config({"kvkeeper_url": "unix:///nowhere.sock"}, groups=2)
    assert KVKeeperConnector(vc, KVConnectorRole.SCHEDULER, kvc).scheduler_side is None
    vc, kvc = fake_vllm_config({"kvkeeper_url": "unix:///nowhere.sock"})
    c = KVKeeperConnector(vc, KVConnectorRole.SCHEDULER, kvc)
    try:
        r = request(list(range(100)))
        # The lookup runs off the scheduler's thread: "pending" (None) until
        # the failed connect lands, then a miss (bounded by the lookup timeout).
        deadline = time.monotonic() + 30
        while (got := c.get_num_new_matched_tokens(r, 0)) == (None, False):
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert got == (0, False)
        assert c.get_kv_connector_stats().data["lookup_errors"] == 1
    finally:
        c.shutdown()


@vllm_only
def test_exceptions_in_hooks_become_safe_answers(caplog: pytest.LogCaptureFixture) -> None:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from kvkeeper.connector import KVKeeperConnector
    from kvkeeper.connector.metadata import KVKeeperConnectorMetadata, LoadSpec

    vc, kvc = fake_vllm_config({"kvkeeper_url": "unix:///nowhere.sock"})
    s = KVKeeperConnector(vc, KVConnectorRole.SCHEDULER, kvc)

    def boom(*a, **k):
        raise RuntimeError("bug")

    s.scheduler_side.get_num_new_matched_tokens = boom
    s.scheduler_side.request_finished = boom
    with caplog.at_level(logging.ERROR, logger="kvkeeper.connector"):
        assert s.get_num_new_matched_tokens(request(list(range(100))), 0) == (0, False)
        assert s.request_finished(request([]), []) == (False, None)
    assert "get_num_new_matched_tokens failed" in caplog.text
    s.shutdown()

    # A worker whose side is broken still reports planned loads as failed,
    # so vLLM recomputes them instead of reading whatever the blocks hold.
    vc, kvc = fake_vllm_config({"kvkeeper_url": "unix:///nowhere.sock"},
                               groups=2)  # an unsupported layout: a disabled worker
    w = KVKeeperConnector(vc, KVConnectorRole.WORKER, kvc)
    w.bind_connector_metadata(KVKeeperConnectorMetadata(
        loads=[LoadSpec("r", ((b"k" * 32,) * 2,), (3, 4), load_id=9)]))
    w.start_load_kv(None)
    assert w.get_block_ids_with_load_errors() == {3, 4}
    assert w.build_connector_worker_meta().loads_done == {9: {0: (0, ())}}
    w.wait_for_save()
    w.clear_connector_metadata()
    w.worker_side.start_load_kv = boom
    w.bind_connector_metadata(KVKeeperConnectorMetadata(
        loads=[LoadSpec("r", ((b"k" * 32,),), (5,), load_id=10)]))
    w.start_load_kv(None)
    assert w.get_block_ids_with_load_errors() == {5}


@vllm_only
def test_a_request_that_saved_keeps_its_blocks_until_the_workers_answer() -> None:
    """request_finished returns True for a request with saves; the next step's
    metadata names it; the worker answers it in get_finished that very step,
    even a worker whose side is disabled (vLLM would keep the blocks forever)."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from kvkeeper.connector import KVKeeperConnector
    from kvkeeper.connector.metadata import KVKeeperConnectorMetadata, SaveSpec

    vc, kvc = fake_vllm_config({"kvkeeper_url": "unix:///nowhere.sock"})
    s = KVKeeperConnector(vc, KVConnectorRole.SCHEDULER, kvc)
    planned = KVKeeperConnectorMetadata(saves=[SaveSpec("r", ((b"k" * 32,),), (3,))])
    s._build_meta = lambda so: planned
    so = SimpleNamespace(preempted_req_ids={"p"})
    meta1 = s.build_connector_meta(so)
    assert meta1.preempted == {"p"} and meta1.free_after_save == set()
    s._build_meta = lambda so: KVKeeperConnectorMetadata()
    other = request([])
    other.request_id = "q"
    assert s.request_finished(other, [])[0] is False, "no saves: freed at once"
    assert s.request_finished(request([]), [])[0] is True
    meta2 = s.build_connector_meta(SimpleNamespace(preempted_req_ids=None))
    assert meta2.free_after_save == {"r"} and meta2.preempted == set()
    assert s.build_connector_meta(SimpleNamespace()).free_after_save == set(), "named once"
    s.shutdown()

    # an unsupported layout: a disabled worker still answers
    vc, kvc = fake_vllm_config({"kvkeeper_url": "unix:///nowhere.sock"}, groups=2)
    w = KVKeeperConnector(vc, KVConnectorRole.WORKER, kvc)
    w.bind_connector_metadata(meta2)
    w.handle_preemptions(meta2)
    assert w.get_finished({"r"}) == ({"r"}, None)
    w.clear_connector_metadata()
    w.bind_connector_metadata(KVKeeperConnectorMetadata())
    assert w.get_finished(set()) == (None, None)


@vllm_only
def test_a_failing_finish_still_keeps_the_blocks_of_a_request_with_saves() -> None:
    """request_finished of a request whose saves may still be copying answers
    True (delay the free) even when the scheduler side's own bookkeeping
    raises: freed blocks could be handed to another request mid-copy."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from kvkeeper.connector import KVKeeperConnector
    from kvkeeper.connector.metadata import KVKeeperConnectorMetadata, SaveSpec

    vc, kvc = fake_vllm_config({"kvkeeper_url": "unix:///nowhere.sock"})
    s = KVKeeperConnector(vc, KVConnectorRole.SCHEDULER, kvc)
    s._build_meta = lambda so: KVKeeperConnectorMetadata(saves=[SaveSpec("r", ((b"k" * 32,),),
                                                                         (3,))])
    s.build_connector_meta(SimpleNamespace(preempted_req_ids=None))

    def boom(*a, **k):
        raise RuntimeError("bug")
    s.scheduler_side.request_finished = boom
    assert s.request_finished(request([]), []) == (True, None)
    s._build_meta = lambda so: KVKeeperConnectorMetadata()
    assert s.build_connector_meta(SimpleNamespace()).free_after_save == {"r"}
    s.shutdown()


@vllm_only
def test_a_failing_error_report_fails_every_block_the_step_loaded() -> None:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from kvkeeper.connector import KVKeeperConnector
    from kvkeeper.connector.metadata import KVKeeperConnectorMetadata, LoadSpec

    vc, kvc = fake_vllm_config({"kvkeeper_url": "unix:///nowhere.sock"}, groups=2)
    w = KVKeeperConnector(vc, KVConnectorRole.WORKER, kvc)

    def boom(*a, **k):
        raise RuntimeError("bug")
    w.worker_side.take_load_errors = boom
    w.bind_connector_metadata(KVKeeperConnectorMetadata(
        loads=[LoadSpec("r", ((b"k" * 32,) * 2,), (3, 4), load_id=9),
               LoadSpec("q", ((b"k" * 32,),), (7,), load_id=10)]))
    assert w.get_block_ids_with_load_errors() == {3, 4, 7}
    w.clear_connector_metadata()
    assert w.get_block_ids_with_load_errors() == set()   # nothing bound: nothing loaded
