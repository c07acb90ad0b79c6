"""The JAX Eagle3 drafter reproduces the golden tensors of DeepSpec's PyTorch Eagle3
(../shared/reference/golden/eagle3): TTT training forward, soft targets, masks, loss and metrics, the
greedy chain before and after one verification; and the DeepSpec format round-trips bit for bit."""

import dataclasses
import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dspark_jax.errors import CheckpointError
from dspark_jax.formats import deepspec
from dspark_jax.formats import eagle3 as eagle3_format
from dspark_jax.models import eagle3
from dspark_jax.models.target import KVCache, forward
from dspark_jax.params import abstract
from dspark_jax.training.eagle3_loss import (
    eagle3_loss,
    ttt_position_mask,
    ttt_step_ce,
    ttt_target_probs,
)
from tests.conftest import GOLDEN

EAGLE3 = GOLDEN / "eagle3"
if not (EAGLE3 / "golden.safetensors").is_file() or not (GOLDEN / "golden.json").is_file():
    pytest.skip(f"Eagle3 golden tensors not found at {EAGLE3}", allow_module_level=True)

from safetensors.numpy import load_file  # noqa: E402

META = json.loads((GOLDEN / "golden.json").read_text())["eagle3"]
ATOL = 1e-4


def close(actual, expected, what):
    """Asserts |actual - expected| <= ATOL everywhere; returns the max deviation."""
    dev = float(np.max(np.abs(np.asarray(actual, np.float32) - np.asarray(expected, np.float32))))
    assert dev <= ATOL, f"{what}: max abs deviation {dev:.3g} > {ATOL}"
    return dev


@pytest.fixture(scope="module")
def pair():
    tcfg, tp, ecfg, dp = eagle3_format.load_eagle3_pair(GOLDEN / "target", EAGLE3 / "drafter")
    return tcfg, tp, ecfg, dp, load_file(EAGLE3 / "golden.safetensors")


@pytest.fixture(scope="module")
def training(pair):
    """The target forward and the jitted TTT forward over the golden sequence."""
    tcfg, tp, ecfg, dp, g = pair
    ids, am = jnp.asarray(g["input_ids"]), jnp.asarray(g["attention_mask"])
    tout = forward(tp, tcfg, ids, jnp.arange(ids.shape[1])[None])
    ttt = jax.jit(eagle3.ttt_forward, static_argnums=(2, 3))(dp, tp, tcfg, ecfg, ids, am, tout.taps)
    return tout, ttt


def test_checkpoint_import(pair):
    tcfg, _, ecfg, dp, _ = pair
    assert list(tcfg.target_layer_ids) == META["target_layer_ids"]
    assert (ecfg.ttt_length, ecfg.step_loss_decay, ecfg.num_draft_layers) == (
        META["ttt_length"], META["step_loss_decay"], META["draft_num_hidden_layers"])
    shapes = lambda tree: jax.tree.map(lambda a: (a.shape, a.dtype), tree)
    assert shapes(dp) == shapes(abstract(eagle3.eagle3_spec(tcfg, ecfg)))
    assert dp["layers"]["wq"].shape == (1, 2 * tcfg.hidden_size, tcfg.num_attention_heads, tcfg.head_dim)


def test_training_forward(pair, training):
    tcfg, _, ecfg, _, g = pair
    tout, ttt = training
    K, S = ecfg.ttt_length, g["input_ids"].shape[1]
    close(tout.taps, g["target_context_features"], "target_context_features")
    close(tout.hidden, g["target_last_hidden"], "target_last_hidden")
    close(tout.logits, g["train_target_logits"], "train_target_logits")
    np.testing.assert_array_equal(eagle3.ttt_step_tokens(jnp.asarray(g["input_ids"]), K),
                                  g["train_step_input_ids"])
    np.testing.assert_array_equal(eagle3.ttt_positions(S, K)[None], g["train_step_rope_positions"])
    # train_step_hidden[k] is step k's layer output (what step k+1 is fed): behind its logits.
    close(ttt.hidden, g["train_step_hidden"], "train_step_hidden")
    mask = g["train_position_mask"].astype(bool)
    close(np.asarray(ttt.logits)[mask], g["train_draft_logits"][mask], "train_draft_logits (counted)")
    # Queries that see nothing have zero attention output here as in DeepSpec: equal everywhere.
    close(ttt.logits, g["train_draft_logits"], "train_draft_logits (all)")


@pytest.mark.parametrize("ttt_length", [1, 3])
def test_shorter_horizon_gives_the_first_steps(pair, ttt_length):
    """Steps never look ahead: a horizon of K' < 7 reproduces the golden run's first K' steps."""
    tcfg, tp, ecfg, dp, g = pair
    short = dataclasses.replace(ecfg, ttt_length=ttt_length)
    out = jax.jit(eagle3.ttt_forward, static_argnums=(2, 3))(
        dp, tp, tcfg, short, jnp.asarray(g["input_ids"]), jnp.asarray(g["attention_mask"]),
        jnp.asarray(g["target_context_features"]))
    assert out.logits.shape[1] == ttt_length
    close(out.logits, g["train_draft_logits"][:, :ttt_length], f"ttt_length {ttt_length} logits")


def test_targets_masks_and_loss(pair, training):
    _, _, ecfg, _, g = pair
    tout, ttt = training
    K = ecfg.ttt_length
    probs = ttt_target_probs(tout.logits, K)
    close(probs, g["train_target_probs"], "train_target_probs")
    pm = ttt_position_mask(jnp.asarray(g["loss_mask"]), jnp.asarray(g["attention_mask"]), K)
    np.testing.assert_array_equal(pm, g["train_position_mask"].astype(bool))
    close(ttt_step_ce(ttt.logits, probs, pm), g["train_step_ce"], "train_step_ce")

    loss, m = jax.jit(eagle3_loss, static_argnums=3)(ttt.logits, probs, pm, ecfg.step_loss_decay)
    ref = META["loss_terms"]
    close(m["step_ce_num"], ref["step_ce_num"], "step_ce_num")
    np.testing.assert_array_equal(m["step_den"], ref["step_den"])
    close(m["step_loss"], ref["step_loss"], "step_loss")
    close(ecfg.step_loss_decay ** np.arange(K), ref["step_weight"], "step_weight")
    close(loss, ref["total_loss"], "total_loss")
    metrics = META["metrics"]
    for k in range(K):
        close(m["accuracy_num"][k], metrics[f"accuracy@{k}"]["num"], f"accuracy@{k}")
        close(m["accept_rate_num"][k], metrics[f"accept_rate@{k}"]["num"], f"accept_rate@{k}")
        assert m["valid_tokens"][k] == metrics[f"valid_tokens@{k}"] == metrics[f"accept_rate@{k}"]["den"]
        assert metrics[f"accuracy@{k}"]["den"] == metrics[f"valid_tokens@{k}"]
        close(m["step_loss"][k], metrics[f"ploss_{k}"], f"ploss_{k}")
    close(m["tau_greedy_num"], metrics["tau_greedy"]["num"], "tau_greedy")
    close(m["tau_probabilistic_num"], metrics["tau_probabilistic"]["num"], "tau_probabilistic")
    assert m["tau_den"] == metrics["tau_greedy"]["den"] == metrics["tau_probabilistic"]["den"]
    close(m["loss"], metrics["loss"], "loss")


def test_loss_has_gradients(pair):
    """The TTT forward and loss differentiate through every step (finite, nonzero on every tensor)."""
    tcfg, tp, ecfg, dp, g = pair
    ids, am, lm = (jnp.asarray(g[k]) for k in ("input_ids", "attention_mask", "loss_mask"))
    taps = jnp.asarray(g["target_context_features"])
    probs = ttt_target_probs(jnp.asarray(g["train_target_logits"]), ecfg.ttt_length)
    pm = ttt_position_mask(lm, am, ecfg.ttt_length)

    def loss_fn(p):
        out = eagle3.ttt_forward(p, tp, tcfg, ecfg, ids, am, taps)
        return eagle3_loss(out.logits, probs, pm, ecfg.step_loss_decay)[0]

    grads = jax.jit(jax.grad(loss_fn))(dp)
    for name, x in jax.tree_util.tree_leaves_with_path(grads):
        x = np.asarray(x)
        assert np.isfinite(x).all() and np.abs(x).max() > 0, jax.tree_util.keystr(name)


def test_right_padding_changes_nothing_counted(pair, training):
    """Junk rows past the valid length (attention mask 0) do not reach any counted position."""
    tcfg, tp, ecfg, dp, g = pair
    _, ttt = training
    K, pad = ecfg.ttt_length, 9
    rng = np.random.default_rng(0)
    ids = np.concatenate([g["input_ids"], rng.integers(1, tcfg.vocab_size, (1, pad))], 1)
    am = np.concatenate([g["attention_mask"], np.zeros((1, pad), np.int64)], 1)
    lm = np.concatenate([g["loss_mask"], np.ones((1, pad), np.int64)], 1)  # ignored past the end
    taps = np.concatenate([g["target_context_features"],
                           rng.normal(size=(1, pad, g["target_context_features"].shape[-1]))], 1)
    out = jax.jit(eagle3.ttt_forward, static_argnums=(2, 3))(
        dp, tp, tcfg, ecfg, jnp.asarray(ids), jnp.asarray(am), jnp.asarray(taps, jnp.float32))
    pm = np.asarray(ttt_position_mask(jnp.asarray(lm), jnp.asarray(am), K))
    S = g["input_ids"].shape[1]
    np.testing.assert_array_equal(pm[..., :S], g["train_position_mask"].astype(bool))
    assert not pm[..., S:].any()
    mask = pm[..., :S]
    np.testing.assert_allclose(np.asarray(out.logits)[..., :S, :][mask], np.asarray(ttt.logits)[mask],
                               atol=1e-5, rtol=0)


def test_greedy_chain_and_second_proposal(pair):
    tcfg, tp, ecfg, dp, g = pair
    K = ecfg.ttt_length
    prompt = jnp.asarray(g["infer_prompt_ids"])
    n = prompt.shape[1]
    pos = jnp.arange(n)[None]
    tout = forward(tp, tcfg, prompt, pos, cache=KVCache.create(tcfg, 1, 32))
    close(tout.taps, g["infer_prompt_features"], "infer_prompt_features")
    anchor = jnp.argmax(tout.logits[:, -1], -1).astype(jnp.int32)
    np.testing.assert_array_equal(anchor, g["infer_anchor"])

    # Prefill: the prompt's features paired with the prompt shifted by one, then the anchor.
    cache = eagle3.Eagle3Cache.create(tcfg, ecfg, 1, 32)
    shifted = jnp.concatenate([prompt[:, 1:], anchor[:, None]], axis=1)
    cache, h = eagle3.extend_context(dp, tp, tcfg, ecfg, cache, shifted, tout.taps, pos,
                                     jnp.ones_like(prompt, bool))
    greedy = jnp.zeros((1,)), jax.random.split(jax.random.key(0), 1)
    propose = jax.jit(eagle3.propose, static_argnums=(2, 3))
    prop = propose(dp, tp, tcfg, ecfg, cache, h[:, -1], jnp.asarray([n - 1]), *greedy)
    np.testing.assert_array_equal(prop.tokens, g["infer_draft_tokens"])
    close(prop.logits, g["infer_draft_logits"], "infer_draft_logits")
    close(prop.hidden, g["infer_draft_hidden"], "infer_draft_hidden")
    np.testing.assert_array_equal(n - 1 + jnp.arange(K)[None], g["infer_draft_positions"])
    np.testing.assert_array_equal(np.argmax(prop.probs, -1), prop.tokens)  # greedy: one-hot

    # Greedy verification of anchor + drafts at positions n .. n+K.
    verify = jnp.concatenate([anchor[:, None], prop.tokens], axis=1)
    vout = forward(tp, tcfg, verify, n + jnp.arange(K + 1)[None], cache=tout.cache)
    target_next = np.asarray(jnp.argmax(vout.logits, -1))[0]
    drafts = np.asarray(prop.tokens)[0]
    accepted = int(np.cumprod(drafts == target_next[:K]).sum())
    assert accepted == int(g["infer_accepted"][0])
    committed = np.concatenate([drafts[:accepted], target_next[accepted:accepted + 1]])[None]
    np.testing.assert_array_equal(committed, g["infer_committed_tokens"])
    features = vout.taps[:, :accepted + 1]
    close(features, g["infer_committed_features"], "infer_committed_features")

    # The cache is cut back to n (implicitly: slots past n are rewritten before they are read)
    # and extended with the committed tokens paired with the verified rows' features.
    cpos = n + jnp.arange(accepted + 1)[None]
    cache, h = eagle3.extend_context(dp, tp, tcfg, ecfg, prop.cache, jnp.asarray(committed), features,
                                     cpos, jnp.ones_like(cpos, bool))
    prop2 = propose(dp, tp, tcfg, ecfg, cache, h[:, -1], cpos[:, -1], *greedy)
    np.testing.assert_array_equal(prop2.tokens, g["infer2_draft_tokens"])
    close(prop2.logits, g["infer2_draft_logits"], "infer2_draft_logits")
    close(prop2.hidden, g["infer2_draft_hidden"], "infer2_draft_hidden")
    np.testing.assert_array_equal(cpos[:, -1:] + jnp.arange(K)[None], g["infer2_draft_positions"])


def test_export_import_round_trip(pair, tmp_path):
    tcfg, tp, ecfg, dp, _ = pair
    out = eagle3_format.save_eagle3(dp, tcfg, ecfg, tp, tmp_path / "drafter",
                                    target_name_or_path="../../target")
    ecfg2, dp2 = eagle3_format.load_eagle3(out, tcfg, tp)
    assert ecfg2 == ecfg
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), dp2, dp)
    # Every tensor, the target copies included, is the golden checkpoint's, bit for bit.
    ours, theirs = load_file(out / "model.safetensors"), load_file(EAGLE3 / "drafter" / "model.safetensors")
    assert sorted(ours) == sorted(theirs)
    for key in theirs:
        assert ours[key].dtype == theirs[key].dtype and ours[key].shape == theirs[key].shape, key
        assert ours[key].tobytes() == theirs[key].tobytes(), key
    hf, ref = (json.loads((d / "config.json").read_text()) for d in (out, EAGLE3 / "drafter"))
    for key in ("architectures", "num_hidden_layers", "draft_num_hidden_layers", "num_target_layers",
                "target_layer_ids", "ttt_length", "step_loss_decay", "tie_word_embeddings",
                "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
                "head_dim", "vocab_size", "rms_norm_eps", "rope_parameters", "target_model_name_or_path"):
        assert hf[key] == ref[key], key


def _drafter_copy(tmp_path, **changes):
    d = tmp_path / "drafter"
    shutil.copytree(EAGLE3 / "drafter", d)
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(changes)
    (d / "config.json").write_text(json.dumps(cfg))
    return d


@pytest.mark.parametrize("changes, expected", [
    (dict(hidden_size=32), "hidden_size 32 != target 64"),
    (dict(vocab_size=256), "vocab_size 256 != target 320"),
    (dict(num_key_value_heads=4), "num_key_value_heads 4 != target 2"),
    (dict(target_layer_ids=[0, 2]), "target_layer_ids [0, 2] != target's [0, 1, 2]"),
    (dict(num_target_layers=6), "num_target_layers 6 != target 4"),
    (dict(rope_parameters={"rope_theta": 1e6, "rope_type": "default"}), "rope_theta 1000000.0"),
    (dict(architectures=["Qwen3DSparkModel"]), "not a DeepSpec Eagle3 drafter"),
    (dict(draft_num_hidden_layers=2, num_hidden_layers=2), "draft_num_hidden_layers 2"),
    (dict(ttt_length=0), "ttt_length: must be >= 1"),
])
def test_drafter_that_does_not_fit_is_refused(pair, tmp_path, changes, expected):
    tcfg, tp = pair[:2]
    d = _drafter_copy(tmp_path, **changes)
    with pytest.raises(CheckpointError) as info:
        eagle3_format.load_eagle3(d, tcfg, tp)
    message = str(info.value)
    assert expected in message and str(d) in message, message


def test_pair_refuses_tapping_the_last_layer(tmp_path):
    d = _drafter_copy(tmp_path, target_layer_ids=[0, 1, 3])
    with pytest.raises(CheckpointError, match="target_layer_ids") as info:
        eagle3_format.load_eagle3_pair(GOLDEN / "target", d)
    assert str(d / "config.json") in str(info.value)


def test_bad_tensors_and_target_copies_are_refused(pair, tmp_path):
    tcfg, tp = pair[:2]
    d = _drafter_copy(tmp_path)
    from safetensors.numpy import save_file

    tensors = load_file(d / "model.safetensors")
    tensors["layers.0.self_attn.q_proj.weight"] = tensors["layers.0.self_attn.q_proj.weight"][:, :64]
    del tensors["layers.0.hidden_norm.weight"]
    save_file(tensors, str(d / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CheckpointError) as info:
        eagle3_format.load_eagle3(d, tcfg, tp)
    message = str(info.value)
    assert "missing: layers.0.hidden_norm.weight" in message
    assert "layers.0.self_attn.q_proj.weight: (64, 64) (expected (64, 128))" in message

    d2 = _drafter_copy(tmp_path / "other")
    tensors = load_file(d2 / "model.safetensors")
    tensors["lm_head.weight"] = tensors["lm_head.weight"] + 0.25
    save_file(tensors, str(d2 / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"lm_head\.weight differs from the target's"):
        eagle3_format.load_eagle3(d2, tcfg, tp)
    with pytest.warns(UserWarning, match=r"lm_head\.weight differs"):
        eagle3_format.load_eagle3(d2, tcfg, tp, on_mismatch="warn")


def test_dspark_loader_refuses_an_eagle3_checkpoint(pair):
    with pytest.raises(CheckpointError, match="not a DeepSpec DSpark drafter"):
        deepspec.load_drafter(EAGLE3 / "drafter", pair[0], pair[1])
