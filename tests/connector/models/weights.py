"""Seeded weights at a trained model's scale for any architecture of archs.py.

vLLM's dummy weights are so small that attention barely moves the residual
stream: the output would not depend on the cached KV and no test could tell
loaded KV from garbage (see tiny_llama.py). Here transformers builds the
model from its config, every matrix is redrawn from a seeded normal
distribution scaled by 1/sqrt(fan-in) (embeddings at unit variance), and
everything else (norms, biases, SSM parameters) keeps transformers' own
initialisation. save_pretrained writes the checkpoint in the format vLLM
loads; config.json is written last, as given, so the model's identity is
the same in every process.
"""
from __future__ import annotations

import json
import os
from typing import Any, Dict

__all__ = ["write_model"]

# Parameters that are not weight matrices although they are 2-d: SSM decay
# rates and the like, whose initialisation is not a matter of scale.
_KEEP = ("A_log", "dt_bias", ".D", "conv1d")


def write_model(path: str, config: Dict[str, Any], seed: int = 1234) -> str:
    """A checkpoint of `config` with seeded weights in directory `path`."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    os.makedirs(path, exist_ok=True)
    cfg_path = os.path.join(path, "config.json")
    torch.manual_seed(seed)
    hf_cfg = AutoConfig.for_model(**config)
    model = AutoModelForCausalLM.from_config(hf_cfg, dtype=torch.float32)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if p.dim() != 2 or any(k in name for k in _KEEP):
                continue
            scale = 1.0 if "embed" in name else p.shape[1] ** -0.5
            p.copy_(torch.randn(p.shape, generator=g) * scale)
    model.save_pretrained(path, safe_serialization=True)
    for extra in ("generation_config.json",):
        try:
            os.unlink(os.path.join(path, extra))
        except FileNotFoundError:
            pass
    # Last: its presence means the checkpoint is complete.
    tmp = cfg_path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(config, f)
    os.replace(tmp, cfg_path)
    return path
