"""On 8 fake CPU devices, a sharded train step (data x fsdp x tensor) gives the loss and parameters
of the single-device step. Tolerances (float32; only the order of reductions differs): 2e-5 on the
loss and gradient norm; 5e-5 on parameters after the step, i.e. 1.7 % of the learning rate, because
Adam's first update divides each gradient by its own magnitude, so an element whose gradient is
near zero turns reduction-order noise into up to one learning-rate-sized step (seen: 6.6e-6)."""

import dataclasses

import jax
import numpy as np
import pytest

from dspark_jax.config import MeshConfig, load_config, preset_path
from dspark_jax.models.target import target_spec
from dspark_jax.params import init_params
from dspark_jax.sharding import make_mesh
from dspark_jax.training.data import make_global_batch, sample_anchors
from dspark_jax.training.train_step import init_state, make_optimizer, make_train_step, state_shardings

pytestmark = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (fake) devices")


def batch_for(cfg, rows=8, length=64, seed=0):
    rng = np.random.default_rng(seed)
    ids = rng.integers(4, cfg.target.vocab_size, size=(rows, length)).astype(np.int32)
    mask = np.zeros((rows, length), bool)
    for r in range(rows):
        mask[r, rng.integers(5, 20): rng.integers(40, length)] = True
    anchors, keep = zip(*(sample_anchors(m, cfg.drafter.num_anchors, rng) for m in mask))
    return {"input_ids": ids, "loss_mask": mask, "anchors": np.stack(anchors),
            "anchor_keep": np.stack(keep)}


def one_step(cfg, mesh_cfg, batch):
    cfg = dataclasses.replace(cfg, mesh=mesh_cfg)
    mesh = make_mesh(mesh_cfg)
    target = init_params(target_spec(cfg.target), jax.random.key(1), mesh)
    opt = make_optimizer(cfg, total_steps=10)
    state = init_state(cfg, opt, jax.random.key(0), mesh)
    step = make_train_step(cfg, opt, state_shardings(state))
    state, metrics = step(state, target, make_global_batch(batch, mesh))
    return jax.device_get(state.params), jax.device_get(metrics)


def test_sharded_step_equals_single_device():
    cfg = load_config(preset_path("dspark-tiny"), ["train.warmup_ratio=0"])
    batch = batch_for(cfg)
    ref_params, ref = one_step(cfg, MeshConfig(data=1, fsdp=1, tensor=1), batch)
    params, got = one_step(cfg, MeshConfig(data=2, fsdp=2, tensor=2), batch)
    np.testing.assert_allclose(got["loss"], ref["loss"], atol=2e-5, rtol=0)
    np.testing.assert_allclose(got["accept_rate"], ref["accept_rate"], atol=2e-5, rtol=0)
    np.testing.assert_allclose(got["grad_norm"], ref["grad_norm"], atol=2e-5, rtol=0)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=5e-5, rtol=0), params, ref_params)


def test_activations_on_an_fsdp_mesh_are_split_by_batch():
    """The embedding table's model dimension is sharded over fsdp; without a constraint its lookup
    hands that layout to every activation (each device then computes the whole batch). The train
    step lays the rows out over the batch axes: the target's features come out split by batch."""
    from jax.sharding import NamedSharding, PartitionSpec

    from dspark_jax.training.train_step import batch_sharding, frozen_target

    cfg = load_config(preset_path("dspark-tiny"))
    mesh = make_mesh(MeshConfig(data=1, fsdp=8, tensor=1))
    target = init_params(target_spec(cfg.target), jax.random.key(1), mesh)
    assert target["embed"].sharding.spec == PartitionSpec("tensor", "fsdp")
    ids = jax.device_put(np.zeros((8, 16), np.int32), NamedSharding(mesh, PartitionSpec(("data", "fsdp"))))
    rows = batch_sharding(mesh)
    hidden = jax.jit(lambda t, i, r: frozen_target(t, cfg.target, i, r).hidden, static_argnums=2)
    split, whole = hidden(target, ids, rows), hidden(target, ids, None)
    assert split.sharding.shard_shape(split.shape)[0] == 1  # one sequence per device
    assert whole.sharding.shard_shape(whole.shape)[0] == 8  # without it: the whole batch on each


def test_microbatches_give_the_one_batch_step():
    """`train.microbatches`: the global batch run as 2 or 4 micro-batches in turn (on one device and
    on data x fsdp = 2 x 2) gives the loss, gradient norm and parameters of the one-batch step.
    The rows' supervised lengths differ, so averaging the micro-batches' own losses would not."""
    cfg = load_config(preset_path("dspark-tiny"), ["train.warmup_ratio=0"])
    batch = batch_for(cfg, seed=3)
    rng = np.random.default_rng(3)
    for r in range(0, 8, 2):  # the even rows (one micro-batch of 2) supervise few positions
        batch["loss_mask"][r] = False
        batch["loss_mask"][r, 5:14] = True
        batch["anchors"][r], batch["anchor_keep"][r] = sample_anchors(
            batch["loss_mask"][r], cfg.drafter.num_anchors, rng)
    ref_params, ref = one_step(cfg, MeshConfig(data=1, fsdp=1, tensor=1), batch)
    micro = lambda m: dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, microbatches=m))
    for m, mesh in ((4, MeshConfig(data=1, fsdp=1, tensor=1)), (2, MeshConfig(data=2, fsdp=2, tensor=2))):
        params, got = one_step(micro(m), mesh, batch)
        for key in ("loss", "loss_ce", "loss_tv", "loss_confidence", "grad_norm"):
            np.testing.assert_allclose(got[key], ref[key], atol=2e-5, rtol=0, err_msg=f"{m}: {key}")
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=5e-5, rtol=0), params, ref_params)
    # The negative control: the mean of the micro-batches' own losses is another number.
    halves = [one_step(cfg, MeshConfig(data=1, fsdp=1, tensor=1),
                       {k: v[i::2] for k, v in batch.items()})[1]["loss"] for i in (0, 1)]
    assert abs(np.mean(halves) - ref["loss"]) > 1e-3, (halves, ref["loss"])  # 50 x the tolerance


def test_microbatches_of_an_eagle3_step():
    cfg = load_config(preset_path("eagle3-tiny"), ["train.warmup_ratio=0"])
    rng = np.random.default_rng(1)
    rows, length = 8, 48
    valid = np.arange(length)[None, :] < rng.integers(20, length + 1, size=rows)[:, None]
    batch = {"input_ids": np.where(valid, rng.integers(4, 320, size=(rows, length)), 0).astype(np.int32),
             "loss_mask": valid & (np.arange(length)[None, :] >= rng.integers(3, 10, size=rows)[:, None]),
             "attention_mask": valid}
    ref_params, ref = one_step(cfg, MeshConfig(data=1, fsdp=1, tensor=1), batch)
    cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, microbatches=2))
    params, got = one_step(cfg, MeshConfig(data=2, fsdp=1, tensor=1), batch)
    for key in ("loss", "grad_norm"):
        np.testing.assert_allclose(got[key], ref[key], atol=2e-5, rtol=0, err_msg=key)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=5e-5, rtol=0), params, ref_params)


@pytest.mark.parametrize("m, devices, pattern", [
    (3, 1, "train.microbatches 3: must divide train.global_batch_size 8"),
    (4, 4, "train.microbatches 4: a micro-batch of 2 sequences does not split over the 4 devices"),
])
def test_bad_microbatches(m, devices, pattern):
    from dspark_jax.errors import ConfigError
    from dspark_jax.training.train_step import check_microbatches

    cfg = load_config(preset_path("dspark-tiny"), ["train.global_batch_size=8", f"train.microbatches={m}"])
    with pytest.raises(ConfigError, match=pattern):
        check_microbatches(cfg, devices)
    with pytest.raises(ConfigError, match="microbatches"):
        load_config(preset_path("dspark-tiny"), ["train.microbatches=0"])
