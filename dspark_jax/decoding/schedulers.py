"""Verification-length schedulers (DESIGN §5): pure functions from confidences to lengths.

A scheduler maps the round's calibrated confidences c [R, γ] (the probability that draft j survives
given that the earlier ones did) and the engine's per-slot facts to ℓ [R], the number of leading
drafts each request verifies. Non-anticipation holds by construction: ℓ depends on confidences,
which are computed before each draft token is sampled from its own position's distribution, never
on the draft tokens themselves.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class SchedulerConfig:
    """Static description of a scheduler (hashable: it is a static argument of the jitted round)."""

    kind: Literal["fixed", "threshold"] = "fixed"
    verify_len: int = 0  # fixed(ℓ); 0 = the block size γ
    threshold: float = 0.5  # threshold(t)

    def max_len(self, block_size: int) -> int:
        """Most drafts one request may verify (what the verification bucket must hold)."""
        if self.kind == "fixed":
            return min(self.verify_len or block_size, block_size)
        return block_size


def survival(confidence: jax.Array) -> jax.Array:
    """a_j = Π_{i≤j} c_i: the probability that the first j drafts are all accepted."""
    return jnp.cumprod(confidence, axis=-1)


def fixed(confidence: jax.Array, verify_len: int) -> jax.Array:
    R, gamma = confidence.shape
    return jnp.full((R,), min(verify_len or gamma, gamma), jnp.int32)


def threshold(confidence: jax.Array, t: float) -> jax.Array:
    """Number of leading positions with c_j >= t."""
    return jnp.sum(jnp.cumprod(confidence >= t, axis=-1), axis=-1).astype(jnp.int32)


def schedule(cfg: SchedulerConfig, confidence: jax.Array) -> jax.Array:
    """ℓ [R] in 0..γ for every request (the engine clips it to each slot's room)."""
    if cfg.kind == "fixed":
        return fixed(confidence, cfg.verify_len)
    return threshold(confidence, cfg.threshold)
