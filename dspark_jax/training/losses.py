"""The DSpark training loss and acceptance metrics (DESIGN §3, paper §3.3).

All terms share the position weights w_k = exp(-k / decay_gamma) · eval_mask and are each normalised
by the sum of their weights. p_d comes from the Markov-corrected draft logits, p_t from the target's
logits at the aligned positions (its prediction of the same next token). The TV term is the plain L1
distance ‖p_d − p_t‖₁ (= 2·TV), as the reference implementation computes it; the confidence label
c* = 1 − ½‖p_d − p_t‖₁ is exactly the acceptance probability of speculative sampling there.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dspark_jax.config import LossConfig


def position_weights(eval_mask: jax.Array, decay_gamma: float) -> jax.Array:
    """[..., T] float32: exp(-k / decay_gamma) on supervised positions, 0 elsewhere."""
    k = jnp.arange(eval_mask.shape[-1], dtype=jnp.float32)
    return jnp.exp(-k / decay_gamma) * eval_mask.astype(jnp.float32)


def loss_terms(draft_logits, conf_logits, target_logits, labels, eval_mask, decay_gamma: float):
    """Numerators of the CE, L1 and confidence terms, their shared denominator, and c*.

    draft_logits/target_logits [B,N,T,V]; conf_logits [B,N,T] or None; labels/eval_mask [B,N,T].
    """
    w = position_weights(eval_mask, decay_gamma)
    logp_d = jax.nn.log_softmax(draft_logits.astype(jnp.float32), axis=-1)
    p_d = jnp.exp(logp_d)
    p_t = jax.nn.softmax(target_logits.astype(jnp.float32), axis=-1)
    nll = -jnp.take_along_axis(logp_d, labels[..., None], axis=-1)[..., 0]
    l1 = jnp.sum(jnp.abs(p_d - p_t), axis=-1)  # [B,N,T]
    c_star = jax.lax.stop_gradient(jnp.clip(1.0 - 0.5 * l1, 0.0, 1.0))
    # where, not multiply: masked rows (dummy anchors) must not leak inf/NaN into the sums.
    valid = eval_mask.astype(bool)
    terms = {"ce_num": jnp.sum(jnp.where(valid, w * nll, 0.0)),
             "l1_num": jnp.sum(jnp.where(valid, w * l1, 0.0)),
             "den": jnp.sum(w)}
    if conf_logits is not None:
        z = conf_logits.astype(jnp.float32)
        bce = jnp.maximum(z, 0) - z * c_star + jnp.log1p(jnp.exp(-jnp.abs(z)))
        terms["confidence_num"] = jnp.sum(jnp.where(valid, w * bce, 0.0))
    return terms, c_star


def drafter_loss(draft_logits, conf_logits, target_logits, labels, eval_mask, cfg: LossConfig):
    """(scalar loss, metrics). Metrics are float32 scalars or per-position vectors [T]."""
    terms, c_star = loss_terms(draft_logits, conf_logits, target_logits, labels, eval_mask,
                               cfg.loss_decay_gamma)
    den = jnp.maximum(terms["den"], 1e-6)
    ce, l1 = terms["ce_num"] / den, terms["l1_num"] / den
    loss = cfg.ce_weight * ce + cfg.tv_weight * l1
    metrics = {"loss_ce": ce, "loss_tv": l1}
    if "confidence_num" in terms:
        conf_loss = terms["confidence_num"] / den
        loss = loss + cfg.confidence_weight * conf_loss
        metrics["loss_confidence"] = conf_loss
    metrics.update(acceptance_metrics(c_star, eval_mask, conf_logits))
    metrics["loss"] = loss
    metrics["loss_weight"] = terms["den"]  # what the loss is normalised by (micro-batches sum it)
    return loss, metrics


def acceptance_metrics(c_star, eval_mask, conf_logits=None):
    """accept_rate@k = mean c*_k over supervised positions; tau_prob = 1 + Σ_k Π_{i≤k} c*_i per
    fully supervised block; confidence error |σ(z) − c*| and bias σ(z) − c*."""
    m = eval_mask.astype(jnp.float32)
    per_pos = jnp.sum(c_star * m, axis=(0, 1)) / jnp.maximum(jnp.sum(m, axis=(0, 1)), 1.0)  # [T]
    full = m[..., -1]  # blocks supervised to the end: survival is defined at every position
    survival = jnp.cumprod(c_star, axis=-1)
    tau = jnp.sum((1.0 + jnp.sum(survival, -1)) * full) / jnp.maximum(jnp.sum(full), 1.0)
    out = {"accept_rate": per_pos, "tau_prob": tau}
    if conf_logits is not None:
        diff = (jax.nn.sigmoid(conf_logits.astype(jnp.float32)) - c_star) * m
        count = jnp.maximum(jnp.sum(m), 1.0)
        out["confidence_error"] = jnp.sum(jnp.abs(diff)) / count
        out["confidence_bias"] = jnp.sum(diff) / count
    return out
