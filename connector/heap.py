"""freeze_heap: the worker process's start-up heap kept out of garbage collections.

A full collection scans every tracked object: in a vLLM worker (torch,
vLLM, the model, the connector) tens to hundreds of milliseconds, inside
whichever request's load happens to trigger it (issue 12: steady, not
lucky). vLLM's GPU worker freezes its heap after its warm-up itself
(vllm.utils.gc_utils.freeze_gc_heap); its CPU worker does not. The
connector freezes it once the KV cache is registered, the last step of the
worker's start-up, unless something froze it already. Objects made later
(requests' own) stay collectable.
"""
from __future__ import annotations

import gc

__all__ = ["freeze_heap"]


def freeze_heap() -> bool:
    """Collect, then freeze everything alive now, unless the process has a
    frozen heap already; whether it froze."""
    if gc.get_freeze_count():
        return False
    gc.collect()
    gc.freeze()
    return True
