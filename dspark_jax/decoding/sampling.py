"""Per-request sampling distributions and random streams; every parameter an array, never static.

Filters follow Hugging Face and vLLM: temperature, then top-k, then top-p measured on the
renormalised top-k set (the most likely token always stays), then renormalise. A row's
distribution is a function of its own logits and parameters only, bit for bit whatever its
batch-mates ask for. Temperature 0 means greedy: the one-hot of the argmax, so greedy decoding and
speculative acceptance go through the same code as sampling.

Randomness is per request: `row_keys` derives a key from the engine's base key, the request's seed,
the position and the stage, so a request draws the same numbers whatever slot or batch it is in.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dspark_jax.models.layers import by_temperature, first_argmax, sample_inverse_cdf

# Stages of one position's randomness (`row_keys`).
FIRST_TOKEN, PROPOSE, ACCEPT = 0, 1, 2


def target_probs(logits: jax.Array, temperature: jax.Array, top_p: jax.Array,
                 top_k: jax.Array) -> jax.Array:
    """float32 probabilities [..., V] from logits [..., V] and per-row parameters [...].

    top_k <= 0 and top_p >= 1 disable the filters; a row with both disabled is never filtered.
    """
    logits = logits.astype(jnp.float32)
    V = logits.shape[-1]
    greedy = temperature <= 0
    scaled = logits / jnp.where(greedy, 1.0, temperature)[..., None]
    filtering = (((top_k > 0) & (top_k < V)) | (top_p < 1.0)) & ~greedy

    def filtered(scaled):
        # One sort serves both filters; skipped entirely when no row asks for either.
        order = jnp.argsort(-scaled, axis=-1)
        sorted_scaled = jnp.take_along_axis(scaled, order, axis=-1)
        in_top_k = jnp.arange(V) < jnp.where(top_k > 0, jnp.minimum(top_k, V), V)[..., None]
        probs_k = jax.nn.softmax(jnp.where(in_top_k, sorted_scaled, -jnp.inf), axis=-1)
        mass_before = jnp.cumsum(probs_k, axis=-1) - probs_k
        keep_sorted = in_top_k & ((mass_before < top_p[..., None]) | (top_p[..., None] >= 1.0))
        keep = jnp.put_along_axis(jnp.zeros_like(keep_sorted), order, keep_sorted, axis=-1,
                                  inplace=False)
        return jnp.where(keep | ~filtering[..., None], scaled, -jnp.inf)

    def soft():
        return jax.nn.softmax(jax.lax.cond(jnp.any(filtering), filtered, lambda x: x, scaled), -1)

    return by_temperature(greedy, lambda: jax.nn.one_hot(first_argmax(logits), V,
                                                         dtype=jnp.float32), soft)


def row_keys(base: jax.Array, seeds: jax.Array, positions: jax.Array, stage: int) -> jax.Array:
    """[R] keys: one stream per request seed [R] (uint32), anchor position [R] and stage."""
    def one(seed, position):
        return jax.random.fold_in(jax.random.fold_in(jax.random.fold_in(base, seed), position),
                                  stage)
    return jax.vmap(one)(seeds, positions)


def sample(keys: jax.Array, probs: jax.Array) -> jax.Array:
    """int32 token ids [R] drawn from probabilities [R, V], row r with keys[r], by inverse CDF
    (one random number per row; exact zeros are never drawn)."""
    return sample_inverse_cdf(probs, jax.vmap(lambda k: jax.random.uniform(k, ()))(keys))


def token_logprobs(logits: jax.Array, tokens: jax.Array, n: int
                   ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The target's raw log-probabilities (log-softmax of the logits at T = 1, before temperature
    and filters, as vLLM reports them): of `tokens` [...] under logits [..., V], and the `n` most
    likely ids with theirs. Returns (logprob [...] f32, top ids [..., n] i32, top logprobs [..., n])."""
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    chosen = jnp.take_along_axis(logp, tokens[..., None], axis=-1)[..., 0]
    top_lp, top_ids = jax.lax.top_k(logp, n)
    return chosen, top_ids.astype(jnp.int32), top_lp
