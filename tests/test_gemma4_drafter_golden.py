"""DeepSpec's Gemma4 DSpark drafter (`Gemma4DSparkModel`) reproduces the golden tensors of the original
PyTorch code (../shared/reference/golden/gemma4): training forward, loss terms, two greedy proposals,
and its checkpoint round-trips bit for bit.

The target model is not needed: the golden file holds the target's tapped features and final hidden
state, and the drafter reads only the target's embedding table and config."""

import dataclasses
import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import yaml

from dspark_jax.config import PRESETS_DIR, LossConfig, TargetConfig, load_config
from dspark_jax.errors import CheckpointError
from dspark_jax.formats import deepspec, hf_checkpoint
from dspark_jax.models import drafter
from dspark_jax.models.target import lm_head
from dspark_jax.training.losses import drafter_loss, loss_terms
from dspark_jax.training.train_step import drafter_params_spec
from tests.conftest import GOLDEN

G4 = GOLDEN / "gemma4"
if not (G4 / "golden.safetensors").is_file():
    pytest.skip(f"Gemma4 golden tensors not found at {G4}", allow_module_level=True)

from safetensors.numpy import load_file  # noqa: E402

META = json.loads((GOLDEN / "golden.json").read_text())["gemma4"]


def assert_close(actual, desired, mask=None):
    """Equal up to float32 noise: 1e-5 of the largest reference magnitude. This pair's drawn norm
    weights and layer scalars give hidden states up to ~40 and logits up to ~30; the same forward in
    float64 lies 3e-4 from the (float32) golden hidden states, so an absolute 1e-4 is below the
    reference's own rounding."""
    actual, desired = np.asarray(actual), np.asarray(desired)
    if mask is not None:
        actual, desired = actual[mask], desired[mask]
    np.testing.assert_allclose(actual, desired, atol=1e-5 * (1 + np.abs(desired).max()), rtol=0)


def gemma4_target_config(hf: dict, **overrides) -> TargetConfig:
    """TargetConfig of the golden Gemma4 target, read field by field from its config.json."""
    rope = hf["rope_parameters"]
    return TargetConfig(
        vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"],
        intermediate_size=hf["intermediate_size"], num_hidden_layers=hf["num_hidden_layers"],
        num_attention_heads=hf["num_attention_heads"], num_key_value_heads=hf["num_key_value_heads"],
        head_dim=hf["head_dim"], rms_norm_eps=hf["rms_norm_eps"],
        rope_theta=rope["sliding_attention"]["rope_theta"],
        tie_word_embeddings=hf["tie_word_embeddings"],
        max_position_embeddings=hf["max_position_embeddings"], family="gemma4",
        layer_types=tuple(hf["layer_types"]), sliding_window=hf["sliding_window"],
        global_rope_theta=rope["full_attention"]["rope_theta"], global_head_dim=hf["global_head_dim"],
        num_global_key_value_heads=hf["num_global_key_value_heads"],
        attention_k_eq_v=hf["attention_k_eq_v"],
        partial_rotary_factor=rope["full_attention"]["partial_rotary_factor"],
        final_logit_softcapping=hf["final_logit_softcapping"], **overrides)


@pytest.fixture(scope="module")
def target():
    tcfg = gemma4_target_config(json.loads((G4 / "target" / "config.json").read_text()),
                                target_layer_ids=tuple(META["target_layer_ids"]),
                                mask_token_id=META["mask_token_id"])
    table = load_file(G4 / "target" / "model.safetensors")["model.embed_tokens.weight"]
    return tcfg, {"embed": jnp.asarray(table)}  # tied: the head is the table


@pytest.fixture(scope="module")
def loaded(target):
    tcfg, tp = target
    dcfg, dp = deepspec.load_drafter(G4 / "drafter", tcfg, tp)
    return dcfg, dp


@pytest.fixture(scope="module")
def golden():
    return load_file(G4 / "golden.safetensors")


@pytest.fixture(scope="module")
def train_blocks(target, loaded, golden):
    tcfg, tp = target
    dcfg, dp = loaded
    g = golden
    fwd = jax.jit(drafter.train_forward, static_argnums=(2, 3))
    args = (jnp.asarray(g["input_ids"]), jnp.asarray(g["loss_mask"]),
            jnp.asarray(g["target_context_features"]), jnp.asarray([META["anchors"]]),
            jnp.asarray([META["anchor_keep"]]))
    # Attention over 3 blocks at a time (7 blocks: the last group padded) gives the same blocks.
    chunked = fwd(dp, tp, tcfg, dataclasses.replace(dcfg, attention_chunk=3), *args)
    return fwd(dp, tp, tcfg, dcfg, *args), chunked


def test_config_and_cache_geometry(target, loaded):
    tcfg, _ = target
    dcfg, dp = loaded
    assert (dcfg.num_draft_layers, dcfg.block_size, dcfg.markov_rank, dcfg.markov_head_type,
            dcfg.num_anchors) == (5, 7, 16, "vanilla", 8)
    assert dcfg.enable_confidence_head and dcfg.conf_uses_markov
    layers = dp["layers"]
    assert "wv" not in layers  # keys are values
    assert layers["wq"].shape == (5, 64, 4, 32) and layers["wk"].shape == (5, 64, 1, 32)
    assert layers["layer_scalar"].shape == (5, 1) and dp["conf_w"].shape == (80,)
    cache = drafter.DraftCache.create(tcfg, dcfg, 2, 16)
    assert cache.k.shape == cache.v.shape == (5, 2, 16, 1, 32)


def test_training_forward(train_blocks, target, loaded, golden):
    tcfg, tp = target
    dcfg, dp = loaded
    g = golden
    tb, chunked = train_blocks
    np.testing.assert_allclose(chunked.logits, tb.logits, atol=1e-4, rtol=0)  # logits up to ~30
    h_ctx = drafter.context_features(dp, tcfg, jnp.asarray(g["target_context_features"]))
    assert_close(h_ctx, g["train_context_projected"])
    em = g["train_eval_mask"].astype(bool)
    np.testing.assert_array_equal(tb.labels, g["train_target_ids"])
    np.testing.assert_array_equal(tb.eval_mask, em)
    assert_close(tb.hidden, g["train_block_hidden"], em)
    assert_close(tb.logits, g["train_draft_logits"], em)
    assert_close(tb.conf_logits, g["train_confidence_logits"], em)


def aligned_target_logits(tb, tp, tcfg, g):
    """The target's (soft-capped) logits at the blocks' aligned positions, from its last hidden state."""
    B, N, T = tb.labels.shape
    hidden = jnp.take_along_axis(jnp.asarray(g["target_last_hidden"]),
                                 tb.aligned_index.reshape(B, N * T)[..., None], axis=1)
    return lm_head(tp, tcfg, hidden).reshape(B, N, T, -1)


def test_losses(train_blocks, target, golden):
    tcfg, tp = target
    g = golden
    tb, _ = train_blocks
    em = g["train_eval_mask"].astype(bool)
    target_logits = aligned_target_logits(tb, tp, tcfg, g)
    assert_close(target_logits, g["train_aligned_target_logits"], em)
    terms, _ = loss_terms(tb.logits, tb.conf_logits, target_logits, tb.labels, tb.eval_mask, 4.0)
    ref = META["loss_terms"]
    np.testing.assert_allclose(terms["ce_num"], ref["ce_loss_num"], rtol=1e-4)
    np.testing.assert_allclose(terms["l1_num"], ref["l1_loss_num"], rtol=1e-4)
    np.testing.assert_allclose(terms["confidence_num"], ref["confidence_loss_num"], rtol=1e-4)
    np.testing.assert_allclose(terms["den"], ref["ce_loss_den"], rtol=1e-4)
    # DeepSpec's total (0.1·ce + 0.9·l1 + 1.0·confidence, 1e-6 added to each denominator; ours
    # clamps it at 1e-6 instead, the same here to well under the tolerance).
    w = META["loss_weights"]
    loss, _ = drafter_loss(tb.logits, tb.conf_logits, target_logits, tb.labels, tb.eval_mask,
                           LossConfig(ce_weight=w["ce"], tv_weight=w["l1"],
                                      confidence_weight=w["confidence"],
                                      loss_decay_gamma=w["decay_gamma"]))
    np.testing.assert_allclose(loss, META["total_loss"], rtol=1e-4)


def check_proposal(prop, dp, dcfg, anchor, g, prefix):
    """A greedy proposal against the golden `{prefix}_*` tensors; the draft logits are the base
    logits plus the Markov bias of the previous token (the anchor, then each drafted token)."""
    assert_close(prop.hidden, g[f"{prefix}_block_hidden"])
    assert_close(prop.base_logits, g[f"{prefix}_base_logits"])
    np.testing.assert_array_equal(prop.tokens, g[f"{prefix}_draft_tokens"])
    assert_close(prop.conf_logits, g[f"{prefix}_confidence_logits"])
    prev = jnp.concatenate([anchor[:, None], prop.tokens[:, :-1]], axis=1)
    bias, conf = drafter.heads_teacher_forced(dp, dcfg, prop.hidden[:, None], prev[:, None])
    assert_close(prop.base_logits + bias[:, 0], g[f"{prefix}_draft_logits"])
    np.testing.assert_allclose(conf[:, 0], prop.conf_logits, atol=1e-5, rtol=0)
    np.testing.assert_array_equal(np.argmax(prop.probs, -1), prop.tokens)  # greedy: one-hot


def test_two_greedy_proposals(target, loaded, golden):
    tcfg, tp = target
    dcfg, dp = loaded
    g = golden
    n = g["infer_prompt_ids"].shape[1]
    np.testing.assert_array_equal(g["infer_positions"][0], np.arange(n + dcfg.block_size))
    propose = jax.jit(drafter.propose, static_argnums=(2, 3))
    extend = jax.jit(drafter.extend_context, static_argnums=(1, 2))
    greedy, keys = jnp.zeros((1,)), jax.random.split(jax.random.key(0), 1)
    cache = drafter.DraftCache.create(tcfg, dcfg, 1, 32)
    pos = jnp.arange(n)[None]
    cache = extend(dp, tcfg, dcfg, cache, jnp.asarray(g["infer_prompt_features"]), pos,
                   jnp.ones((1, n), bool))
    anchor = jnp.asarray(g["infer_anchor"], jnp.int32)
    prop = propose(dp, tp, tcfg, dcfg, cache, anchor, jnp.asarray([n]), greedy, keys)
    check_proposal(prop, dp, dcfg, anchor, g, "infer")

    # Verification accepted nothing: the anchor's features join the context at position n and the
    # target's own token is the next anchor, at n + 1.
    accepted = int(g["infer_accepted"][0])
    committed = g["infer_committed_tokens"]
    assert accepted == META["infer"]["accepted"] == 0 and committed.shape == (1, 1)
    start = META["infer"]["second_start"]
    np.testing.assert_array_equal(g["infer2_positions"][0], np.arange(start - 1, start + dcfg.block_size))
    feats = jnp.asarray(g["infer_committed_features"])
    cache = extend(dp, tcfg, dcfg, cache, feats, jnp.asarray([[n]]), jnp.ones((1, 1), bool))
    anchor2 = jnp.asarray(committed[:, -1], jnp.int32)
    prop2 = propose(dp, tp, tcfg, dcfg, cache, anchor2, jnp.asarray([start]), greedy, keys)
    check_proposal(prop2, dp, dcfg, anchor2, g, "infer2")


def test_export_is_bit_identical(tmp_path, target, loaded):
    tcfg, tp = target
    dcfg, dp = loaded
    out = deepspec.save_drafter(dp, tcfg, dcfg, tp, tmp_path / "export")
    mine, ref = load_file(out / "model.safetensors"), load_file(G4 / "drafter" / "model.safetensors")
    assert sorted(mine) == sorted(ref)
    for key in ref:
        assert mine[key].dtype == ref[key].dtype and np.array_equal(mine[key], ref[key]), key
    # The config is the golden one but for the tokenizer's ids, transformers' version and the
    # stray top-level RoPE keys transformers adds on its own.
    hf = json.loads((out / "config.json").read_text())
    gold = json.loads((G4 / "drafter" / "config.json").read_text())
    for key in ("bos_token_id", "eos_token_id", "pad_token_id", "transformers_version"):
        gold.pop(key)
    gold["rope_parameters"] = {k: v for k, v in gold["rope_parameters"].items()
                               if k in ("full_attention", "sliding_attention")}
    assert hf == gold
    dcfg2, dp2 = deepspec.load_drafter(out, tcfg, tp)
    assert dcfg2 == dcfg
    jax.tree.map(np.testing.assert_array_equal, dp2, dp)


def test_family_mismatch_is_refused(tmp_path, target):
    tcfg, tp = target
    with pytest.raises(CheckpointError, match=r"a Qwen3DSparkModel drafter \(for qwen3 targets\) "
                                              r"cannot run on this gemma4 target"):
        deepspec.load_drafter(GOLDEN / "vanilla" / "drafter", tcfg, tp)
    qcfg = hf_checkpoint.load_target_config(GOLDEN / "target", target_layer_ids=[0, 2], mask_token_id=3)
    with pytest.raises(CheckpointError, match=r"a Gemma4DSparkModel drafter \(for gemma4 targets\) "
                                              r"cannot run on this qwen3 target"):
        deepspec.load_drafter(G4 / "drafter", qcfg)
    # A Gemma4 drafter for another Gemma4 geometry: every problem in one line.
    bad = tmp_path / "bad"
    shutil.copytree(G4 / "drafter", bad)
    hf = json.loads((bad / "config.json").read_text())
    hf.update(global_head_dim=16, final_logit_softcapping=None)
    hf["rope_parameters"]["full_attention"]["partial_rotary_factor"] = 1.0
    (bad / "config.json").write_text(json.dumps(hf))
    with pytest.raises(CheckpointError, match=r"does not fit the target: global_head_dim 16 != target "
                                              r"32; partial_rotary_factor 1.0 != target 0.25; "
                                              r"final_logit_softcapping 0.0 != target 30.0$"):
        deepspec.load_drafter(bad, tcfg, tp)


def test_preset_builds_the_training_spec(tmp_path):
    """The released recipe's preset over a small 48-layer Gemma4 target: the trainer's spec is the
    Gemma4 drafter's (full-attention geometry, no value projection, the layer scalars)."""
    shutil.copy(PRESETS_DIR / "dspark-gemma4-12b.yaml", tmp_path)
    small = dict(family="gemma4", vocab_size=320, hidden_size=64, intermediate_size=128,
                 num_hidden_layers=48, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                 global_head_dim=32, num_global_key_value_heads=1, attention_k_eq_v=True,
                 partial_rotary_factor=0.25, rope_theta=1.0e4, global_rope_theta=1.0e6,
                 sliding_window=8, final_logit_softcapping=30.0, tie_word_embeddings=True,
                 layer_types=(["sliding_attention"] * 5 + ["full_attention"]) * 8)
    (tmp_path / "gemma4-12b.yaml").write_text(yaml.safe_dump({"target": small}))
    cfg = load_config(tmp_path / "dspark-gemma4-12b.yaml")
    t, d = cfg.target, cfg.drafter
    assert t.target_layer_ids == (5, 17, 29, 41, 46) and t.mask_token_id == 4
    assert (d.num_draft_layers, d.block_size, d.markov_rank, d.markov_head_type) == (5, 7, 256, "vanilla")
    assert d.enable_confidence_head and d.conf_uses_markov
    assert (cfg.train.loss.ce_weight, cfg.train.loss.tv_weight, cfg.train.loss.confidence_weight,
            cfg.train.loss.loss_decay_gamma) == (0.1, 0.9, 1.0, 4.0)
    spec = drafter_params_spec(cfg)
    layers = spec["layers"]
    assert "wv" not in layers and layers["wk"].shape == (5, 64, 1, 32)
    assert layers["wq"].shape == (5, 64, 4, 32) and layers["layer_scalar"].shape == (5, 1)
    assert spec["fc"].shape == (5 * 64, 64) and spec["conf_w"].shape == (64 + 256,)
    keys = {m.path for m in deepspec.drafter_key_map(t, d)}
    flat = {"/".join(str(k.key) for k in path) for path, _ in
            jax.tree_util.tree_flatten_with_path(spec)[0]}
    assert keys == flat  # the checkpoint covers every trained tensor


@pytest.mark.skipif(not (PRESETS_DIR / "gemma4-12b.yaml").is_file(), reason="no gemma4-12b target preset")
def test_released_preset_spec():
    """The bundled preset over the bundled Gemma4-12B target: the spec has the target's full-attention
    geometry (shapes only, nothing allocated)."""
    cfg = load_config(PRESETS_DIR / "dspark-gemma4-12b.yaml")
    t = cfg.target
    assert t.family == "gemma4" and t.target_layer_ids == (5, 17, 29, 41, 46) and t.mask_token_id == 4
    layers = drafter_params_spec(cfg)["layers"]
    assert layers["wk"].shape == (5, t.hidden_size, t.full_kv_heads, t.full_head_dim)
    assert ("wv" in layers) == (not t.attention_k_eq_v)
