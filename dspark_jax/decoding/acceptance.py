"""Speculative acceptance (DESIGN §4, step 4): lossless for any verified length and temperature.

For j = 1..ℓ, draft d_j is accepted with probability min(1, p_{j-1}(d_j) / q_j(d_j)), stopping at the
first rejection. With k accepted, the next token comes from the residual norm(max(0, p_k − q_{k+1}))
if k < ℓ (p_k when that mass is 0), or from p_ℓ when every verified draft was accepted. With one-hot
p and q (temperature 0) this is exactly greedy verification.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from dspark_jax.decoding.sampling import sample


@struct.dataclass
class Acceptance:
    num_accepted: jax.Array  # [R] int32, k in 0..ℓ
    next_token: jax.Array  # [R] int32, the bonus / correction token (the new anchor)


def accept(keys: jax.Array, draft_tokens: jax.Array, draft_probs: jax.Array, target_probs: jax.Array,
           verify_len: jax.Array) -> Acceptance:
    """keys [R] (one per request), draft_tokens [R,γ], draft_probs q [R,γ,V], target_probs
    p [R,γ+1,V], verify_len ℓ [R]."""
    R, gamma = draft_tokens.shape
    k_u, k_next = split_rows(keys)
    p_d = jnp.take_along_axis(target_probs[:, :-1], draft_tokens[..., None], -1)[..., 0]  # p_{j-1}(d_j)
    q_d = jnp.take_along_axis(draft_probs, draft_tokens[..., None], -1)[..., 0]  # q_j(d_j)
    u = jax.vmap(lambda k: jax.random.uniform(k, (gamma,)))(k_u)
    ok = (u * q_d < p_d) & (jnp.arange(gamma) < verify_len[:, None])  # u < p/q without dividing
    k = jnp.sum(jnp.cumprod(ok.astype(jnp.int32), axis=-1), axis=-1).astype(jnp.int32)
    p_k = jnp.take_along_axis(target_probs, k[:, None, None], 1)[:, 0]  # [R,V]
    q_next = jnp.take_along_axis(draft_probs, jnp.minimum(k, gamma - 1)[:, None, None], 1)[:, 0]
    residual = jnp.maximum(p_k - q_next, 0.0)
    mass = jnp.sum(residual, -1, keepdims=True)
    rejected = (k < verify_len)[:, None]
    dist = jnp.where(rejected & (mass > 0), residual / jnp.where(mass > 0, mass, 1.0), p_k)
    return Acceptance(num_accepted=k, next_token=sample(k_next, dist))


def split_rows(keys: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Two independent [R] keys from each of [R] keys."""
    pair = jax.vmap(jax.random.split)(keys)  # [R, 2]
    return pair[:, 0], pair[:, 1]
