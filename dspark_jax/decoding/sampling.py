"""Per-request sampling distributions: temperature, top-k, top-p, greedy; all arrays, never static.

Temperature 0 means greedy: the distribution is the one-hot of the argmax, so greedy decoding and
speculative acceptance go through the same code as sampling.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def target_probs(logits: jax.Array, temperature: jax.Array, top_p: jax.Array,
                 top_k: jax.Array) -> jax.Array:
    """float32 probabilities [..., V] from logits [..., V] and per-row parameters [...].

    top_k <= 0 and top_p >= 1 disable the filters. Filtering keeps the k most likely tokens, then
    the smallest prefix (by probability) whose mass reaches top_p; the result is renormalised.
    """
    logits = logits.astype(jnp.float32)
    V = logits.shape[-1]
    greedy = temperature <= 0
    scaled = logits / jnp.where(greedy, 1.0, temperature)[..., None]
    filtering = ((top_k > 0) & (top_k < V)) | (top_p < 1.0)

    def filtered(scaled):
        # One sort serves both filters; skipped entirely when no row asks for either.
        order = jnp.argsort(-scaled, axis=-1)
        sorted_probs = jax.nn.softmax(jnp.take_along_axis(scaled, order, axis=-1), axis=-1)
        rank = jnp.arange(V)
        k = jnp.where(top_k > 0, jnp.minimum(top_k, V), V)[..., None]
        mass_before = jnp.cumsum(sorted_probs, axis=-1) - sorted_probs
        keep_sorted = (rank < k) & (mass_before < top_p[..., None])  # rank 0 is always kept
        keep = jnp.put_along_axis(jnp.zeros_like(keep_sorted), order, keep_sorted, axis=-1,
                                  inplace=False)
        return jnp.where(keep, scaled, -jnp.inf)

    scaled = jax.lax.cond(jnp.any(filtering & ~greedy), filtered, lambda x: x, scaled)
    soft = jax.nn.softmax(scaled, axis=-1)
    hard = jax.nn.one_hot(jnp.argmax(logits, -1), V, dtype=jnp.float32)
    return jnp.where(greedy[..., None], hard, soft)


def sample(key: jax.Array, probs: jax.Array) -> jax.Array:
    """int32 token ids [...] drawn from probabilities [..., V] (exact zeros are never drawn)."""
    logp = jnp.where(probs > 0, jnp.log(jnp.where(probs > 0, probs, 1.0)), -jnp.inf)
    return jax.random.categorical(key, logp, axis=-1).astype(jnp.int32)
