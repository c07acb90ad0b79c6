"""Bad checkpoints: each one clear CheckpointError/ConfigError naming the file, key or value."""

import json
import shutil

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from dspark_jax.errors import CheckpointError
from dspark_jax.formats import hf_checkpoint

TINY = dict(seed=5, layers=3, heads=4, kv_heads=2, head_dim=8)


@pytest.fixture
def ckpt(hf_models, tmp_path):
    d = tmp_path / "ckpt"
    shutil.copytree(hf_models(**TINY), d)
    return d


def rewrite(d, fn):
    tensors = load_file(d / "model.safetensors")
    fn(tensors)
    save_file(tensors, d / "model.safetensors", metadata={"format": "pt"})


def test_no_config_json(ckpt):
    (ckpt / "config.json").unlink()
    with pytest.raises(CheckpointError, match=r"config\.json: file not found"):
        hf_checkpoint.load_target(ckpt)


def test_missing_directory(tmp_path):
    with pytest.raises(CheckpointError, match="checkpoint directory not found"):
        hf_checkpoint.load_target(tmp_path / "nope")


def test_not_qwen3(ckpt):
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["model_type"] = "llama"
    (ckpt / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"model_type is 'llama'; only 'qwen3'"):
        hf_checkpoint.load_target(ckpt)


def test_missing_extra_and_misshaped_tensors_listed_together(ckpt):
    def damage(t):
        del t["model.layers.1.mlp.up_proj.weight"]
        t["model.layers.0.self_attn.extra.weight"] = np.zeros(3, np.float32)
        t["model.norm.weight"] = np.zeros(7, np.float32)
    rewrite(ckpt, damage)
    with pytest.raises(CheckpointError) as e:
        hf_checkpoint.load_target(ckpt)
    msg = str(e.value)
    assert str(ckpt) in msg
    assert "1 missing: model.layers.1.mlp.up_proj.weight" in msg
    assert "1 unexpected: model.layers.0.self_attn.extra.weight" in msg
    assert "model.norm.weight: (7,) (expected (32,))" in msg


def test_corrupt_header(ckpt):
    path = ckpt / "model.safetensors"
    data = bytearray(path.read_bytes())
    data[8:16] = b"{garbage"
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="model.safetensors"):
        hf_checkpoint.load_target(ckpt)


def test_index_names_missing_shard(ckpt):
    tensors = load_file(ckpt / "model.safetensors")
    (ckpt / "model.safetensors").unlink()
    keys = sorted(tensors)
    save_file({k: tensors[k] for k in keys[:5]}, ckpt / "model-00001-of-00002.safetensors")
    index = {"metadata": {}, "weight_map": {k: ("model-00001-of-00002.safetensors" if i < 5
                                                else "model-00002-of-00002.safetensors")
                                            for i, k in enumerate(keys)}}
    (ckpt / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=r"model-00002-of-00002\.safetensors"):
        hf_checkpoint.load_target(ckpt)


@pytest.mark.parametrize("ids, pattern", [
    ([0, 3], r"target_layer_ids: \[3\] out of range.*last layer 2 is not allowed"),
    ([-2, 1], r"target_layer_ids: \[-2\] out of range"),
    ([1, 0], "strictly increasing"),
])
def test_bad_tapped_layers(ckpt, ids, pattern):
    with pytest.raises(CheckpointError, match=pattern):
        hf_checkpoint.load_target(ckpt, target_layer_ids=ids)
