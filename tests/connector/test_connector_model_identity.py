"""The default model identity follows the model's files, not their path (pure Python)."""
from __future__ import annotations

import json
import os
import shutil
from types import SimpleNamespace

import pytest

from kvkeeper.connector.layout import KVLayout, namespace_descriptor
from kvkeeper.connector.model_identity import model_identity

CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 128,
          "num_hidden_layers": 2, "torch_dtype": "float32"}
LAYOUT = KVLayout(layer_names=("l0", "l1"), num_heads=2, block_tokens=32, content_bytes=256,
                  dtype="float32", physical="LBHNC", spec_kind="FullAttentionSpec")


def write_model(path, config=CONFIG, weights=None) -> str:
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    weights = weights or {"model-00001-of-00002.safetensors": b"A" * 5000,
                          "model-00002-of-00002.safetensors": b"B" * 3000}
    index = {"metadata": {"total_size": sum(map(len, weights.values()))},
             "weight_map": {f"t{i}": name for i, name in enumerate(sorted(weights))}}
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump(index, f)
    for name, data in weights.items():
        with open(os.path.join(path, name), "wb") as f:
            f.write(data)
    with open(os.path.join(path, "tokenizer.json"), "w") as f:
        f.write("{}")   # not part of the identity: token ids are the keys
    return str(path)


def mid(path) -> str:
    return model_identity(str(path)).model_id


def namespace(model: str, **kw):
    vc = SimpleNamespace(model_config=SimpleNamespace(model=model, revision=None,
                                                      quantization=None))
    return namespace_descriptor(vc, LAYOUT, tp_rank=0, tp_size=1, **kw)


def test_a_symlink_and_a_copy_elsewhere_name_the_same_model(tmp_path) -> None:
    a = write_model(tmp_path / "host-a" / "models" / "llama")
    link = tmp_path / "through-a-link"
    os.symlink(a, link)
    copy = tmp_path / "mnt" / "other-mount" / "llama-copy"
    shutil.copytree(a, copy)
    ident = model_identity(a)
    assert ident.model_id.startswith("LlamaForCausalLM@sha256:")
    assert str(tmp_path) not in ident.model_id and "content" in ident.source
    assert mid(link) == mid(copy) == ident.model_id
    assert namespace(a) == namespace(str(link)) == namespace(str(copy))
    # formatting of config.json does not matter, nor a path transformers wrote into it
    with open(copy / "config.json", "w") as f:
        json.dump({"_name_or_path": "/somewhere/else", **dict(reversed(CONFIG.items()))}, f)
    assert mid(copy) == ident.model_id


def test_a_snapshot_made_of_symlinks_names_the_same_model(tmp_path) -> None:
    a = write_model(tmp_path / "plain")
    blobs, snap = tmp_path / "blobs", tmp_path / "snapshots" / "abc"
    blobs.mkdir()
    snap.mkdir(parents=True)
    for name in os.listdir(a):   # the Hugging Face cache layout
        shutil.copy(os.path.join(a, name), blobs / f"blob-{name}")
        os.symlink(blobs / f"blob-{name}", snap / name)
    assert mid(snap) == mid(a)


@pytest.mark.parametrize("change", ["config", "weight-size", "weight-bytes", "weight-name",
                                    "index"])
def test_other_config_or_weights_name_another_model(tmp_path, change: str) -> None:
    a = write_model(tmp_path / "a")
    b = tmp_path / "b"
    shutil.copytree(a, b)
    assert mid(a) == mid(b)
    w1 = b / "model-00001-of-00002.safetensors"
    if change == "config":
        write_model(b, config={**CONFIG, "num_hidden_layers": 3})
    elif change == "weight-size":
        w1.write_bytes(b"A" * 5001)
    elif change == "weight-bytes":   # a fine-tune: same names, same sizes
        w1.write_bytes(b"A" * 2500 + b"C" + b"A" * 2499)
    elif change == "weight-name":
        os.rename(w1, b / "model-00001-of-00002-renamed.safetensors")
    else:
        (b / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {}}))
    assert mid(a) != mid(b)
    assert namespace(a)["model_id"] != namespace(str(b))["model_id"]


def test_large_weight_files_are_sampled_and_a_changed_sample_is_seen(tmp_path) -> None:
    a = tmp_path / "a"
    a.mkdir()
    (a / "config.json").write_text(json.dumps(CONFIG))
    big = a / "model.safetensors"
    with open(big, "wb") as f:   # 32 MiB: far more than the samples cover
        f.truncate(32 << 20)
    first = mid(a)
    with open(big, "r+b") as f:   # the first sample starts at offset 0
        f.write(b"\x01")
    assert mid(a) != first


def test_kvkeeper_model_id_overrides_and_names_stay_names(tmp_path) -> None:
    a = write_model(tmp_path / "a")
    ident = model_identity(a, "org/my-model")
    assert ident.model_id == "org/my-model" and ident.source == "kvkeeper_model_id"
    assert namespace(a, model_id="org/my-model")["model_id"] == "org/my-model"
    # a hub id is the same on every host already
    assert mid("meta-llama/Llama-3.1-8B") == "meta-llama/Llama-3.1-8B"
    # a directory without model files keeps its path (and says so)
    empty = tmp_path / "empty"
    empty.mkdir()
    got = model_identity(str(empty))
    assert got.model_id == str(empty) and "no config" in got.source
