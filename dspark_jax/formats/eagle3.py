"""DeepSpec-format Eagle3 drafters (DESIGN §3b, §9): import into JAX params, export back.

The directory holds `config.json` (the target's Qwen3 config with `architectures`
["Qwen3Eagle3Model"], one layer, `num_target_layers`, `target_layer_ids`, `ttt_length`,
`step_loss_decay`) and `model.safetensors` with keys without a `model.` prefix: `fc.weight [d, m*d]`,
`norm.weight`, `embed_tokens.weight` and `lm_head.weight` (copies of the target's, compared on import
and written on export, as for DSpark drafters), and `layers.0.*`: the Qwen3 layer keys with q/k/v
projections of input width 2d, plus `layers.0.hidden_norm.weight`.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from jax.sharding import Mesh

from dspark_jax.config import Eagle3Config, TargetConfig, from_dict
from dspark_jax.errors import CheckpointError, ConfigError, DSparkError
from dspark_jax.formats.deepspec import (
    SHARED_KEYS,
    check_target_copies,
    target_fit_problems,
    write_drafter_dir,
)
from dspark_jax.formats.hf_checkpoint import (
    TensorMap,
    _identity,
    _transpose,
    check_tensors,
    config_to_hf,
    layer_key_map,
    load_tensors,
    read_json,
)
from dspark_jax.formats.safetensors_io import CheckpointFiles
from dspark_jax.models.eagle3 import eagle3_spec, layer_config

ARCHITECTURE = "Qwen3Eagle3Model"
_WIDE_INPUTS = ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight")


def eagle3_key_map(tcfg: TargetConfig, ecfg: Eagle3Config) -> list[TensorMap]:
    """Every drafter-owned tensor of a DeepSpec Eagle3 checkpoint (embedding and head excluded)."""
    d, m = tcfg.hidden_size, tcfg.num_taps
    rows = [TensorMap("fc.weight", "fc", None, (d, m * d), _transpose, _transpose)]
    for row in layer_key_map(layer_config(tcfg, ecfg), ecfg.num_draft_layers, prefix=""):
        if row.key.endswith(_WIDE_INPUTS):  # their input is [embedding; hidden]
            row = dataclasses.replace(row, torch_shape=(row.torch_shape[0], 2 * d))
        rows.append(row)
    rows += [TensorMap(f"layers.{i}.hidden_norm.weight", "layers/hidden_norm", i, (d,), _identity,
                       _identity) for i in range(ecfg.num_draft_layers)]
    rows.append(TensorMap("norm.weight", "final_norm", None, (d,), _identity, _identity))
    return rows


def refuse_other_families(family: str, where: str, target_dir=None) -> None:
    """DeepSpec's Eagle3 drafter exists for Qwen3 targets only (a Qwen3 layer over their features)."""
    if family != "qwen3":
        named = f" {target_dir}" if target_dir else ""
        raise CheckpointError(f"{where}: an Eagle3 drafter ({ARCHITECTURE}) runs on qwen3 targets "
                              f"only; the target{named} is {family}")


def eagle3_config_from_hf(hf: dict, tcfg: TargetConfig, where: str) -> Eagle3Config:
    """Eagle3Config from a DeepSpec config.json, checking that it fits the target."""
    refuse_other_families(tcfg.family, where)
    problems = target_fit_problems(hf, tcfg)
    if problems:
        raise CheckpointError(f"{where}: Eagle3 drafter does not fit the target: " + "; ".join(problems))
    layers = hf.get("draft_num_hidden_layers", hf.get("num_hidden_layers"))
    if hf.get("num_hidden_layers", layers) != layers:
        raise CheckpointError(f"{where}: num_hidden_layers {hf['num_hidden_layers']} != "
                              f"draft_num_hidden_layers {layers}")
    if layers is not None and layers != 1:
        raise CheckpointError(f"{where}: draft_num_hidden_layers {layers}: only one-layer Eagle3 "
                              "drafters exist (DeepSpec's Qwen3Eagle3Model)")
    data = dict(num_draft_layers=layers, ttt_length=hf.get("ttt_length"),
                step_loss_decay=hf.get("step_loss_decay"))
    try:
        return from_dict(Eagle3Config, {k: v for k, v in data.items() if v is not None})
    except ConfigError as e:
        raise CheckpointError(f"{where}: {e}") from None


def eagle3_config_to_hf(tcfg: TargetConfig, ecfg: Eagle3Config, target_name_or_path: str | None = None
                        ) -> dict:
    out = config_to_hf(layer_config(tcfg, ecfg))
    out.update(architectures=[ARCHITECTURE], draft_num_hidden_layers=ecfg.num_draft_layers,
               num_target_layers=tcfg.num_hidden_layers, target_layer_ids=list(tcfg.target_layer_ids),
               ttt_length=ecfg.ttt_length, step_loss_decay=ecfg.step_loss_decay,
               tie_word_embeddings=False, dtype=ecfg.dtype, torch_dtype=ecfg.dtype)
    if target_name_or_path is not None:
        out["target_model_name_or_path"] = target_name_or_path
    return out


def _read_config(directory: Path) -> tuple[Path, dict]:
    if not directory.is_dir():
        raise CheckpointError(f"{directory}: Eagle3 drafter directory not found")
    cfg_path = directory / "config.json"
    hf = read_json(cfg_path)
    if ARCHITECTURE not in (hf.get("architectures") or []):
        raise CheckpointError(f"{cfg_path}: not a DeepSpec Eagle3 drafter (architectures "
                              f"{hf.get('architectures')}, expected [{ARCHITECTURE!r}])")
    for key in ("hidden_size", "num_attention_heads", "target_layer_ids"):
        if key not in hf:
            raise CheckpointError(f"{cfg_path}: missing key {key!r}")
    taps = hf["target_layer_ids"]
    if not isinstance(taps, list) or not all(isinstance(i, int) for i in taps):
        raise CheckpointError(f"{cfg_path}: target_layer_ids must be a list of integers, got {taps!r}")
    return cfg_path, hf


def load_eagle3(directory: str | Path, tcfg: TargetConfig, target_params=None, *,
                mesh: Mesh | None = None, on_mismatch: str = "error") -> tuple[Eagle3Config, dict]:
    """Imports a DeepSpec Eagle3 drafter directory: (Eagle3Config, float32 drafter params).

    With `target_params`, the checkpoint's embedding and lm_head copies are compared with the
    target's; a difference raises (`on_mismatch="error"`) or warns (`"warn"`).
    """
    directory = Path(directory)
    cfg_path, hf = _read_config(directory)
    ecfg = eagle3_config_from_hf(hf, tcfg, str(cfg_path))
    files = CheckpointFiles(directory)
    key_map = eagle3_key_map(tcfg, ecfg)
    check_tensors(files, key_map, str(directory), optional=frozenset(SHARED_KEYS))
    if target_params is not None:
        check_target_copies(files, target_params, tcfg, directory, on_mismatch)
    return ecfg, load_tensors(files, key_map, eagle3_spec(tcfg, ecfg), mesh)


def save_eagle3(dparams, tcfg: TargetConfig, ecfg: Eagle3Config, target_params, out_dir: str | Path,
                *, dtype: str | None = None, target_name_or_path: str | None = None) -> Path:
    """Writes a DeepSpec-format Eagle3 directory (with the target's embedding and head copies)."""
    hf = eagle3_config_to_hf(tcfg, ecfg, target_name_or_path)
    if dtype:
        hf.update(dtype=dtype, torch_dtype=dtype)
    return write_drafter_dir(out_dir, dparams, eagle3_key_map(tcfg, ecfg), tcfg, target_params, hf,
                             dtype or ecfg.dtype)


def load_eagle3_pair(target_dir: str | Path, drafter_dir: str | Path, mesh: Mesh | None = None):
    """(tcfg, target params, ecfg, drafter params): a Hugging Face target read with the tapped
    layers the drafter names (checked against the target before any weight is read), and the
    drafter."""
    from dspark_jax.formats import hf_checkpoint

    cfg_path, hf = _read_config(Path(drafter_dir))
    base = hf_checkpoint.load_target_config(target_dir)
    refuse_other_families(base.family, str(cfg_path), target_dir)
    try:
        dataclasses.replace(base, target_layer_ids=tuple(hf["target_layer_ids"]))
    except DSparkError as e:
        raise CheckpointError(f"{cfg_path}: does not fit the target {target_dir}: {e}") from None
    tcfg, tparams = hf_checkpoint.load_target(target_dir, mesh=mesh,
                                              target_layer_ids=hf["target_layer_ids"])
    ecfg, dparams = load_eagle3(drafter_dir, tcfg, tparams, mesh=mesh)
    return tcfg, tparams, ecfg, dparams
