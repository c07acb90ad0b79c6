"""Config presets, overrides and their errors."""

import pytest

from dspark_jax.config import Config, TargetConfig, load_config, parse_overrides, preset_path
from dspark_jax.errors import ConfigError


@pytest.mark.parametrize("name, layers, taps, tied", [
    ("qwen3-4b", 36, (1, 9, 17, 25, 33), True),
    ("qwen3-8b", 36, (1, 9, 17, 25, 33), False),
    ("qwen3-14b", 40, (1, 10, 19, 28, 37), False),
])
def test_qwen3_presets(name, layers, taps, tied):
    cfg = load_config(preset_path(name))
    assert cfg.target.num_hidden_layers == layers
    assert cfg.target.target_layer_ids == taps
    assert cfg.target.tie_word_embeddings is tied
    assert cfg.target.mask_token_id == 151669
    assert cfg.target.head_dim == 128


def test_overrides_any_field():
    cfg = load_config(preset_path("tiny"), ["target.dtype=bfloat16", "mesh.tensor=2",
                                            "target.target_layer_ids=[1, 2]", "target.rope_theta=5e5"])
    assert cfg.target.dtype == "bfloat16" and cfg.mesh.tensor == 2
    assert cfg.target.target_layer_ids == (1, 2)
    assert cfg.target.rope_theta == 5e5


def test_base_preset_chain(tmp_path):
    (tmp_path / "child.yaml").write_text(f"base: {preset_path('tiny')}\ntarget:\n  hidden_size: 96\n")
    cfg = load_config(tmp_path / "child.yaml")
    assert cfg.target.hidden_size == 96 and cfg.target.vocab_size == 320


@pytest.mark.parametrize("overrides, pattern", [
    (["target.hiden_size=3"], r"unknown config key 'target.hiden_size'.*known keys under 'target'"),
    (["bogus.x=1"], "unknown config key 'bogus'"),
    (["target.hidden_size=big"], r"target.hidden_size: expected an integer, got str 'big'"),
    (["target.tie_word_embeddings=1"], r"target.tie_word_embeddings: expected true or false"),
    (["target.dtype=float16"], r"target.dtype: expected one of \['float32', 'bfloat16'\]"),
    (["target.num_key_value_heads=3"], r"target.num_attention_heads: 4 is not a multiple of "
                                       r"num_key_value_heads 3"),
    (["target.target_layer_ids=[0, 3]"], r"target.target_layer_ids: \[3\] out of range"),
    (["target.mask_token_id=999"], r"target.mask_token_id: 999 is outside the vocabulary"),
    (["mesh.data=0"], r"mesh.data: must be >= 1 or -1"),
    (["target.hidden_size"], r"expected KEY=VALUE"),
])
def test_bad_overrides(overrides, pattern):
    with pytest.raises(ConfigError, match=pattern):
        load_config(preset_path("tiny"), overrides)


def test_missing_key_and_bad_files(tmp_path):
    (tmp_path / "a.yaml").write_text("target:\n  vocab_size: 10\n")
    with pytest.raises(ConfigError, match=r"a.yaml: missing config key 'target.hidden_size'"):
        load_config(tmp_path / "a.yaml")
    (tmp_path / "b.yaml").write_text("target: [1, 2\n")
    with pytest.raises(ConfigError, match=r"b.yaml: invalid YAML"):
        load_config(tmp_path / "b.yaml")
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(tmp_path / "none.yaml")
    (tmp_path / "c.yaml").write_text("base: c.yaml\n")
    with pytest.raises(ConfigError, match="circular"):
        load_config(tmp_path / "c.yaml")


def test_parse_overrides_nested():
    assert parse_overrides(["a.b=1", "a.c=[1, 2]", "d=x"]) == {"a": {"b": 1, "c": [1, 2]}, "d": "x"}


def test_frozen():
    cfg = load_config(preset_path("tiny"))
    assert isinstance(cfg, Config) and isinstance(cfg.target, TargetConfig)
    with pytest.raises(Exception):
        cfg.target.hidden_size = 3
