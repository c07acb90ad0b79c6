"""The Eagle3 test-time-training loss and DeepSpec's logged metrics (DESIGN §3b).

Step k at position t predicts token t+2+k; its soft target is the target's distribution at t+1+k.
Position t counts at step k when token t+k is a response token and not the last valid one (the
loss mask with the last valid position cleared, shifted left by k). Each step's soft cross-entropy
is summed over counted positions and divided by batch × sequence length (not by the count);
the loss is Σ_k decay^k · step_loss[k]. Shapes: B batch, K steps, S sequence, V vocabulary.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def _shifted(x_bs: jax.Array, ttt_length: int, fill) -> jax.Array:
    """[B, K, S]: x[b, t+k], `fill` where t+k is past the end."""
    S = x_bs.shape[1]
    index = jnp.arange(S)[None, :] + jnp.arange(ttt_length)[:, None]  # [K,S]
    return jnp.where(index < S, jnp.take(x_bs, jnp.minimum(index, S - 1), axis=1), fill)


def ttt_target_probs(target_logits_bsv: jax.Array, ttt_length: int) -> jax.Array:
    """[B, K, S, V] float32: softmax of the target logits at t+1+k, uniform where t+1+k >= S."""
    V = target_logits_bsv.shape[-1]
    p = jax.nn.softmax(target_logits_bsv.astype(jnp.float32), axis=-1)
    p_next = jnp.concatenate([p[:, 1:], jnp.full_like(p[:, :1], 1.0 / V)], axis=1)  # at t+1
    S = p.shape[1]
    index = jnp.arange(S)[None, :] + jnp.arange(ttt_length)[:, None]  # [K,S]
    gathered = jnp.take(p_next, jnp.minimum(index, S - 1), axis=1)  # [B,K,S,V]
    return jnp.where((index < S)[None, :, :, None], gathered, 1.0 / V)


def ttt_position_mask(loss_mask: jax.Array, attention_mask: jax.Array, ttt_length: int) -> jax.Array:
    """[B, K, S] bool: the loss mask without the last valid position, shifted left by k (zero fill).
    attention_mask [B, S] is right-padded: its sum is the valid length."""
    S = loss_mask.shape[1]
    valid_len = jnp.sum(attention_mask.astype(jnp.int32), axis=-1, keepdims=True)
    counted = loss_mask.astype(bool) & (jnp.arange(S)[None, :] < valid_len - 1)
    return _shifted(counted, ttt_length, False)


def ttt_step_ce(draft_logits: jax.Array, target_probs: jax.Array, position_mask: jax.Array) -> jax.Array:
    """[B, K, S] float32: −Σ_v p_t · log_softmax(draft), 0 where the position does not count."""
    logp = jax.nn.log_softmax(draft_logits.astype(jnp.float32), axis=-1)
    ce = -jnp.sum(target_probs * logp, axis=-1)
    return jnp.where(position_mask, ce, 0.0)  # where, not multiply: no inf/NaN leaks


def eagle3_loss(draft_logits: jax.Array, target_probs: jax.Array, position_mask: jax.Array,
                step_loss_decay: float):
    """(scalar loss, metrics) from draft logits/target probs [B, K, S, V] and the mask [B, K, S].

    Metrics (float32; per-step entries are vectors [K]), as DeepSpec logs them: `step_ce_num`,
    `step_den`, `step_loss`; `accuracy_num` (draft argmax == target argmax) and `accept_rate_num`
    (clamped 1 − ½‖p_d − p_t‖₁) over counted positions, `valid_tokens` (their count) and the ratios;
    `tau_greedy` / `tau_probabilistic`: 1 + Σ_k Π_{i≤k} (correctness / accept rate at step i, zero
    where not counted) at each position counted at step 0, averaged over those (`tau_den`).
    """
    B, K, S = position_mask.shape
    target_probs = jax.lax.stop_gradient(target_probs)
    ce = ttt_step_ce(draft_logits, target_probs, position_mask)
    step_ce_num = jnp.sum(ce, axis=(0, 2))  # [K]
    step_den = jnp.full((K,), float(B * S), jnp.float32)
    step_loss = step_ce_num / step_den
    step_weight = step_loss_decay ** jnp.arange(K, dtype=jnp.float32)
    loss = jnp.sum(step_weight * step_loss)

    logits = jax.lax.stop_gradient(draft_logits.astype(jnp.float32))
    m = position_mask.astype(jnp.float32)
    correct = (jnp.argmax(logits, -1) == jnp.argmax(target_probs, -1)).astype(jnp.float32) * m
    l1 = jnp.sum(jnp.abs(jax.nn.softmax(logits, axis=-1) - target_probs), axis=-1)
    accept = jnp.clip(1.0 - 0.5 * l1, 0.0, 1.0) * m
    valid = jnp.sum(m, axis=(0, 2))
    first = m[:, 0]  # [B,S]: positions counted at step 0
    tau_den = jnp.sum(first)
    tau = lambda per_step: jnp.sum((1.0 + jnp.sum(jnp.cumprod(per_step, axis=1), axis=1)) * first)
    safe = lambda a: jnp.maximum(a, 1.0)
    metrics = {
        "step_ce_num": step_ce_num, "step_den": step_den, "step_loss": step_loss,
        "accuracy_num": jnp.sum(correct, axis=(0, 2)), "accept_rate_num": jnp.sum(accept, axis=(0, 2)),
        "valid_tokens": valid,
        "tau_greedy_num": tau(correct), "tau_probabilistic_num": tau(accept), "tau_den": tau_den,
    }
    metrics.update(accuracy=metrics["accuracy_num"] / safe(valid),
                   accept_rate=metrics["accept_rate_num"] / safe(valid),
                   tau_greedy=metrics["tau_greedy_num"] / safe(tau_den),
                   tau_probabilistic=metrics["tau_probabilistic_num"] / safe(tau_den), loss=loss)
    return loss, metrics
