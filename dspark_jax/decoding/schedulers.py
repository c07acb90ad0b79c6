"""Verification-length schedulers (DESIGN §5): from confidences and the machine's load to ℓ_r.

A scheduler maps the round's calibrated confidences c [R, γ] (c_j: the probability that draft j
survives given that the earlier ones did) to ℓ [R], the number of leading drafts each request
verifies:
- fixed(γ'): ℓ = γ' for every request;
- threshold(t): the leading positions with c_j >= t;
- greedy (Algorithm 1): candidates (r, j) in descending prefix survival a_{r,j} = Π_{i≤j} c_{r,i},
  admitted while the expected throughput τ·SPS(B) improves, stopping at the first step that does
  not; synchronous: the host reads B and dispatches the verification for the bucket B needs;
- async (§5.2): the host picks the verification bucket from earlier rounds' survival estimates by a
  global search over the profiled buckets (`choose_bucket`); on the device the bucket is filled by
  the candidates with the highest current a_{r,j} beside every request's anchor (`admit_first`).

Bucket fill (ours, optional, for fixed, threshold and greedy): the verification bucket's padding
takes the next candidates in survival order instead of idling (`fill_bucket`). With a bucketed SPS,
Algorithm 1 already stops only at bucket boundaries (inside a bucket SPS is constant, so every
candidate with a > 0 raises Θ), so for greedy it adds only candidates of survival 0; for threshold
and fixed it verifies drafts they would have left out at no extra cost.

Non-anticipation (Appendix A). c_j depends on the draft d_{j-1} (the Markov embedding), so ℓ does
depend on drafts; what makes it lossless is that the decision to verify d_j never depends on d_j or
on anything sampled after it. threshold stops at the first low c_j, and c_1..c_j are known before d_j
is sampled. greedy and the on-device fill walk the candidates in descending a_{r,j}; since a_{r,j}
never rises along j, no candidate that depends on d_j (a_{r,j+1}, ...) ranks before d_j, and the
walk's stop is decided by the candidates before the one it stops at. The async bucket comes from
rounds already committed. A search that looked past a candidate (a global argmax over all prefixes
of the current round) would let d_j's successors decide whether d_j is verified, and biases the
output: `tests/test_non_anticipation.py` shows both.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np

KINDS = ("fixed", "threshold", "greedy", "async")


@dataclasses.dataclass(frozen=True)
class SchedulerConfig:
    """Static description of a scheduler (hashable: it is a static argument of the jitted rounds)."""

    kind: Literal["fixed", "threshold", "greedy", "async"] = "async"
    verify_len: int = 0  # fixed(ℓ); 0 = the block size γ
    threshold: float = 0.5  # threshold(t)
    bucket_fill: bool = False  # pad the verification bucket with the next candidates (fixed,
    # threshold, greedy; async fills its bucket by construction)

    def max_len(self, block_size: int) -> int:
        """Most drafts one request may verify (what the verification bucket must hold)."""
        if self.kind == "fixed":
            return min(self.verify_len or block_size, block_size)
        return block_size

    @property
    def load_aware(self) -> bool:
        """Whether the scheduler needs the profiled round times (SPS)."""
        return self.kind in ("greedy", "async")

    def describe(self, block_size: int) -> str:
        fill = " + bucket fill" if self.bucket_fill and self.kind != "async" else ""
        if self.kind == "fixed":
            return f"fixed({self.max_len(block_size)}){fill}"
        if self.kind == "threshold":
            return f"threshold({self.threshold}){fill}"
        return self.kind + fill


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
    """ℓ [R] in 0..γ for the per-request schedulers (the engine clips it to each slot's room)."""
    if cfg.kind == "fixed":
        return fixed(confidence, cfg.verify_len)
    if cfg.kind == "threshold":
        return threshold(confidence, cfg.threshold)
    raise ValueError(f"{cfg.kind} is a load-aware scheduler; use candidate_order")


# ----------------------------------------------------------------------------- on the device


def candidate_order(a: jax.Array, room: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Candidates (r, j) in admission order: descending survival, ties to lower j, then lower r.

    a [R, γ] prefix survival, room [R] the most drafts each row may verify (0 for empty slots).
    Returns (order [R·γ] of flat j-major indices j·R + r, the survival of each in that order, -1
    for candidates past a row's room, which sort last).
    """
    R, gamma = a.shape
    valid = jnp.arange(gamma)[:, None] < room[None, :]  # [γ, R]
    flat = jnp.where(valid, a.T, -1.0).reshape(-1)
    order = jnp.argsort(-flat, stable=True)
    return order, flat[order]


def admit_first(order: jax.Array, a_sorted: jax.Array, count: jax.Array, R: int) -> jax.Array:
    """ℓ [R]: admits the first `count` valid candidates of `order`. Because a_{r,j} never rises
    along j, each row's admitted drafts are a prefix."""
    gamma = order.shape[0] // R
    take = (jnp.arange(order.shape[0]) < count) & (a_sorted >= 0)
    admitted = jnp.zeros(order.shape, bool).at[order].set(take).reshape(gamma, R)
    return jnp.sum(admitted, axis=0).astype(jnp.int32)


def fill_bucket(ell: jax.Array, a: jax.Array, room: jax.Array, capacity: jax.Array) -> jax.Array:
    """ℓ [R] grown to `capacity` drafts in all: the scheduler's own choice first, then the next
    candidates in descending survival (its prefix property kept: a_{r,j} never rises along j).

    Lossless when `capacity` is fixed before this round's drafts (the bucket minus the anchors):
    whether d_j is added depends on the candidates ranked before it and on the scheduler's own
    choices, which are causal.
    """
    R, gamma = a.shape
    chosen = jnp.arange(gamma)[None, :] < jnp.minimum(ell, room)[:, None]
    order, ranked = candidate_order(jnp.where(chosen, 2.0, a), room)  # chosen ones rank first
    return admit_first(order, ranked, capacity, R)


def greedy_count(a_sorted: jax.Array, num_active: jax.Array, sps: jax.Array) -> jax.Array:
    """Algorithm 1's admitted count m: walk the candidates, B = n + i, τ* = n + Σ a, and stop at
    the first step where Θ = τ*·SPS(B) does not improve. sps [B_max + 1]: steps per second for a
    verification of B tokens (the bucketed step function; 0 past the largest bucket)."""
    n = num_active.astype(jnp.float32)

    def sps_at(B):
        return jnp.where(B < sps.shape[0], sps[jnp.minimum(B, sps.shape[0] - 1)], 0.0)

    steps = jnp.arange(a_sorted.shape[0]) + 1
    tau = n + jnp.cumsum(jnp.maximum(a_sorted, 0.0))
    theta = tau * sps_at(num_active + steps)
    before = jnp.concatenate([(n * sps_at(num_active))[None], theta[:-1]])
    improves = (theta > before) & (a_sorted > 0)
    return jnp.sum(jnp.cumprod(improves.astype(jnp.int32))).astype(jnp.int32)


# ----------------------------------------------------------------------------- on the host


def choose_bucket(estimates: np.ndarray, num_live: int, spec_seconds: dict[int, float],
                  plain_seconds: dict[int, float]) -> tuple[str, int]:
    """The async scheduler's budget: ("plain" | "spec", bucket) maximising expected tokens per
    second, searched over every profiled bucket (no early stop, so it can jump across SPS cliffs).

    estimates [n, γ]: survival estimates a_{r,j} of the live requests from earlier rounds. A spec
    bucket F verifies the F - n best candidates beside the n anchors: τ = n + (sum of the F - n
    largest estimates); a plain round (no proposal) commits n tokens. `plain_seconds` empty: a
    proposal is required.
    """
    return BucketTable(spec_seconds, plain_seconds).choose(estimates, num_live)


class BucketTable:
    """Round seconds per bucket as arrays, for `choose_bucket` once per round on the host."""

    def __init__(self, spec_seconds: dict[int, float], plain_seconds: dict[int, float]):
        self.spec_F = np.asarray(sorted(spec_seconds), np.int64)
        self.spec_s = np.asarray([spec_seconds[F] for F in self.spec_F], np.float64)
        self.plain_F = np.asarray(sorted(plain_seconds), np.int64)
        self.plain_s = np.asarray([plain_seconds[F] for F in self.plain_F], np.float64)

    def choose(self, estimates: np.ndarray, num_live: int, plain: bool = True,
               overhead: dict[str, float] | None = None, margin: float = 0.0,
               scale: float = 1.0) -> tuple[str, int]:
        """`overhead` {"spec": s, "plain": s}: seconds a round of that kind costs beyond its
        profiled time (prefills between rounds, the host), added to each of its buckets. `margin`:
        a proposal must promise (1 + margin) x the plain round's tokens per second to be chosen.
        `scale`: the accepted drafts a bucket is expected to add, as a multiple of the sum of its
        estimates (what such sums have delivered lately)."""
        overhead = overhead or {}
        # A negative overhead (rounds faster than profiled) takes at most half of any bucket's time.
        spec_s = np.maximum(self.spec_s + overhead.get("spec", 0.0), 0.5 * self.spec_s)
        plain_s = np.maximum(self.plain_s + overhead.get("plain", 0.0), 0.5 * self.plain_s)
        pool = -np.sort(-np.clip(np.ravel(estimates), 0.0, 1.0))
        gain = scale * np.concatenate([[0.0], np.cumsum(pool)])
        fits = self.spec_F > num_live
        best = ("spec", int(self.spec_F[-1]), -1.0)
        if fits.any():
            F = self.spec_F[fits]
            theta = (num_live + gain[np.minimum(F - num_live, len(pool))]) / spec_s[fits]
            i = int(np.argmax(theta))
            best = ("spec", int(F[i]), float(theta[i]))
        if plain and len(self.plain_F):
            i = int(np.searchsorted(self.plain_F, num_live))
            if (1.0 + margin) * num_live / plain_s[i] >= best[2]:
                return "plain", int(self.plain_F[i])
        return best[0], best[1]
