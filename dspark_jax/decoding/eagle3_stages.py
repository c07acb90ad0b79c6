"""The Eagle3 drafter's stages in the shared rounds (DESIGN §3b, §4; `rounds.DrafterStages`).

A slot's context (`Eagle3Context`): row p of its drafter cache is token p+1 run through the draft
layer with fc(the target features of position p), so a slot of length n holds rows 0..n-1, the last
one carrying the anchor, and that row's layer output (`hidden`) starts the next chain. The proposal
is a chain of γ = ttt_length drafts, one drafter step each under `lax.scan`, writing its own rows at
n..n+γ-1. After verification with k drafts accepted, rows n..n+k are rewritten with the committed
tokens (d_1..d_k, then the new anchor) paired with the target features of the verified rows
n..n+k: the cache is cut back to n and extended. Rows past n+k are stale but never read (a later row
writes its own slot before it reads, and reads only slots at or before its position); row n+k's
output is the new `hidden`. Nothing is held back between rounds: a round without a proposal extends
the context by its one committed row.

Confidence: Eagle3 has no confidence head. Its stand-in at step j is the drafter's top probability
(softmax of that step's logits at T = 1, as for DSpark drafters without a head), calibrated by
`EngineShape.sts` when given. It depends on the drafts before step j only, so it is known before d_j
is drawn and threshold and the load-aware schedulers stay non-anticipating; the drawn token's own
probability q_j(d_j) would let d_j decide whether it is verified, which biases the output.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dspark_jax.decoding.sampling import PROPOSE, row_keys
from dspark_jax.decoding.state import Draft, Eagle3Context, EngineShape, EngineState, Verified, calibrated
from dspark_jax.models import eagle3
from dspark_jax.models.eagle3 import Eagle3Cache


def prefill_context(shape: EngineShape, state: EngineState, tparams, dparams, slot_idx, tokens,
                    lengths, taps, first) -> Eagle3Context:
    """Prompts [J, P] (slot_idx [J], R = unused row) into their slots' drafter caches: the prompt
    shifted by one, then the first sampled token, paired with the prompt's target features."""
    R, (J, P) = shape.slots, tokens.shape
    ctx = state.draft_cache
    take = jnp.minimum(slot_idx, R - 1)
    positions = jnp.broadcast_to(jnp.arange(P), (J, P))
    last, rows = lengths - 1, jnp.arange(J)
    shifted = jnp.concatenate([tokens[:, 1:], jnp.zeros((J, 1), tokens.dtype)], axis=1)
    shifted = shifted.at[rows, last].set(first.astype(tokens.dtype))
    sub = Eagle3Cache(k=ctx.cache.k[take], v=ctx.cache.v[take])
    sub, h = eagle3.extend_context(dparams, tparams, shape.tcfg, shape.dcfg, sub, shifted, taps,
                                   positions, positions < lengths[:, None])
    cache = Eagle3Cache(k=ctx.cache.k.at[slot_idx].set(sub.k, mode="drop"),
                        v=ctx.cache.v.at[slot_idx].set(sub.v, mode="drop"))
    hidden = ctx.hidden.at[slot_idx].set(h[rows, last].astype(ctx.hidden.dtype), mode="drop")
    return Eagle3Context(cache=cache, hidden=hidden)


def propose(shape: EngineShape, state: EngineState, tparams, dparams) -> tuple[EngineState, Draft]:
    """Every slot's chain of γ drafts, their distributions q_j (the request's temperature,
    unfiltered; one-hot at T = 0) and calibrated stand-in confidences. The returned state holds the
    chain's rows in the drafter cache (rewritten by the commit): the cache is updated in place."""
    s, ctx = state.slots, state.draft_cache
    keys = row_keys(state.key, s.seed, s.length, PROPOSE)
    prop = eagle3.propose(dparams, tparams, shape.tcfg, shape.dcfg, ctx.cache, ctx.hidden,
                          jnp.maximum(s.length - 1, 0), s.temperature, keys)
    top = jnp.clip(jnp.max(jax.nn.softmax(prop.logits, -1), -1), 1e-6, 1 - 1e-6)  # [R, γ]
    z = jnp.log(top) - jnp.log1p(-top)
    c, a = calibrated(shape, z)
    draft = Draft(tokens=prop.tokens, probs=prop.probs, conf_logits=z, confidence=c, survival=a)
    return state.replace(draft_cache=ctx.replace(cache=prop.cache)), draft


def commit_context(shape: EngineShape, state: EngineState, tparams, dparams, verified: Verified,
                   proposed: bool) -> EngineState:
    """Rows n..n+k of every active slot rewritten with the committed tokens and the verified rows'
    target features; row n+k's output becomes the slot's `hidden`. The same with or without a
    proposal (then W = 1 and k = 0: the new anchor with the old anchor's features)."""
    s, ctx, R = state.slots, state.draft_cache, shape.slots
    W, k = verified.tokens.shape[1], verified.accepted
    jw = jnp.arange(W)
    cache, h = eagle3.extend_context(dparams, tparams, shape.tcfg, shape.dcfg, ctx.cache,
                                     verified.tokens, verified.taps_grid(R, W),
                                     s.length[:, None] + jw,
                                     (jw <= k[:, None]) & s.active[:, None])
    last = jnp.take_along_axis(h, k[:, None, None], axis=1)[:, 0]  # [R, d]
    hidden = jnp.where(s.active[:, None], last.astype(ctx.hidden.dtype), ctx.hidden)
    return state.replace(draft_cache=Eagle3Context(cache=cache, hidden=hidden))
