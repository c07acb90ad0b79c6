"""Hugging Face Qwen3 and Gemma4 text checkpoints: load tensor by tensor onto a mesh, save back for
transformers.

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


def _layer_rows(d: int, f: int, n: int, k: int, h: int, has_v: bool,
                norms: list[tuple[str, str]]) -> list[tuple]:
    """(checkpoint key, our name, torch shape, to_ours, to_torch) of one decoder layer: the
    attention and MLP both families share, with the family's norms (and scalars) `norms`."""
    rows = [("input_layernorm.weight", "attn_norm", (d,), _identity, _identity),
            ("self_attn.q_proj.weight", "wq", (n * h, d), *_heads_in(n, h)),
            ("self_attn.k_proj.weight", "wk", (k * h, d), *_heads_in(k, h))]
    if has_v:
        rows.append(("self_attn.v_proj.weight", "wv", (k * h, d), *_heads_in(k, h)))
    rows += [("self_attn.o_proj.weight", "wo", (d, n * h), *_heads_out(n, h)),
             ("self_attn.q_norm.weight", "q_norm", (h,), _identity, _identity),
             ("self_attn.k_norm.weight", "k_norm", (h,), _identity, _identity)]
    rows += [(key, name, (1,) if key == "layer_scalar" else (d,), _identity, _identity)
             for key, name in norms]
    rows += [("mlp.gate_proj.weight", "w_gate", (f, d), _transpose, _transpose),
             ("mlp.up_proj.weight", "w_up", (f, d), _transpose, _transpose),
             ("mlp.down_proj.weight", "w_down", (d, f), _transpose, _transpose)]
    return rows


def _stack_maps(rows: list[tuple], layer_ids, prefix: str, path: str) -> list[TensorMap]:
    """Checkpoint layer `layer_ids[i]` is entry i of our stack at `path`."""
    return [TensorMap(f"{prefix}layers.{layer}.{key}", f"{path}/{name}", i, shape, a, b)
            for i, layer in enumerate(layer_ids) for key, name, shape, a, b in rows]


def layer_key_map(cfg: TargetConfig, num_layers: int, prefix: str, path: str = "layers"
                  ) -> list[TensorMap]:
    """Keys of a stack of Qwen3 decoder layers (shared by the target and the drafter)."""
    rows = _layer_rows(cfg.hidden_size, cfg.intermediate_size, cfg.num_attention_heads,
                       cfg.num_key_value_heads, cfg.head_dim, True,
                       [("post_attention_layernorm.weight", "mlp_norm")])
    return _stack_maps(rows, range(num_layers), prefix, path)


def gemma4_layer_key_map(cfg: TargetConfig, layer_ids: list[int], sliding: bool, prefix: str,
                         path: str) -> list[TensorMap]:
    """Keys of Gemma4 decoder layers of one type: checkpoint layer `layer_ids[i]` is entry i of our
    stack at `path` (names in `models/gemma4_layers.py`). Shared by the target and the drafter."""
    from dspark_jax.models.gemma4_layers import layer_geometry

    k, h, has_v = layer_geometry(cfg, sliding)
    rows = _layer_rows(cfg.hidden_size, cfg.intermediate_size, cfg.num_attention_heads, k, h, has_v,
                       [("post_attention_layernorm.weight", "post_attn_norm"),
                        ("pre_feedforward_layernorm.weight", "mlp_norm"),
                        ("post_feedforward_layernorm.weight", "post_mlp_norm"),
                        ("layer_scalar", "layer_scalar")])
    return _stack_maps(rows, layer_ids, prefix, path)


def target_key_map(cfg: TargetConfig, prefix: str = "model.") -> list[TensorMap]:
    """Every tensor of a Hugging Face Qwen3ForCausalLM or Gemma4ForCausalLM checkpoint (`prefix`:
    where the decoder's weights sit; `model.language_model.` in a multimodal Gemma4 checkpoint)."""
    V, d = cfg.vocab_size, cfg.hidden_size
    rows = [TensorMap(f"{prefix}embed_tokens.weight", "embed", None, (V, d), _identity, _identity)]
    if cfg.family == "gemma4":
        rows += gemma4_layer_key_map(cfg, list(cfg.sliding_layers), True, prefix, "sliding")
        rows += gemma4_layer_key_map(cfg, list(cfg.full_layers), False, prefix, "full")
    else:
        rows += layer_key_map(cfg, cfg.num_hidden_layers, prefix)
    rows.append(TensorMap(f"{prefix}norm.weight", "final_norm", None, (d,), _identity, _identity))
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


def _target_config(data: dict, dtype: str | None, overrides: dict, where: str) -> TargetConfig:
    """TargetConfig from config.json's fields `data` (bfloat16 or else float32), `overrides` on top;
    a bad value is one CheckpointError naming `where`."""
    data = {**data, "dtype": "bfloat16" if dtype == "bfloat16" else "float32", **overrides}
    try:
        return from_dict(TargetConfig, data)
    except ConfigError as e:
        raise CheckpointError(f"{where}: {e}") from None


def config_from_hf(hf: dict, where: str, **overrides) -> TargetConfig:
    """TargetConfig from a Qwen3 or Gemma4 config.json dict; `overrides` set the non-HF fields."""
    if hf.get("model_type") in GEMMA4_MODEL_TYPES:
        return _gemma4_config_from_hf(hf, where, **overrides)
    if hf.get("model_type") != "qwen3":
        raise CheckpointError(f"{where}: model_type is {hf.get('model_type')!r}; only 'qwen3', "
                              "'gemma4_text' and 'gemma4' checkpoints are supported")
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
    return _target_config(data, hf.get("dtype") or hf.get("torch_dtype"), overrides, where)


# ----------------------------------------------------------------------------- Gemma4 config.json

GEMMA4_MODEL_TYPES = ("gemma4_text", "gemma4")  # the text model; the multimodal one around it
_GEMMA4_REQUIRED = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                    "num_attention_heads", "num_key_value_heads")
_GEMMA4_ROPE_TYPES = {"sliding_attention": ("default",), "full_attention": ("default", "proportional")}


def weights_prefix(hf: dict) -> str:
    """Where a checkpoint keeps the decoder's weights."""
    return "model.language_model." if hf.get("model_type") == "gemma4" else "model."


def _gemma4_text(hf: dict, where: str) -> dict:
    """The text model's config: the file itself, or its `text_config` in a multimodal checkpoint."""
    if hf.get("model_type") != "gemma4":
        return hf
    text = hf.get("text_config")
    if not isinstance(text, dict):
        raise CheckpointError(f"{where}: model_type 'gemma4' needs a text_config object")
    return text


def _refuse_unsupported_gemma4(text: dict, where: str, scope: str) -> None:
    """One error naming the first field that asks for what this implementation does not do.
    Absent fields take transformers' Gemma4TextConfig defaults (so an absent
    hidden_size_per_layer_input means per-layer inputs of width 256)."""
    per_layer = text.get("hidden_size_per_layer_input", 256)
    checks = [
        ("hidden_size_per_layer_input", per_layer, bool(per_layer),
         "per-layer inputs are not supported (need 0" + (")" if "hidden_size_per_layer_input" in text
                                                         else "; absent means transformers' 256)")),
        ("enable_moe_block", text.get("enable_moe_block"), bool(text.get("enable_moe_block")),
         "mixture-of-experts layers are not supported"),
        ("num_kv_shared_layers", text.get("num_kv_shared_layers"), bool(text.get("num_kv_shared_layers")),
         "KV sharing between layers is not supported (need 0)"),
        ("use_double_wide_mlp", text.get("use_double_wide_mlp"), bool(text.get("use_double_wide_mlp")),
         "the double-wide MLP is not supported"),
        # "vision": image tokens attend bidirectionally, text causally (what text input is here).
        ("use_bidirectional_attention", text.get("use_bidirectional_attention"),
         text.get("use_bidirectional_attention") not in (None, False, "vision"),
         "only causal attention over text is supported (need null or \"vision\")"),
        ("attention_bias", text.get("attention_bias"), bool(text.get("attention_bias")),
         "attention biases are not supported"),
        ("hidden_activation", text.get("hidden_activation", "gelu_pytorch_tanh"),
         text.get("hidden_activation", "gelu_pytorch_tanh") != "gelu_pytorch_tanh",
         "only gelu_pytorch_tanh is supported"),
        ("attn_logit_softcapping", text.get("attn_logit_softcapping"),
         text.get("attn_logit_softcapping") is not None, "attention logit soft-capping is not supported"),
        ("rope_scaling", text.get("rope_scaling"), bool(text.get("rope_scaling")),
         "RoPE scaling is not supported"),
    ]
    for key, value, bad, why in checks:
        if bad:
            raise CheckpointError(f"{where}: {scope}{key} is {json.dumps(value)}: {why}")


def _gemma4_rope(text: dict, layer_types: list[str], where: str, scope: str) -> dict:
    """{layer type: (theta, rotated fraction)} from `rope_parameters` (transformers' defaults when
    absent); only the entries of the two layer types count (a stray top-level rope_type or
    rope_theta beside them is ignored)."""
    rope = text.get("rope_parameters") or {
        "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
        "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                           "rope_theta": 1_000_000.0}}
    out = {}
    for kind, allowed in _GEMMA4_ROPE_TYPES.items():
        entry = rope.get(kind)
        if entry is None:
            if kind in layer_types:
                raise CheckpointError(f"{where}: {scope}rope_parameters has no {kind!r} entry")
            continue
        key = f"{scope}rope_parameters.{kind}"
        rope_type = entry.get("rope_type", "default")
        if rope_type not in allowed:
            raise CheckpointError(f"{where}: {key}.rope_type is {rope_type!r}: supported "
                                  f"{' and '.join(map(repr, allowed))}")
        if entry.get("factor", 1.0) != 1.0:
            raise CheckpointError(f"{where}: {key}.factor is {entry['factor']}: RoPE scaling is not "
                                  "supported (need 1.0)")
        fraction = entry.get("partial_rotary_factor", 1.0) if rope_type == "proportional" else 1.0
        if kind == "sliding_attention" and entry.get("partial_rotary_factor", 1.0) != 1.0:
            raise CheckpointError(f"{where}: {key}.partial_rotary_factor is "
                                  f"{entry['partial_rotary_factor']}: sliding layers rotate fully")
        if entry.get("rope_theta") is None:
            raise CheckpointError(f"{where}: {key} has no rope_theta")
        out[kind] = (entry["rope_theta"], fraction)
    return out


def _gemma4_config_from_hf(hf: dict, where: str, **overrides) -> TargetConfig:
    """TargetConfig (family gemma4) from a gemma4_text or multimodal gemma4 config.json dict."""
    text = _gemma4_text(hf, where)
    scope = "text_config." if text is not hf else ""  # where error messages find a field
    _refuse_unsupported_gemma4(text, where, scope)
    missing = [scope + k for k in _GEMMA4_REQUIRED if k not in text]
    if missing:
        raise CheckpointError(f"{where}: missing keys {missing}")
    L = text["num_hidden_layers"]
    layer_types = text.get("layer_types")
    if layer_types is None:  # transformers' default: every sixth layer full
        layer_types = ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(L)]
    rope = _gemma4_rope(text, layer_types, where, scope)
    full_theta, fraction = rope.get("full_attention", (0.0, 1.0))
    head_dim = text.get("head_dim", 256)
    k_eq_v = bool(text.get("attention_k_eq_v", False))
    data = {k: text[k] for k in _GEMMA4_REQUIRED}
    data.update(
        family="gemma4", head_dim=head_dim, rms_norm_eps=text.get("rms_norm_eps", 1e-6),
        rope_theta=rope.get("sliding_attention", (full_theta,))[0],
        tie_word_embeddings=hf.get("tie_word_embeddings", text.get("tie_word_embeddings", True)),
        max_position_embeddings=text.get("max_position_embeddings", 131_072),
        layer_types=layer_types, sliding_window=text.get("sliding_window", 512),
        global_rope_theta=full_theta, global_head_dim=text.get("global_head_dim", 512) or head_dim,
        # transformers gives full layers the global KV head count only when keys are values
        num_global_key_value_heads=(text.get("num_global_key_value_heads") or 0) if k_eq_v else 0,
        attention_k_eq_v=k_eq_v, partial_rotary_factor=fraction,
        final_logit_softcapping=text.get("final_logit_softcapping") or 0.0)
    return _target_config(data, text.get("dtype") or hf.get("dtype") or hf.get("torch_dtype"),
                          overrides, where)


def _gemma4_config_to_hf(cfg: TargetConfig) -> dict:
    """A config.json that transformers loads as Gemma4ForCausalLM (model_type gemma4_text)."""
    if not cfg.attention_k_eq_v and cfg.full_kv_heads != cfg.num_key_value_heads:
        raise ConfigError(f"num_global_key_value_heads {cfg.full_kv_heads}: transformers' Gemma4 uses "
                          "it only with attention_k_eq_v, so this config has no config.json")
    types = list(cfg.layer_types) or ["full_attention"] * cfg.num_hidden_layers
    rope = {"full_attention": {"rope_type": "proportional", "rope_theta": cfg.full_rope_theta,
                               "partial_rotary_factor": cfg.partial_rotary_factor}}
    if "sliding_attention" in types:
        rope["sliding_attention"] = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    out = {"architectures": ["Gemma4ForCausalLM"], "model_type": "gemma4_text"}
    out.update({k: getattr(cfg, k) for k in _HF_FIELDS})
    out.update(
        head_dim=cfg.head_dim, global_head_dim=cfg.full_head_dim,
        num_global_key_value_heads=cfg.full_kv_heads if cfg.attention_k_eq_v else None,
        attention_k_eq_v=cfg.attention_k_eq_v, layer_types=types,
        sliding_window=cfg.sliding_window or cfg.max_position_embeddings, rope_parameters=rope,
        final_logit_softcapping=cfg.final_logit_softcapping or None,
        hidden_activation="gelu_pytorch_tanh", attention_bias=False, attention_dropout=0.0,
        hidden_size_per_layer_input=0, vocab_size_per_layer_input=cfg.vocab_size,
        num_kv_shared_layers=0, enable_moe_block=False, use_double_wide_mlp=False,
        use_bidirectional_attention=None, num_experts=None, top_k_experts=None,
        moe_intermediate_size=None, dtype=cfg.dtype, use_cache=True)
    return out


def load_target_config(directory: str | Path, **overrides) -> TargetConfig:
    """Reads `directory/config.json`; overrides set target_layer_ids, mask_token_id, dtype..."""
    path = Path(directory) / "config.json"
    if not Path(directory).is_dir():
        raise CheckpointError(f"{directory}: checkpoint directory not found")
    return config_from_hf(read_json(path), str(path), **overrides)


def config_to_hf(cfg: TargetConfig) -> dict:
    """A config.json that transformers loads as Qwen3ForCausalLM (Gemma4ForCausalLM for gemma4)."""
    if cfg.family == "gemma4":
        return _gemma4_config_to_hf(cfg)
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
        read = _assemble(files, groups.get(path_name(path), []), info)  # [] for an empty stack
        if sharding is None:
            full = tuple(slice(None) for _ in info.shape)
            leaves.append(jax.device_put(read(full)))
        else:
            leaves.append(jax.make_array_from_callback(info.shape, sharding, read))
    return jax.tree.unflatten(treedef, leaves)


def load_target(directory: str | Path, mesh: Mesh | None = None, **overrides
                ) -> tuple[TargetConfig, dict]:
    """Loads a Hugging Face Qwen3 or Gemma4 directory: (config, params placed on `mesh`). Of a
    multimodal Gemma4 checkpoint only the text model is read."""
    directory = Path(directory)
    cfg = load_target_config(directory, **overrides)
    prefix = weights_prefix(read_json(directory / "config.json"))
    files = CheckpointFiles(directory)
    key_map = target_key_map(cfg, prefix)
    # Tied checkpoints sometimes also store the (identical) head; it is not a separate parameter.
    optional = frozenset({"lm_head.weight"}) if cfg.tie_word_embeddings else frozenset()
    if prefix != "model.":  # the towers around a multimodal checkpoint's text model
        optional |= {k for k in files.keys() if not k.startswith(prefix) and k != "lm_head.weight"}
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
    """Writes a Hugging Face Qwen3 (or Gemma4 text) directory: config.json, safetensors, tokenizer
    files."""
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
