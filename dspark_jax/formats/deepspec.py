"""DeepSpec-format DSpark/DFlash drafters (DESIGN §9): import into JAX params, export back.

A DeepSpec drafter directory holds `config.json` (the target's config with the drafter fields)
and `model.safetensors` whose keys have no `model.` prefix. It carries copies of the target's
embedding and lm_head; we do not keep them (the drafter shares the target's), but on import they are
compared with the target's and a mismatch is an error (or a warning when asked).

Two families, one per kind of target: `Qwen3DSparkModel` (Qwen3 layers; a Qwen3 config) and
`Gemma4DSparkModel` (Gemma4 full-attention layers: feed-forward norms and `layer_scalar`, no
`v_proj` when the target takes keys as values; a `gemma4_text` config with `target_model_type`
gemma4). A drafter runs only on a target of its own family.
"""

from __future__ import annotations

import dataclasses
import json
import warnings
from pathlib import Path

import numpy as np
from jax.sharding import Mesh

from dspark_jax.config import DrafterConfig, TargetConfig, from_dict
from dspark_jax.errors import CheckpointError, ConfigError, DSparkError
from dspark_jax.formats.hf_checkpoint import (
    TensorMap,
    _host_array,
    _identity,
    _transpose,
    check_tensors,
    config_to_hf,
    gemma4_layer_key_map,
    iter_torch_tensors,
    layer_key_map,
    load_tensors,
    read_json,
    torch_dtype,
)
from dspark_jax.formats.safetensors_io import CheckpointFiles, save_dir
from dspark_jax.models.drafter import drafter_spec, is_gemma4, layer_config

SHARED_KEYS = ("embed_tokens.weight", "lm_head.weight")
# The `architectures` entry of a DeepSpec DSpark drafter, by target family.
ARCHITECTURES = {"qwen3": "Qwen3DSparkModel", "gemma4": "Gemma4DSparkModel"}


def drafter_family(hf: dict) -> str:
    """The target family a DeepSpec drafter config.json is for: by `architectures`, else by
    `target_model_type` / `model_type` (older Qwen3 exports name neither)."""
    archs = hf.get("architectures") or []
    for family, arch in ARCHITECTURES.items():
        if arch in archs:
            return family
    model_type = str(hf.get("target_model_type") or hf.get("model_type") or "")
    return "gemma4" if model_type.startswith("gemma4") else "qwen3"


def drafter_key_map(tcfg: TargetConfig, dcfg: DrafterConfig) -> list[TensorMap]:
    """Every drafter-owned tensor of a DeepSpec checkpoint (the shared embedding/head excluded)."""
    d, m, r, V = tcfg.hidden_size, tcfg.num_taps, dcfg.markov_rank, tcfg.vocab_size
    rows = [TensorMap("fc.weight", "fc", None, (d, m * d), _transpose, _transpose),
            TensorMap("hidden_norm.weight", "hidden_norm", None, (d,), _identity, _identity)]
    lcfg, Ld = layer_config(tcfg, dcfg), dcfg.num_draft_layers
    if is_gemma4(tcfg):
        rows += gemma4_layer_key_map(lcfg, list(range(Ld)), sliding=False, prefix="", path="layers")
    else:
        rows += layer_key_map(lcfg, Ld, prefix="")
    rows.append(TensorMap("norm.weight", "final_norm", None, (d,), _identity, _identity))
    if dcfg.has_markov:
        rows += [TensorMap("markov_head.markov_w1.weight", "markov_w1", None, (V, r), _identity, _identity),
                 TensorMap("markov_head.markov_w2.weight", "markov_w2", None, (V, r), _transpose, _transpose)]
        if dcfg.markov_head_type == "gated":
            rows += [TensorMap("markov_head.gate_proj.weight", "markov_gate_w", None, (r, d + r),
                               _transpose, _transpose),
                     TensorMap("markov_head.gate_proj.bias", "markov_gate_b", None, (r,), _identity, _identity)]
        elif dcfg.markov_head_type == "rnn":
            rows += [TensorMap("markov_head.joint_proj.weight", "markov_joint_w", None, (3 * r, 2 * r + d),
                               _transpose, _transpose),
                     TensorMap("markov_head.joint_proj.bias", "markov_joint_b", None, (3 * r,),
                               _identity, _identity)]
    if dcfg.enable_confidence_head:
        width = d + (r if dcfg.conf_uses_markov else 0)
        rows += [TensorMap("confidence_head.proj.weight", "conf_w", None, (1, width),
                           lambda a: a.reshape(-1), lambda a: a.reshape(1, -1)),
                 TensorMap("confidence_head.proj.bias", "conf_b", None, (1,), _identity, _identity)]
    return rows


# Fields of the drafter's config.json that must equal the target's.
_MUST_FIT = ("vocab_size", "hidden_size", "intermediate_size", "num_attention_heads",
             "num_key_value_heads", "head_dim", "rms_norm_eps")
_MUST_FIT_GEMMA4 = ("vocab_size", "hidden_size", "intermediate_size", "num_attention_heads",
                    "rms_norm_eps", "attention_k_eq_v")


def _gemma4_fit_problems(hf: dict, tcfg: TargetConfig) -> list[str]:
    """What in a Gemma4 drafter's config.json does not fit a Gemma4 target: the draft layers take the
    target's full-attention geometry and RoPE, and its final softcap."""
    problems = [f"{key} {hf.get(key)} != target {getattr(tcfg, key)}" for key in _MUST_FIT_GEMMA4
                if hf.get(key) != getattr(tcfg, key)]
    if hf.get("global_head_dim") != tcfg.full_head_dim:
        problems.append(f"global_head_dim {hf.get('global_head_dim')} != target {tcfg.full_head_dim}")
    # transformers reads num_global_key_value_heads only when keys are values.
    kv = (hf.get("num_global_key_value_heads") if hf.get("attention_k_eq_v") else None) \
        or hf.get("num_key_value_heads")
    if kv != tcfg.full_kv_heads:
        problems.append(f"full-attention KV heads {kv} != target {tcfg.full_kv_heads}")
    full = (hf.get("rope_parameters") or {}).get("full_attention") or {}
    if full.get("rope_type", "default") not in ("default", "proportional"):
        problems.append(f"rope_parameters.full_attention.rope_type {full.get('rope_type')!r} is not "
                        "'proportional'")
    theta = full.get("rope_theta")
    if theta is None or float(theta) != tcfg.full_rope_theta:
        problems.append(f"rope_parameters.full_attention.rope_theta {theta} != target "
                        f"{tcfg.full_rope_theta}")
    factor = float(full.get("partial_rotary_factor", 1.0))
    if factor != tcfg.partial_rotary_factor:
        problems.append(f"partial_rotary_factor {factor} != target {tcfg.partial_rotary_factor}")
    cap = float(hf.get("final_logit_softcapping") or 0.0)
    if cap != tcfg.final_logit_softcapping:
        problems.append(f"final_logit_softcapping {cap} != target {tcfg.final_logit_softcapping}")
    for key in ("hidden_size_per_layer_input", "enable_moe_block"):
        if hf.get(key):
            problems.append(f"{key} {hf[key]} is not supported (DeepSpec's drafter refuses it)")
    return problems


def target_fit_problems(hf: dict, tcfg: TargetConfig) -> list[str]:
    """What in a drafter's config.json does not fit the target (shapes, RoPE, tapped layers)."""
    problems = []
    if is_gemma4(tcfg):
        problems += _gemma4_fit_problems(hf, tcfg)
    else:
        for key in _MUST_FIT:
            mine = hf.get(key, hf["hidden_size"] // hf["num_attention_heads"] if key == "head_dim"
                          else None)
            if mine != getattr(tcfg, key):
                problems.append(f"{key} {mine} != target {getattr(tcfg, key)}")
        rope = (hf.get("rope_parameters") or {}).get("rope_theta", hf.get("rope_theta"))
        if rope is not None and float(rope) != tcfg.rope_theta:
            problems.append(f"rope_theta {rope} != target {tcfg.rope_theta}")
    if list(hf.get("target_layer_ids", [])) != list(tcfg.target_layer_ids):
        problems.append(f"target_layer_ids {hf.get('target_layer_ids')} != target's "
                        f"{list(tcfg.target_layer_ids)}")
    if hf.get("num_target_layers", tcfg.num_hidden_layers) != tcfg.num_hidden_layers:
        problems.append(f"num_target_layers {hf['num_target_layers']} != target "
                        f"{tcfg.num_hidden_layers}")
    return problems


def drafter_config_from_hf(hf: dict, tcfg: TargetConfig, where: str) -> DrafterConfig:
    """DrafterConfig from a DeepSpec config.json, checking that it fits the target."""
    family = drafter_family(hf)
    if family != tcfg.family:
        raise CheckpointError(f"{where}: a {ARCHITECTURES[family]} drafter (for {family} targets) "
                              f"cannot run on this {tcfg.family} target")
    problems = target_fit_problems(hf, tcfg)
    if hf.get("mask_token_id") != tcfg.mask_token_id:
        problems.append(f"mask_token_id {hf.get('mask_token_id')} != target {tcfg.mask_token_id}")
    if problems:
        raise CheckpointError(f"{where}: drafter does not fit the target: " + "; ".join(problems))
    rank = int(hf.get("markov_rank", 0) or 0)
    data = dict(num_draft_layers=hf.get("num_hidden_layers"), block_size=hf.get("block_size"),
                markov_rank=rank, enable_confidence_head=bool(hf.get("enable_confidence_head", False)),
                confidence_head_with_markov=bool(hf.get("confidence_head_with_markov", False)),
                num_anchors=hf.get("num_anchors", 512))
    if rank:
        data["markov_head_type"] = hf.get("markov_head_type", "vanilla")
    try:
        return from_dict(DrafterConfig, {k: v for k, v in data.items() if v is not None})
    except ConfigError as e:
        raise CheckpointError(f"{where}: {e}") from None


def gemma4_text_config(cfg: TargetConfig) -> dict:
    """The text fields of a transformers `gemma4_text` config.json for `cfg` (no tokens: bos/eos/pad
    ids are the tokenizer's). Features our models lack (per-layer inputs, KV sharing, MoE, the
    double-wide MLP) are written as off."""
    fields = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
              "num_attention_heads", "num_key_value_heads", "head_dim", "rms_norm_eps",
              "tie_word_embeddings", "max_position_embeddings", "attention_k_eq_v", "sliding_window")
    out = {"architectures": ["Gemma4ForCausalLM"], "model_type": "gemma4_text"}
    out.update({k: getattr(cfg, k) for k in fields})
    out.update(
        global_head_dim=cfg.full_head_dim, num_global_key_value_heads=cfg.full_kv_heads,
        layer_types=list(cfg.layer_types) or ["full_attention"] * cfg.num_hidden_layers,
        rope_parameters={
            "full_attention": {"partial_rotary_factor": cfg.partial_rotary_factor,
                               "rope_theta": cfg.full_rope_theta, "rope_type": "proportional"},
            "sliding_attention": {"rope_theta": cfg.rope_theta, "rope_type": "default"}},
        final_logit_softcapping=cfg.final_logit_softcapping or None,
        hidden_activation="gelu_pytorch_tanh", attention_bias=False, attention_dropout=0.0,
        hidden_size_per_layer_input=0, vocab_size_per_layer_input=cfg.vocab_size,
        num_kv_shared_layers=0, enable_moe_block=False, use_double_wide_mlp=False, num_experts=None,
        top_k_experts=None, moe_intermediate_size=None, use_bidirectional_attention=None,
        initializer_range=0.02, use_cache=True, dtype=cfg.dtype)
    return out


def drafter_config_to_hf(tcfg: TargetConfig, dcfg: DrafterConfig) -> dict:
    """A DeepSpec drafter config.json: the target's config (its text config for Gemma4) with the
    draft layers' count and types and the drafter fields."""
    lcfg = layer_config(tcfg, dcfg)
    if is_gemma4(tcfg):
        out = gemma4_text_config(lcfg)
        out.update(target_model_type="gemma4", target_text_model_type="gemma4_text",
                   dtype=dcfg.dtype)
    else:
        out = config_to_hf(lcfg)
        out.update(dtype=dcfg.dtype, torch_dtype=dcfg.dtype)
    out.update(architectures=[ARCHITECTURES[tcfg.family]], num_target_layers=tcfg.num_hidden_layers,
               block_size=dcfg.block_size, target_layer_ids=list(tcfg.target_layer_ids),
               mask_token_id=tcfg.mask_token_id, num_anchors=dcfg.num_anchors,
               markov_rank=dcfg.markov_rank, enable_confidence_head=dcfg.enable_confidence_head,
               confidence_head_with_markov=dcfg.conf_uses_markov, tie_word_embeddings=False)
    if dcfg.has_markov:
        out["markov_head_type"] = dcfg.markov_head_type
    return out


def _target_copies(target_params, tcfg: TargetConfig) -> dict[str, np.ndarray]:
    """The target's embedding and lm_head as host arrays (gathered from every process's shards on
    a mesh that spans processes: all must call it)."""
    embed = _host_array(target_params["embed"])
    head = embed if tcfg.tie_word_embeddings else _host_array(target_params["lm_head"]).T
    return {"embed_tokens.weight": embed, "lm_head.weight": head}


def load_drafter(directory: str | Path, tcfg: TargetConfig, target_params=None, *,
                 mesh: Mesh | None = None, on_mismatch: str = "error") -> tuple[DrafterConfig, dict]:
    """Imports a DeepSpec drafter directory: (DrafterConfig, float32 drafter params).

    With `target_params`, the checkpoint's embedding and lm_head copies are compared with the
    target's; a difference raises (`on_mismatch="error"`) or warns (`"warn"`).
    """
    directory = Path(directory)
    if not directory.is_dir():
        raise CheckpointError(f"{directory}: drafter directory not found")
    cfg_path = directory / "config.json"
    hf = read_json(cfg_path)
    if not set(ARCHITECTURES.values()) & set(hf.get("architectures") or []) and "block_size" not in hf:
        raise CheckpointError(f"{cfg_path}: not a DeepSpec DSpark drafter (architectures "
                              f"{hf.get('architectures')}, no block_size)")
    for key in ("hidden_size", "num_attention_heads", "num_hidden_layers", "block_size"):
        if key not in hf:
            raise CheckpointError(f"{cfg_path}: missing key {key!r}")
    dcfg = drafter_config_from_hf(hf, tcfg, str(cfg_path))
    files = CheckpointFiles(directory)
    key_map = drafter_key_map(tcfg, dcfg)
    check_tensors(files, key_map, str(directory), optional=frozenset(SHARED_KEYS))
    if target_params is not None:
        check_target_copies(files, target_params, tcfg, directory, on_mismatch)
    return dcfg, load_tensors(files, key_map, drafter_spec(tcfg, dcfg), mesh)


def check_target_copies(files: CheckpointFiles, target_params, tcfg: TargetConfig, directory: Path,
                        on_mismatch: str) -> None:
    """Compares a drafter checkpoint's embedding/lm_head copies (when present) with the target's;
    a difference raises (`on_mismatch="error"`) or warns (`"warn"`)."""
    if not any(key in files for key in ("embed_tokens.weight", "lm_head.weight")):
        return  # nothing to compare: the target's copies are not gathered to the host
    for key, ref in _target_copies(target_params, tcfg).items():
        if key not in files:
            continue
        mine = files.array(key)
        ref = ref.astype(mine.dtype)  # a bf16 export holds bf16-rounded copies
        diff = (float(np.max(np.abs(mine.astype(np.float32) - ref.astype(np.float32))))
                if mine.shape == ref.shape else float("inf"))
        if diff > 0:
            msg = (f"{directory}: {key} differs from the target's (max abs diff {diff:.3g}, "
                   f"shape {mine.shape} vs {ref.shape}); the drafter was trained against "
                   "another target, and ours will be used")
            if on_mismatch == "error":
                raise CheckpointError(msg)
            warnings.warn(msg, stacklevel=3)


def write_drafter_dir(out_dir: str | Path, dparams, key_map: list[TensorMap], tcfg: TargetConfig,
                      target_params, hf_config: dict, dtype: str) -> Path:
    """A DeepSpec-format directory: model.safetensors (the target's embedding, the drafter's own
    tensors by `key_map`, the target's lm_head, all in `dtype`) and config.json (`hf_config`)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    np_dtype = torch_dtype(dtype)

    def tensors():
        copies = _target_copies(target_params, tcfg)
        yield "embed_tokens.weight", copies["embed_tokens.weight"].astype(np_dtype)
        yield from iter_torch_tensors(dparams, key_map, np_dtype)
        yield "lm_head.weight", np.ascontiguousarray(copies["lm_head.weight"]).astype(np_dtype)

    save_dir(out, tensors(), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")
    return out


def save_drafter(dparams, tcfg: TargetConfig, dcfg: DrafterConfig, target_params,
                 out_dir: str | Path, *, dtype: str | None = None) -> Path:
    """Writes a DeepSpec-format drafter directory (with the target's embedding and head copies)."""
    hf = drafter_config_to_hf(tcfg, dcfg)
    if dtype:
        hf.update({k: dtype for k in ("dtype", "torch_dtype") if k in hf})
    return write_drafter_dir(out_dir, dparams, drafter_key_map(tcfg, dcfg), tcfg, target_params, hf,
                             dtype or dcfg.dtype)


def save_any(dparams, tcfg: TargetConfig, dcfg, target_params, out_dir: str | Path, *,
             dtype: str | None = None) -> Path:
    """`save_drafter`, or `eagle3.save_eagle3` for an Eagle3 drafter (by `dcfg.kind`)."""
    from dspark_jax.formats import eagle3

    save = {"dspark": save_drafter, "eagle3": eagle3.save_eagle3}[dcfg.kind]
    return save(dparams, tcfg, dcfg, target_params, out_dir, dtype=dtype)


def load_pair(target_dir: str | Path, drafter_dir: str | Path | None, mesh: Mesh | None = None):
    """(tcfg, target params, dcfg | None, drafter params | None) on `mesh`: a Hugging Face target
    read with the tapped layers and mask token the drafter names (checked against the target
    before any weight is read), and the drafter; `drafter_dir` None: the target alone. The
    drafter's kind comes from its config.json: `architectures` ["Qwen3Eagle3Model"] is an Eagle3
    drafter (`eagle3.load_eagle3_pair`, dcfg an Eagle3Config), anything else a DSpark/DFlash one."""
    from dspark_jax.formats import eagle3, hf_checkpoint

    if drafter_dir is None:
        tcfg, tparams = hf_checkpoint.load_target(target_dir, mesh=mesh)
        return tcfg, tparams, None, None
    where = Path(drafter_dir) / "config.json"
    if not Path(drafter_dir).is_dir():
        raise CheckpointError(f"{drafter_dir}: drafter directory not found")
    drafter_cfg = read_json(where)
    if eagle3.ARCHITECTURE in (drafter_cfg.get("architectures") or []):
        return eagle3.load_eagle3_pair(target_dir, drafter_dir, mesh)
    taps, mask = drafter_cfg.get("target_layer_ids"), drafter_cfg.get("mask_token_id")
    if not isinstance(taps, list) or not isinstance(mask, int):
        raise CheckpointError(f"{where}: needs target_layer_ids (list) and mask_token_id (int)")
    base = hf_checkpoint.load_target_config(target_dir)
    family = drafter_family(drafter_cfg)
    if family != base.family:
        raise CheckpointError(f"{where}: a {ARCHITECTURES[family]} drafter (for {family} targets) "
                              f"cannot run on the {base.family} target {target_dir}")
    try:
        dataclasses.replace(base, target_layer_ids=tuple(taps), mask_token_id=mask)
    except DSparkError as e:
        raise CheckpointError(f"{where}: does not fit the target {target_dir}: {e}") from None
    tcfg, tparams = hf_checkpoint.load_target(target_dir, mesh=mesh, target_layer_ids=taps,
                                              mask_token_id=mask)
    dcfg, dparams = load_drafter(drafter_dir, tcfg, tparams, mesh=mesh)
    return tcfg, tparams, dcfg, dparams
