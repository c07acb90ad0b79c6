"""Hugging Face Qwen3 checkpoints: load tensor by tensor onto a mesh, save back for transformers.

The key map (`target_key_map`) is written once and used in both directions. Loading is strict:
every missing, unexpected or mis-shaped tensor is listed in one error. Each device reads only its
own shard of each tensor from the memory-mapped safetensors files, so no host ever holds a full
copy of the model per device.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path
from typing import Callable, Iterator

import jax
import ml_dtypes
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh

from dspark_jax.config import TargetConfig, from_dict
from dspark_jax.errors import CheckpointError, ConfigError
from dspark_jax.formats.safetensors_io import CheckpointFiles, save_dir
from dspark_jax.models.target import target_spec
from dspark_jax.params import ArrayInfo, path_name, shardings

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json",
                   "special_tokens_map.json", "vocab.json", "merges.txt")


@dataclasses.dataclass(frozen=True)
class TensorMap:
    """One checkpoint tensor <-> (a layer of) one of our parameters.

    `to_ours` turns the torch-layout array into ours (a numpy view when possible, so slicing a
    memmap reads only the slice); `to_torch` is its inverse.
    """

    key: str  # checkpoint key
    path: str  # our parameter, "layers/wq"
    layer: int | None  # index on the stacked `layers` axis, or None
    torch_shape: tuple[int, ...]
    to_ours: Callable[[np.ndarray], np.ndarray]
    to_torch: Callable[[np.ndarray], np.ndarray]


def _identity(a):
    return a


def _transpose(a):
    return a.T


def _heads_in(n: int, h: int):
    """torch [n*h, d] <-> ours [d, n, h] (q/k/v projections)."""
    to_ours = lambda a: a.reshape(n, h, -1).transpose(2, 0, 1)
    to_torch = lambda a: a.transpose(1, 2, 0).reshape(n * h, -1)
    return to_ours, to_torch


def _heads_out(n: int, h: int):
    """torch [d, n*h] <-> ours [n, h, d] (o projection)."""
    to_ours = lambda a: a.reshape(-1, n, h).transpose(1, 2, 0)
    to_torch = lambda a: a.transpose(2, 0, 1).reshape(-1, n * h)
    return to_ours, to_torch


def layer_key_map(cfg: TargetConfig, num_layers: int, prefix: str, path: str = "layers"
                  ) -> list[TensorMap]:
    """Keys of a stack of Qwen3 decoder layers (shared by the target and the drafter)."""
    d, f, h = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    n, k = cfg.num_attention_heads, cfg.num_key_value_heads
    out = []
    for i in range(num_layers):
        p = f"{prefix}layers.{i}."
        rows = [
            ("input_layernorm.weight", "attn_norm", (d,), _identity, _identity),
            ("self_attn.q_proj.weight", "wq", (n * h, d), *_heads_in(n, h)),
            ("self_attn.k_proj.weight", "wk", (k * h, d), *_heads_in(k, h)),
            ("self_attn.v_proj.weight", "wv", (k * h, d), *_heads_in(k, h)),
            ("self_attn.o_proj.weight", "wo", (d, n * h), *_heads_out(n, h)),
            ("self_attn.q_norm.weight", "q_norm", (h,), _identity, _identity),
            ("self_attn.k_norm.weight", "k_norm", (h,), _identity, _identity),
            ("post_attention_layernorm.weight", "mlp_norm", (d,), _identity, _identity),
            ("mlp.gate_proj.weight", "w_gate", (f, d), _transpose, _transpose),
            ("mlp.up_proj.weight", "w_up", (f, d), _transpose, _transpose),
            ("mlp.down_proj.weight", "w_down", (d, f), _transpose, _transpose),
        ]
        out += [TensorMap(p + key, f"{path}/{name}", i, shape, a, b)
                for key, name, shape, a, b in rows]
    return out


def gemma4_layer_key_map(cfg: TargetConfig, layer_ids: list[int], sliding: bool, prefix: str,
                         path: str) -> list[TensorMap]:
    """Keys of Gemma4 decoder layers of one type: checkpoint layer `layer_ids[i]` is entry i of our
    stack at `path` (names in `models/gemma4_layers.py`). Shared by the target and the drafter."""
    from dspark_jax.models.gemma4_layers import layer_geometry

    d, f, n = cfg.hidden_size, cfg.intermediate_size, cfg.num_attention_heads
    k, h, has_v = layer_geometry(cfg, sliding)
    out = []
    for i, layer in enumerate(layer_ids):
        p = f"{prefix}layers.{layer}."
        rows = [
            ("input_layernorm.weight", "attn_norm", (d,), _identity, _identity),
            ("self_attn.q_proj.weight", "wq", (n * h, d), *_heads_in(n, h)),
            ("self_attn.k_proj.weight", "wk", (k * h, d), *_heads_in(k, h)),
            ("self_attn.o_proj.weight", "wo", (d, n * h), *_heads_out(n, h)),
            ("self_attn.q_norm.weight", "q_norm", (h,), _identity, _identity),
            ("self_attn.k_norm.weight", "k_norm", (h,), _identity, _identity),
            ("post_attention_layernorm.weight", "post_attn_norm", (d,), _identity, _identity),
            ("pre_feedforward_layernorm.weight", "mlp_norm", (d,), _identity, _identity),
            ("post_feedforward_layernorm.weight", "post_mlp_norm", (d,), _identity, _identity),
            ("layer_scalar", "layer_scalar", (1,), _identity, _identity),
            ("mlp.gate_proj.weight", "w_gate", (f, d), _transpose, _transpose),
            ("mlp.up_proj.weight", "w_up", (f, d), _transpose, _transpose),
            ("mlp.down_proj.weight", "w_down", (d, f), _transpose, _transpose),
        ]
        if has_v:
            rows.insert(3, ("self_attn.v_proj.weight", "wv", (k * h, d), *_heads_in(k, h)))
        out += [TensorMap(p + key, f"{path}/{name}", i, shape, a, b)
                for key, name, shape, a, b in rows]
    return out


def target_key_map(cfg: TargetConfig) -> list[TensorMap]:
    """Every tensor of a Hugging Face Qwen3ForCausalLM checkpoint."""
    V, d = cfg.vocab_size, cfg.hidden_size
    rows = [TensorMap("model.embed_tokens.weight", "embed", None, (V, d), _identity, _identity)]
    rows += layer_key_map(cfg, cfg.num_hidden_layers, "model.")
    rows.append(TensorMap("model.norm.weight", "final_norm", None, (d,), _identity, _identity))
    if not cfg.tie_word_embeddings:
        rows.append(TensorMap("lm_head.weight", "lm_head", None, (V, d), _transpose, _transpose))
    return rows


# ----------------------------------------------------------------------------- config.json

_HF_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
              "num_attention_heads", "num_key_value_heads", "rms_norm_eps",
              "tie_word_embeddings", "max_position_embeddings")


def read_json(path: Path) -> dict:
    if not path.is_file():
        raise CheckpointError(f"{path}: file not found")
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: invalid JSON ({e})") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: expected a JSON object")
    return data


def config_from_hf(hf: dict, where: str, **overrides) -> TargetConfig:
    """TargetConfig from a Qwen3 config.json dict; `overrides` set the non-HF fields."""
    if hf.get("model_type") != "qwen3":
        raise CheckpointError(f"{where}: model_type is {hf.get('model_type')!r}; only 'qwen3' "
                              "checkpoints are supported")
    if hf.get("attention_bias"):
        raise CheckpointError(f"{where}: attention_bias=true is not supported (Qwen3 has none)")
    missing = [k for k in _HF_FIELDS if k not in hf and k != "tie_word_embeddings"]
    if missing:
        raise CheckpointError(f"{where}: missing keys {missing}")
    data = {k: hf[k] for k in _HF_FIELDS if k in hf}
    data["head_dim"] = hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"]
    rope = hf.get("rope_parameters") or {}
    theta = rope.get("rope_theta", hf.get("rope_theta"))
    if rope.get("rope_type", "default") != "default" or hf.get("rope_scaling"):
        raise CheckpointError(f"{where}: only default RoPE is supported, got "
                              f"{rope or hf.get('rope_scaling')}")
    if theta is None:
        raise CheckpointError(f"{where}: missing rope_parameters.rope_theta (or rope_theta)")
    data["rope_theta"] = theta
    dtype = hf.get("dtype") or hf.get("torch_dtype") or "float32"
    data["dtype"] = "bfloat16" if dtype == "bfloat16" else "float32"
    data.update(overrides)
    try:
        return from_dict(TargetConfig, data)
    except ConfigError as e:
        raise CheckpointError(f"{where}: {e}") from None


def load_target_config(directory: str | Path, **overrides) -> TargetConfig:
    """Reads `directory/config.json`; overrides set target_layer_ids, mask_token_id, dtype..."""
    path = Path(directory) / "config.json"
    if not Path(directory).is_dir():
        raise CheckpointError(f"{directory}: checkpoint directory not found")
    return config_from_hf(read_json(path), str(path), **overrides)


def config_to_hf(cfg: TargetConfig) -> dict:
    """A config.json that transformers loads as Qwen3ForCausalLM."""
    out = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3"}
    out.update({k: getattr(cfg, k) for k in _HF_FIELDS})
    out.update(head_dim=cfg.head_dim, hidden_act="silu", attention_bias=False,
               attention_dropout=0.0, rope_theta=cfg.rope_theta,
               rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta},
               dtype=cfg.dtype, torch_dtype=cfg.dtype, use_cache=True,
               use_sliding_window=False, sliding_window=None, max_window_layers=cfg.num_hidden_layers,
               layer_types=["full_attention"] * cfg.num_hidden_layers)
    return out


# ----------------------------------------------------------------------------- loading


def check_tensors(files: CheckpointFiles, key_map: list[TensorMap], where: str,
                  optional: frozenset[str] = frozenset()) -> None:
    """One error listing every missing, unexpected and mis-shaped tensor."""
    expected = {m.key: m for m in key_map}
    present = set(files.keys())
    missing = sorted(set(expected) - present)
    unexpected = sorted(present - set(expected) - optional)
    wrong = [f"{k}: {files.info(k).shape} (expected {expected[k].torch_shape})"
             for k in sorted(present & set(expected))
             if tuple(files.info(k).shape) != expected[k].torch_shape]
    problems = []
    for title, items in (("missing", missing), ("unexpected", unexpected), ("wrong shape", wrong)):
        if items:
            shown = items[:20] + ([f"... {len(items) - 20} more"] if len(items) > 20 else [])
            problems.append(f"{len(items)} {title}: " + ", ".join(shown))
    if problems:
        raise CheckpointError(f"{where}: tensors do not match the model: " + "; ".join(problems))


def _assemble(files: CheckpointFiles, maps: list[TensorMap], info: ArrayInfo):
    """Callback for make_array_from_callback: reads one device's slice of one parameter."""
    by_layer = {m.layer: m for m in maps}
    np_dtype = np.dtype(info.dtype)

    # Devices that hold the same slice (replicas along data/fsdp) share one host read.
    memo: dict[tuple, np.ndarray] = {}

    def read(index: tuple[slice, ...]) -> np.ndarray:
        key = tuple((s.start, s.stop, s.step) for s in index)
        if key not in memo:
            memo[key] = read_slice(index)
        return memo[key]

    def read_slice(index: tuple[slice, ...]) -> np.ndarray:
        if None in by_layer:  # unstacked parameter
            m = by_layer[None]
            return np.asarray(m.to_ours(files.array(m.key))[index], dtype=np_dtype)
        layers = range(info.shape[0])[index[0]]
        parts = [np.asarray(by_layer[i].to_ours(files.array(by_layer[i].key))[index[1:]],
                            dtype=np_dtype) for i in layers]
        return np.stack(parts) if parts else np.zeros((0,) + info.shape[1:], np_dtype)

    return read


def load_tensors(files: CheckpointFiles, key_map: list[TensorMap], spec, mesh: Mesh | None):
    """Builds the params tree of `spec` from checkpoint tensors, each placed with its sharding."""
    groups: dict[str, list[TensorMap]] = {}
    for m in key_map:
        groups.setdefault(m.path, []).append(m)
    shard_tree = shardings(spec, mesh) if mesh is not None else None
    flat_spec, treedef = jax.tree.flatten_with_path(spec, is_leaf=lambda x: isinstance(x, ArrayInfo))
    flat_shard = jax.tree.leaves(shard_tree) if mesh is not None else [None] * len(flat_spec)
    leaves = []
    for (path, info), sharding in zip(flat_spec, flat_shard):
        read = _assemble(files, groups[path_name(path)], info)
        if sharding is None:
            full = tuple(slice(None) for _ in info.shape)
            leaves.append(jax.device_put(read(full)))
        else:
            leaves.append(jax.make_array_from_callback(info.shape, sharding, read))
    return jax.tree.unflatten(treedef, leaves)


def load_target(directory: str | Path, mesh: Mesh | None = None, **overrides
                ) -> tuple[TargetConfig, dict]:
    """Loads a Hugging Face Qwen3 directory: (config, params placed on `mesh`)."""
    directory = Path(directory)
    cfg = load_target_config(directory, **overrides)
    files = CheckpointFiles(directory)
    key_map = target_key_map(cfg)
    # Tied checkpoints sometimes also store the (identical) head; it is not a separate parameter.
    optional = frozenset({"lm_head.weight"}) if cfg.tie_word_embeddings else frozenset()
    check_tensors(files, key_map, str(directory), optional)
    return cfg, load_tensors(files, key_map, target_spec(cfg), mesh)


# ----------------------------------------------------------------------------- saving


def _host_array(x: jax.Array) -> np.ndarray:
    if not x.is_fully_addressable:
        x = multihost_utils.process_allgather(x, tiled=True)
    return np.asarray(jax.device_get(x))


def iter_torch_tensors(params, key_map: list[TensorMap], dtype=None) -> Iterator[tuple[str, np.ndarray]]:
    """(key, torch-layout array) pairs, one tensor at a time, in key-map order."""
    flat = {path_name(p): x for p, x in jax.tree.flatten_with_path(params)[0]}
    for m in key_map:
        x = flat[m.path]
        x = x[m.layer] if m.layer is not None else x
        a = np.ascontiguousarray(m.to_torch(_host_array(x)))
        if dtype is not None and a.dtype != dtype:
            a = a.astype(dtype)
        yield m.key, a


def torch_dtype(name: str):
    return ml_dtypes.bfloat16 if name == "bfloat16" else np.float32


def save_target(params, cfg: TargetConfig, out_dir: str | Path, *, tokenizer_dir: str | Path | None = None,
                max_shard_bytes: int | None = None) -> Path:
    """Writes a Hugging Face Qwen3 directory (config.json, safetensors, tokenizer files)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_dir(out, iter_torch_tensors(params, target_key_map(cfg), torch_dtype(cfg.dtype)),
             metadata={"format": "pt"}, max_shard_bytes=max_shard_bytes)
    (out / "config.json").write_text(json.dumps(config_to_hf(cfg), indent=2) + "\n")
    if tokenizer_dir is not None:
        for name in TOKENIZER_FILES:
            src = Path(tokenizer_dir) / name
            if src.is_file() and src.resolve() != (out / name).resolve():
                shutil.copyfile(src, out / name)
    return out
