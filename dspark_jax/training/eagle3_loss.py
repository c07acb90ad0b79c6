"""The Eagle3 test-time-training loss and DeepSpec's logged metrics (DESIGN §3b).

Step k at position t predicts token t+2+k; its soft target is the target's distribution at t+1+k.
Position t counts at step k when token t+k is a response token and not the last valid one (the
loss mask with the last valid position cleared, shifted left by k). Each step's soft cross-entropy
is summed over counted positions and divided by batch × sequence length (not by the count; in
training the configured `max_length`, so that a batch padded only to its longest record,
`train.pad_to_multiple`, weighs as one padded to max_length); the loss is Σ_k decay^k · step_loss[k]. Shapes: B batch, K steps, S sequence, V vocabulary, d width.
`eagle3_loss` takes every step's logits at once (as the golden tensors are laid out);
`eagle3_train_loss`, the same numbers, one step at a time (what training uses).
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp


def _shifted(x_bs: jax.Array, ttt_length: int, fill) -> jax.Array:
    """[B, K, S]: x[b, t+k], `fill` where t+k is past the end."""
    S = x_bs.shape[1]
    index = jnp.arange(S)[None, :] + jnp.arange(ttt_length)[:, None]  # [K,S]
    return jnp.where(index < S, jnp.take(x_bs, jnp.minimum(index, S - 1), axis=1), fill)


def step_target_probs(target_logits_bsv: jax.Array, step) -> jax.Array:
    """[B, S, V] float32: softmax of the target logits at t+1+step, uniform where t+1+step >= S."""
    S, V = target_logits_bsv.shape[1], target_logits_bsv.shape[-1]
    index = jnp.arange(S) + 1 + step  # [S]
    gathered = jnp.take(target_logits_bsv, jnp.minimum(index, S - 1), axis=1)
    p = jax.nn.softmax(gathered.astype(jnp.float32), axis=-1)
    return jnp.where((index < S)[None, :, None], p, 1.0 / V)


def ttt_target_probs(target_logits_bsv: jax.Array, ttt_length: int) -> jax.Array:
    """[B, K, S, V] float32: `step_target_probs` of every step."""
    return jnp.stack([step_target_probs(target_logits_bsv, k) for k in range(ttt_length)], axis=1)


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


def ttt_step_terms(draft_logits: jax.Array, target_probs: jax.Array, position_mask: jax.Array):
    """(ce, correct, accept), float32 [..., S], from draft logits/target probs [..., S, V] and the
    mask [..., S]: the soft cross-entropy, whether the draft argmax is the target's, and the accept
    rate (clamped 1 − ½‖p_d − p_t‖₁); all zero where the position does not count."""
    ce = ttt_step_ce(draft_logits, target_probs, position_mask)
    logits = jax.lax.stop_gradient(draft_logits.astype(jnp.float32))
    m = position_mask.astype(jnp.float32)
    correct = (jnp.argmax(logits, -1) == jnp.argmax(target_probs, -1)).astype(jnp.float32) * m
    l1 = jnp.sum(jnp.abs(jax.nn.softmax(logits, axis=-1) - target_probs), axis=-1)
    accept = jnp.clip(1.0 - 0.5 * l1, 0.0, 1.0) * m
    return ce, correct, accept


def eagle3_metrics(ce: jax.Array, correct: jax.Array, accept: jax.Array, position_mask: jax.Array,
                   step_loss_decay: float, length: int | None = None):
    """(scalar loss, metrics) from the `ttt_step_terms` of every step [B, K, S] (see `eagle3_loss`);
    each step's loss is divided by B x `length` (default S)."""
    B, K, S = position_mask.shape
    step_ce_num = jnp.sum(ce, axis=(0, 2))  # [K]
    step_den = jnp.full((K,), float(B * (length or S)), jnp.float32)
    step_loss = step_ce_num / step_den
    step_weight = step_loss_decay ** jnp.arange(K, dtype=jnp.float32)
    loss = jnp.sum(step_weight * step_loss)

    m = position_mask.astype(jnp.float32)
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


def eagle3_loss(draft_logits: jax.Array, target_probs: jax.Array, position_mask: jax.Array,
                step_loss_decay: float):
    """(scalar loss, metrics) from draft logits/target probs [B, K, S, V] and the mask [B, K, S].

    Metrics (float32; per-step entries are vectors [K]), as DeepSpec logs them: `step_ce_num`,
    `step_den`, `step_loss`; `accuracy_num` (draft argmax == target argmax) and `accept_rate_num`
    (clamped 1 − ½‖p_d − p_t‖₁) over counted positions, `valid_tokens` (their count) and the ratios;
    `tau_greedy` / `tau_probabilistic`: 1 + Σ_k Π_{i≤k} (correctness / accept rate at step i, zero
    where not counted) at each position counted at step 0, averaged over those (`tau_den`).
    """
    target_probs = jax.lax.stop_gradient(target_probs)
    return eagle3_metrics(*ttt_step_terms(draft_logits, target_probs, position_mask), position_mask,
                          step_loss_decay)


def eagle3_train_loss(logits_fn: Callable[[jax.Array], jax.Array], hidden_bksd: jax.Array,
                      target_logits_bsv: jax.Array, position_mask: jax.Array, step_loss_decay: float,
                      length: int | None = None):
    """`eagle3_loss(logits_fn(hidden), ttt_target_probs(target_logits), ...)` one TTT step at a time.

    logits_fn maps hidden states [B, S, d] to draft logits [B, S, V]; hidden [B, K, S, d]; target
    logits [B, S, V] (any float dtype). Each step's logits and soft targets exist only inside that
    step, and are recomputed in the backward pass: never a [B, K, S, V] tensor, nor one [B, S, V]
    per step kept for the gradient.
    """
    target_logits_bsv = jax.lax.stop_gradient(target_logits_bsv)

    @jax.checkpoint
    def one_step(h_bsd, step, mask_bs):
        probs = step_target_probs(target_logits_bsv, step)
        return ttt_step_terms(logits_fn(h_bsd), probs, mask_bs)

    steps = jnp.arange(position_mask.shape[1])
    _, terms = jax.lax.scan(lambda carry, xs: (carry, one_step(*xs)), None,
                            (jnp.moveaxis(hidden_bksd, 1, 0), steps, jnp.moveaxis(position_mask, 1, 0)))
    ce, correct, accept = (jnp.moveaxis(t, 0, 1) for t in terms)  # [B,K,S] each
    return eagle3_metrics(ce, correct, accept, position_mask, step_loss_decay, length)
