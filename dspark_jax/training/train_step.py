"""The jitted drafter train step: frozen target forward, drafter forward/backward, AdamW update.

The target runs once per sequence without gradient. For DSpark/DFlash its lm_head is applied only
at the positions the blocks supervise (never a [batch, seq, vocab] tensor); Eagle3's soft targets
need the target's logits at every position (one [batch, seq, vocab] tensor in the target's dtype),
and its loss takes the TTT steps one at a time. Master weights are float32; the target and the
drafter compute in their configured dtypes. Everything is sharded by the mesh: the batch over
(data, fsdp), parameters by their logical axes.

What differs between kinds of drafter (`drafter.kind`) is one row of `KINDS`: the parameter spec,
the loss and what the batches carry; the step, the optimizer and the trainer are shared.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax
from flax import struct
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from dspark_jax.config import Config, TargetConfig
from dspark_jax.errors import ConfigError
from dspark_jax.models import eagle3
from dspark_jax.models.drafter import cast_compute, drafter_spec, train_forward
from dspark_jax.models.target import TargetOutput, forward, lm_head, param_dtype
from dspark_jax.params import abstract, init_params, map_infos, shardings
from dspark_jax.training.eagle3_loss import eagle3_train_loss, ttt_position_mask
from dspark_jax.training.losses import drafter_loss

BATCH_AXES = ("data", "fsdp")


@struct.dataclass
class TrainState:
    step: jax.Array  # int32 scalar
    params: Any  # drafter params, float32
    opt_state: Any


def make_optimizer(cfg: Config, total_steps: int) -> optax.GradientTransformation:
    """AdamW with linear warmup then cosine decay to 0, after global-norm clipping."""
    t = cfg.train
    warmup = int(round(t.warmup_ratio * total_steps))
    schedule = optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=t.learning_rate, warmup_steps=warmup,
        decay_steps=max(total_steps, warmup + 1), end_value=0.0)
    return optax.chain(optax.clip_by_global_norm(t.grad_clip),
                       optax.adamw(schedule, b1=t.adam_b1, b2=t.adam_b2,
                                   weight_decay=t.weight_decay))


def init_state(cfg: Config, optimizer, key: jax.Array, mesh: Mesh | None = None) -> TrainState:
    """Random drafter params (sharded on `mesh`) and a fresh optimizer state."""
    params = init_params(drafter_params_spec(cfg), key, mesh)
    opt_state = jax.jit(optimizer.init)(params)
    state = TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=opt_state)
    if mesh is None:
        return state
    # Scalars (step, Adam's count) replicated on the mesh, so the state the step returns has the
    # same shardings as the one it was given: no recompilation on the second step.
    replicated = NamedSharding(mesh, PartitionSpec())
    return jax.device_put(state, jax.tree.map(
        lambda x: x.sharding if isinstance(x.sharding, NamedSharding) else replicated, state))


def abstract_state(cfg: Config, optimizer, mesh: Mesh | None = None) -> TrainState:
    """The TrainState `init_state` makes, as jax.ShapeDtypeStruct leaves with the same shardings:
    for compiling the step (a memory plan) without allocating anything."""
    params = abstract(drafter_params_spec(cfg), mesh)
    opt_state = jax.eval_shape(optimizer.init, params)
    state = TrainState(step=jax.ShapeDtypeStruct((), jnp.int32), params=params, opt_state=opt_state)
    if mesh is None:
        return state
    replicated = NamedSharding(mesh, PartitionSpec())
    # The shardings `jit(optimizer.init)` gives the optimizer state, as in `init_state`.
    opt_shardings = jax.jit(optimizer.init).lower(params).compile().output_shardings
    shard = TrainState(step=replicated, params=jax.tree.map(lambda x: x.sharding, params),
                       opt_state=opt_shardings)
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(
        x.shape, x.dtype, sharding=s if isinstance(s, NamedSharding) else replicated), state, shard)


def state_shardings(state: TrainState):
    return jax.tree.map(lambda x: x.sharding, state)


def frozen_target(target_params, tcfg: TargetConfig, ids: jax.Array,
                  rows: NamedSharding | None = None) -> TargetOutput:
    """The target over whole sequences [B, L], without gradient and without logits."""
    B, L = ids.shape
    positions = jnp.broadcast_to(jnp.arange(L), (B, L))
    return forward(jax.lax.stop_gradient(target_params), tcfg, ids, positions, compute_logits=False,
                   batch_sharding=rows)


def dspark_loss_fn(dparams, target_params, batch, cfg: Config, rows: NamedSharding | None = None):
    tcfg, dcfg = cfg.target, cfg.drafter
    ids = batch["input_ids"]
    B = ids.shape[0]
    target_params = jax.lax.stop_gradient(target_params)
    out = frozen_target(target_params, tcfg, ids, rows)
    blocks = train_forward(dparams, target_params, tcfg, dcfg, ids, batch["loss_mask"], out.taps,
                           batch["anchors"], batch["anchor_keep"], batch_sharding=rows)
    _, N, T = blocks.labels.shape
    aligned = jnp.take_along_axis(out.hidden, blocks.aligned_index.reshape(B, N * T)[..., None], 1)
    target_logits = lm_head(target_params, tcfg, aligned).reshape(B, N, T, -1)
    return drafter_loss(blocks.logits, blocks.conf_logits, target_logits, blocks.labels,
                        blocks.eval_mask, cfg.train.loss)


def eagle3_loss_fn(dparams, target_params, batch, cfg: Config, rows: NamedSharding | None = None):
    """Test-time training over whole sequences against the target's distributions (DESIGN §3b)."""
    tcfg, ecfg = cfg.target, cfg.drafter
    ids, attention_mask = batch["input_ids"], batch["attention_mask"]
    target_params = jax.lax.stop_gradient(target_params)
    out = frozen_target(target_params, tcfg, ids, rows)
    target_logits = lm_head(target_params, tcfg, out.hidden).astype(param_dtype(tcfg))  # [B,L,V]
    hidden = eagle3.ttt_hidden(dparams, target_params, tcfg, ecfg, ids, attention_mask, out.taps)
    dp = cast_compute(dparams, ecfg)
    position_mask = ttt_position_mask(batch["loss_mask"], attention_mask, ecfg.ttt_length)
    loss, metrics = eagle3_train_loss(lambda h: eagle3.draft_logits(dp, target_params, tcfg, h),
                                      hidden, target_logits, position_mask, ecfg.step_loss_decay,
                                      cfg.train.max_length)
    metrics["loss_weight"] = metrics["step_den"][0]  # every step's loss is divided by B x max_length
    return loss, metrics


@dataclasses.dataclass(frozen=True)
class DrafterKind:
    """What training needs to know about one kind of drafter."""

    spec: Callable[[TargetConfig, Any], dict]  # ArrayInfo tree of the drafter's own weights
    loss: Callable[..., tuple[jax.Array, dict]]  # (dparams, target_params, batch, cfg, rows)
    num_anchors: Callable[[Any], int]  # anchored blocks per sequence in its batches (0: none)


KINDS = {
    "dspark": DrafterKind(spec=drafter_spec, loss=dspark_loss_fn, num_anchors=lambda d: d.num_anchors),
    "eagle3": DrafterKind(spec=eagle3.eagle3_spec, loss=eagle3_loss_fn, num_anchors=lambda d: 0),
}


def drafter_kind(cfg: Config) -> DrafterKind:
    return KINDS[cfg.drafter.kind]


def drafter_params_spec(cfg: Config) -> dict:
    """ArrayInfo tree of the run's drafter, whichever its kind."""
    return drafter_kind(cfg).spec(cfg.target, cfg.drafter)


def loss_fn(dparams, target_params, batch, cfg: Config, rows: NamedSharding | None = None):
    """(scalar loss, metrics) of the run's kind of drafter on one batch; `rows`: on a mesh, the
    activations' layout (the batch axes), which the embedding lookups would otherwise take from
    the table (model dimension over `fsdp`: every device computing the whole batch)."""
    return drafter_kind(cfg).loss(dparams, target_params, batch, cfg, rows)


def make_train_step(cfg: Config, optimizer, state_sharding=None
                    ) -> Callable[[TrainState, Any, dict], tuple[TrainState, dict]]:
    """jit(step)(state, target_params, batch) -> (state, metrics); the state is donated.

    With `train.microbatches` M > 1 the batch is split into M micro-batches run one after another
    (a scan: the activations of one micro-batch at a time) and their gradients summed, each weighed
    by its share of the loss's denominator (`loss_weight`), so that the update is the one-batch
    update up to float rounding: a DSpark loss is normalised by the position weights of the whole
    batch, not averaged over micro-batches. The metrics are combined with the same weights (the loss
    terms exactly; ratios such as the acceptance rates weighed by the loss weights)."""
    shardings = [s for s in jax.tree.leaves(state_sharding) if isinstance(s, NamedSharding)]
    mesh = shardings[0].mesh if shardings else None
    rows = batch_sharding(mesh) if mesh is not None else None
    M = cfg.train.microbatches
    grad_fn = jax.grad(loss_fn, has_aux=True)

    def gradients(params, target_params, batch):
        if M == 1:
            grads, metrics = grad_fn(params, target_params, batch, cfg, rows)
            metrics.pop("loss_weight")
            return grads, metrics
        micro = jax.tree.map(lambda x: split_microbatches(x, M, mesh), batch)

        def one(acc, mb):
            grads, metrics = grad_fn(params, target_params, mb, cfg, rows)
            w = metrics.pop("loss_weight")
            return jax.tree.map(lambda a, x: a + w * x, acc, (grads, metrics, jnp.ones(()))), None

        first = jax.tree.map(lambda x: x[0], micro)
        _, shapes = jax.eval_shape(lambda mb: grad_fn(params, target_params, mb, cfg, rows), first)
        shapes.pop("loss_weight")
        zeros = (jax.tree.map(jnp.zeros_like, params),
                 jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), shapes), jnp.zeros(()))
        (grads, metrics, total), _ = jax.lax.scan(one, zeros, micro)
        scale = 1.0 / jnp.maximum(total, 1e-6)
        return jax.tree.map(lambda x: x * scale, (grads, metrics))

    def step(state: TrainState, target_params, batch):
        grads, metrics = gradients(state.params, target_params, batch)
        updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        metrics["grad_norm"] = optax.tree.norm(grads)
        return TrainState(step=state.step + 1, params=params, opt_state=opt_state), metrics

    out_shardings = None if state_sharding is None else (state_sharding, None)
    return jax.jit(step, donate_argnums=0, out_shardings=out_shardings)


def split_microbatches(x: jax.Array, m: int, mesh: Mesh | None = None) -> jax.Array:
    """[B, ...] -> [m, B/m, ...]: micro-batch i holds the rows b with b % m == i, so that each
    device's rows of every micro-batch are rows it already holds (no data moves) when the batch is
    split over the batch axes in contiguous blocks of a multiple of m rows."""
    B = x.shape[0]
    out = x.reshape(B // m, m, *x.shape[1:]).swapaxes(0, 1)
    if mesh is None:
        return out
    return jax.lax.with_sharding_constraint(out, NamedSharding(mesh, PartitionSpec(None, BATCH_AXES)))


def check_microbatches(cfg: Config, batch_devices: int) -> None:
    """`train.microbatches` must split the global batch into equal micro-batches that still cover
    every device of the batch axes (data x fsdp)."""
    m, g = cfg.train.microbatches, cfg.train.global_batch_size
    if g % m:
        raise ConfigError(f"train.microbatches {m}: must divide train.global_batch_size {g}")
    if (g // m) % batch_devices:
        raise ConfigError(f"train.microbatches {m}: a micro-batch of {g // m} sequences does not "
                          f"split over the {batch_devices} devices of the batch axes (mesh.data x "
                          f"mesh.fsdp); use a divisor of {g // batch_devices}")


def batch_sharding(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec(BATCH_AXES))


def describe_params(spec, mesh: Mesh) -> list[str]:
    """One line per parameter: name, shape, dtype, partition spec (for run logs)."""
    shard = shardings(spec, mesh)
    lines = []
    map_infos(lambda name, i: lines.append(f"{name} {i.shape} {jnp.dtype(i.dtype).name}"), spec)
    specs = [str(s.spec) for s in jax.tree.leaves(shard)]
    return [f"{line} {s}" for line, s in zip(lines, specs)]

