"""Eagle3 drafter training on the tiny preset, in the shared trainer: learning, exact resume, export to
DeepSpec's Eagle3 format and back, the per-step training loss against the golden-tested full one,
presets and their errors."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dspark_jax.config import Eagle3Config, MeshConfig, load_config, preset_path, to_dict
from dspark_jax.errors import ConfigError
from dspark_jax.formats import eagle3 as eagle3_format
from dspark_jax.training import trainer
from dspark_jax.training.eagle3_loss import eagle3_loss, eagle3_train_loss, ttt_target_probs
from tests.test_train import check_resume_is_bit_exact, cli, make_cfg, overrides, train
from tests.test_train_sharding import one_step


def eagle3_cfg(tiny_target, workdir, *extra):
    return make_cfg(tiny_target, workdir, *extra, preset="eagle3-tiny")


def test_training_lowers_loss_and_raises_accuracy(tiny_target, tmp_path):
    cfg = eagle3_cfg(tiny_target, tmp_path / "run", "train.max_steps=30", "train.log_every=1")
    seen, summary = train(cfg)
    assert summary["step"] == 30 and sorted(seen) == list(range(1, 31))
    loss = np.array([seen[s]["loss"] for s in sorted(seen)])
    top1 = np.array([seen[s]["accuracy"][0] for s in sorted(seen)])
    assert loss[-5:].mean() < 0.9 * loss[:5].mean(), loss
    assert top1[-5:].mean() > top1[:5].mean() + 0.05, top1
    m = seen[30]
    assert len(m["step_loss"]) == len(m["accept_rate"]) == cfg.drafter.ttt_length
    assert 1.0 <= m["tau_greedy"] <= 1 + cfg.drafter.ttt_length and np.isfinite(m["grad_norm"])


def test_resume_is_bit_exact(tiny_target, tmp_path):
    check_resume_is_bit_exact(lambda work, *extra: eagle3_cfg(tiny_target, work, *extra), tmp_path,
                              steps=8, every=3, stop=4)


def test_cli_train_export_round_trip_and_kind_checks(tiny_target, tmp_path):
    work = tmp_path / "run"
    proc = cli("-m", "train.drafter", "--config", "eagle3-tiny",
               *overrides(tiny_target, work, "train.max_steps=2", "train.log_every=1"))
    text = proc.communicate(timeout=300)[0]
    assert proc.returncode == 0, text
    assert "drafter (eagle3)" in text and "step 2 | loss" in text and "top1@0" in text, text
    out = tmp_path / "exported"
    proc = cli("-m", "train.export", "--checkpoint", str(work), "--out", str(out))
    text = proc.communicate(timeout=300)[0]
    assert proc.returncode == 0, text
    cfg, params, step = trainer.load_drafter_params(work)
    assert step == 2 and isinstance(cfg.drafter, Eagle3Config)
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["Qwen3Eagle3Model"]
    assert (config["ttt_length"], config["target_layer_ids"]) == (4, [0, 1, 2])
    _, target_params = trainer.load_target_for(cfg, None)
    ecfg, imported = eagle3_format.load_eagle3(out, cfg.target, target_params)
    assert ecfg == cfg.drafter
    jax.tree.map(np.testing.assert_array_equal, params, imported)
    # The same workdir cannot go on as another kind of drafter.
    dspark = make_cfg(tiny_target, work, "train.max_steps=4")
    with pytest.raises(ConfigError, match=r"checkpoints/2: cannot resume: the checkpoint's drafter.kind "
                                          r"is 'eagle3', the config's 'dspark'"):
        trainer.run(dspark)


def test_batches_carry_the_sequence_and_no_anchors(tiny_target):
    from dspark_jax.formats.tokenizer import load_tokenizer
    from dspark_jax.training.data import BatchIterator, load_conversations

    target, data = tiny_target
    ds = load_conversations(data, load_tokenizer(target), max_length=64, min_length=5, system_prompt="")
    batch = next(BatchIterator(ds, global_batch_size=8, num_anchors=0, block_size=4, seed=0))
    assert sorted(batch) == ["attention_mask", "input_ids", "loss_mask"]
    perm = np.random.default_rng([0, 0]).permutation(len(ds))[:8]
    np.testing.assert_array_equal(batch["attention_mask"].sum(1), [len(ds.input_ids[i]) for i in perm])
    assert not (batch["loss_mask"] & ~batch["attention_mask"]).any()


@pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (fake) devices")
def test_sharded_step_equals_single_device():
    """The shared train step on data x fsdp x tensor = 2 x 2 x 2 (tolerances: test_train_sharding)."""
    cfg = load_config(preset_path("eagle3-tiny"), ["train.warmup_ratio=0"])
    rng = np.random.default_rng(0)
    rows, length = 8, 64
    lengths = rng.integers(30, length + 1, size=rows)
    valid = np.arange(length)[None, :] < lengths[:, None]
    starts = rng.integers(5, 20, size=rows)
    batch = {"input_ids": np.where(valid, rng.integers(4, 320, size=(rows, length)), 0).astype(np.int32),
             "loss_mask": valid & (np.arange(length)[None, :] >= starts[:, None]),
             "attention_mask": valid}
    ref_params, ref = one_step(cfg, MeshConfig(data=1, fsdp=1, tensor=1), batch)
    params, got = one_step(cfg, MeshConfig(data=2, fsdp=2, tensor=2), batch)
    for key in ("loss", "accept_rate", "accuracy", "grad_norm"):
        np.testing.assert_allclose(got[key], ref[key], atol=2e-5, rtol=0, err_msg=key)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=5e-5, rtol=0), params, ref_params)


def test_train_loss_equals_the_full_loss():
    """One step at a time (training) gives eagle3_loss's numbers on the full [B,K,S,V] tensors."""
    B, K, S, V, d = 2, 3, 9, 11, 5
    k1, k2, k3, k4 = jax.random.split(jax.random.key(0), 4)
    w = jax.random.normal(k1, (d, V))
    hidden = jax.random.normal(k2, (B, K, S, d))
    target_logits = 3 * jax.random.normal(k3, (B, S, V))
    mask = jax.random.bernoulli(k4, 0.7, (B, K, S))
    logits_fn = lambda w, h: h @ w

    def full(w, h):
        return eagle3_loss(logits_fn(w, h), ttt_target_probs(target_logits, K), mask, 0.8)

    def stepwise(w, h):
        return eagle3_train_loss(lambda x: logits_fn(w, x), h, target_logits, mask, 0.8)

    (l_full, m_full), g_full = jax.value_and_grad(full, argnums=(0, 1), has_aux=True)(w, hidden)
    (l_step, m_step), g_step = jax.jit(jax.value_and_grad(stepwise, argnums=(0, 1), has_aux=True))(w, hidden)
    np.testing.assert_allclose(l_step, l_full, rtol=1e-6)
    assert m_step.keys() == m_full.keys()
    for key in m_full:
        np.testing.assert_allclose(m_step[key], m_full[key], rtol=1e-6, atol=1e-7, err_msg=key)
    for a, b in zip(g_step, g_full):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("name, taps", [
    ("eagle3-qwen3-4b", (1, 9, 17, 25, 33)),
    ("eagle3-qwen3-8b", (1, 9, 17, 25, 33)),
    ("eagle3-qwen3-14b", (1, 10, 19, 28, 37)),
])
def test_released_recipe_presets(name, taps):
    cfg = load_config(preset_path(name))
    assert cfg.drafter == Eagle3Config(ttt_length=7, step_loss_decay=0.8, num_draft_layers=1,
                                       dtype="bfloat16")
    assert cfg.target.target_layer_ids == taps and cfg.target.num_hidden_layers - 1 not in taps
    dspark = load_config(preset_path(name.replace("eagle3", "dspark"))).train
    assert cfg.train == dspark  # the same optimizer, batch, length and epochs
    assert to_dict(cfg)["drafter"]["kind"] == "eagle3"


@pytest.mark.parametrize("overrides, pattern", [
    (["drafter.ttt_length=0"], r"eagle3-tiny.yaml: drafter.ttt_length: must be >= 1, got 0"),
    (["drafter.step_loss_decay=1.5"], r"drafter.step_loss_decay: must be in \(0, 1\], got 1.5"),
    (["drafter.num_draft_layers=2"], r"drafter.num_draft_layers: Eagle3 has exactly one draft layer"),
    (["drafter.block_size=7"], r"unknown config key 'drafter.block_size'; known keys under 'drafter': "
                               r"dtype, kind, num_draft_layers"),
    (["drafter.kind=medusa"], r"drafter.kind: expected one of \['dspark', 'eagle3'\], got 'medusa'"),
    (["train.max_length=4"], r"train.max_length: 4 must exceed drafter.ttt_length 4"),
    (["target.target_layer_ids=[]"], r"target.target_layer_ids: an Eagle3 drafter fuses tapped"),
])
def test_bad_preset_fields(overrides, pattern):
    with pytest.raises(ConfigError, match=pattern):
        load_config(preset_path("eagle3-tiny"), overrides)


def test_dspark_configs_and_old_checkpoints_stay_dspark(tiny_target, tmp_path):
    cfg = make_cfg(tiny_target, tmp_path / "r")
    assert cfg.drafter.kind == "dspark" and to_dict(cfg)["drafter"]["kind"] == "dspark"
    saved = to_dict(cfg)
    del saved["drafter"]["kind"]  # as checkpoints written before drafter kinds existed
    trainer.check_resumable(saved, cfg, "old")
    with pytest.raises(ConfigError, match=r"old: cannot resume: the checkpoint's drafter.kind is "
                                          r"'dspark', the config's 'eagle3'"):
        trainer.check_resumable(saved, eagle3_cfg(tiny_target, tmp_path / "r"), "old")


def test_full_size_step_shapes():
    """The 8B preset's train step traces (shapes only, no memory): loss and metrics per TTT step."""
    from dspark_jax.models.target import target_spec
    from dspark_jax.params import abstract
    from dspark_jax.training.train_step import drafter_params_spec, loss_fn

    cfg = load_config(preset_path("eagle3-qwen3-8b"))
    B, L = 1, 256
    batch = {"input_ids": jax.ShapeDtypeStruct((B, L), jnp.int32),
             "loss_mask": jax.ShapeDtypeStruct((B, L), bool),
             "attention_mask": jax.ShapeDtypeStruct((B, L), bool)}
    loss, metrics = jax.eval_shape(lambda p, t, b: loss_fn(p, t, b, cfg),
                                   abstract(drafter_params_spec(cfg)), abstract(target_spec(cfg.target)),
                                   batch)
    assert loss.shape == () and metrics["accuracy"].shape == (7,)
    fc = abstract(drafter_params_spec(cfg))["fc"]
    assert fc.shape == (5 * 4096, 4096)
