"""The engine's device programs (DESIGN §4, §7): pure functions of (shape, [bucket,] state, params).

Each program is a `jax.jit` of one of these functions with the static `EngineShape` (and the
verification bucket F) bound; the host loop in `engine.py` picks which to dispatch. A round is
built from three stages:

    propose_stage (drafter + Markov scan + calibrated confidence) -> ℓ_r (a scheduler) ->
    verify_and_commit (a flat batch of Σ_r (1 + ℓ_r) <= F tokens; accept; commit caches,
    context features and anchors)

and the programs compose them: `scheduled_round` (fixed, threshold: ℓ per request on the device),
`topk_round` (async: the F - n best candidates fill the bucket), `plain_round` (no proposal: the
anchors only; the drafter's context gains the committed tokens later, in one batch: `flush_round`
or the next proposal), `greedy_plan` then `greedy_verify` (Algorithm 1, with a host read of B
between them); `end_requests` deactivates slots whose requests the host ended.

A kind of drafter enters a round in three places only, its `DrafterStages`: the context of newly
admitted prompts (prefill), the proposal, and the context after a commit. DSpark's are here; the
Eagle3 chain's are in `eagle3_stages.py`; every program above is shared by both.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp
from flax import struct

from dspark_jax.decoding import eagle3_stages
from dspark_jax.decoding.acceptance import split_rows
from dspark_jax.decoding.sampling import (
    ACCEPT,
    FIRST_TOKEN,
    PROPOSE,
    row_keys,
    sample,
    target_probs,
    token_logprobs,
)
from dspark_jax.decoding.schedulers import (
    admit_first,
    candidate_order,
    fill_bucket,
    greedy_count,
    schedule,
)
from dspark_jax.decoding.state import (
    CONTEXT,
    LENGTH,
    RUNNING,
    STOP,
    Draft,
    EngineShape,
    EngineState,
    RoundOutput,
    Slots,
    Verified,
    calibrated,
)
from dspark_jax.models.drafter import (
    DraftCache,
    context_kv,
    extend_context,
    propose,
    write_context,
)
from dspark_jax.models.target import forward, forward_flat


@dataclasses.dataclass(frozen=True)
class DrafterStages:
    """Where a kind of drafter enters the shared programs (pure functions of the shape):
    prefill_context(shape, state, tparams, dparams, slot_idx [J], tokens [J, P], lengths [J],
    taps [J, P, m*d], first [J]) -> the state's draft_cache with the prompts' context;
    propose(shape, state, tparams, dparams) -> (state, Draft);
    commit_context(shape, state, tparams, dparams, Verified, proposed: bool) -> state (its
    draft_cache / pending updated; `state.slots` are still the round's starting ones)."""

    prefill_context: Callable
    propose: Callable
    commit_context: Callable


@struct.dataclass
class GreedyPlan:
    """Algorithm 1's decision, kept on the device between `greedy_plan` and `greedy_verify`."""

    draft: Draft
    ell: jax.Array  # [R] admitted drafts
    order: jax.Array  # [R·γ] candidate order
    a_sorted: jax.Array  # [R·γ] survival in that order (-1: past a row's room)
    tokens: jax.Array  # [] int32 B = active anchors + admitted drafts


def truncate(tokens, count, stop_ids, remaining):
    """Cuts a commit at the first stop token and at the budget; returns (count, finish code)."""
    W = tokens.shape[1]
    j = jnp.arange(W)
    is_stop = jnp.any(tokens[:, :, None] == stop_ids[:, None, :], -1) & (j < count[:, None])
    first_stop = jnp.where(jnp.any(is_stop, -1), jnp.argmax(is_stop, -1), W)
    stop_count = first_stop + 1
    finish = jnp.where(stop_count <= jnp.minimum(count, remaining), STOP,
                       jnp.where(count >= remaining, LENGTH, RUNNING))
    count = jnp.minimum(jnp.minimum(count, stop_count), remaining)
    return count, finish


def room(shape: EngineShape, s: Slots) -> jax.Array:
    """[R] the most drafts each slot can verify: positions n..n+ℓ must fit in the context, no more
    drafts than the budget can still use, none for an empty slot."""
    remaining = s.max_new - s.generated
    most = jnp.minimum(jnp.minimum(shape.max_verify, shape.max_len - 1 - s.length),
                       jnp.maximum(remaining - 1, 0))
    return jnp.where(s.active, jnp.maximum(most, 0), 0).astype(jnp.int32)


def prefill(shape: EngineShape, state: EngineState, tparams, dparams, slot_idx, tokens, lengths,
            max_new, temperature, top_p, top_k, seed, stop_ids):
    """Prompts [J, P] into slots `slot_idx` [J] (R = unused row); samples the first tokens.

    Returns (state, (first tokens [J], finish codes [J])), with logprobs (`token_logprobs`) too.
    """
    tcfg, R = shape.tcfg, shape.slots
    J, P = tokens.shape
    take = jnp.minimum(slot_idx, R - 1)
    positions = jnp.broadcast_to(jnp.arange(P), (J, P))
    valid = positions < lengths[:, None]
    out = forward(tparams, tcfg, tokens, positions, cache=state.target_cache.take_rows(take),
                  valid=valid, logit_index=(lengths - 1)[:, None], span=P)
    tc = state.target_cache.put_rows(slot_idx, out.cache)
    probs = target_probs(out.logits[:, 0], temperature, top_p, top_k)
    first = sample(row_keys(state.key, seed, lengths, FIRST_TOKEN), probs)
    dc = state.draft_cache
    if dc is not None:
        dc = drafter_stages(shape).prefill_context(shape, state, tparams, dparams, slot_idx, tokens,
                                                   lengths, out.taps, first)
    count, finish = truncate(first[:, None], jnp.ones((J,), jnp.int32), stop_ids, max_new)
    finish = jnp.where((finish == RUNNING) & (lengths >= shape.max_len), CONTEXT, finish)
    s = state.slots
    upd = lambda field, value: field.at[slot_idx].set(value, mode="drop")  # noqa: E731
    slots = Slots(active=upd(s.active, finish == RUNNING), length=upd(s.length, lengths),
                  anchor=upd(s.anchor, first), generated=upd(s.generated, count),
                  max_new=upd(s.max_new, max_new), temperature=upd(s.temperature, temperature),
                  top_p=upd(s.top_p, top_p), top_k=upd(s.top_k, top_k), seed=upd(s.seed, seed),
                  stop_ids=upd(s.stop_ids, stop_ids))
    pending = state.pending
    if pending is not None:
        pending = pending.replace(count=pending.count.at[slot_idx].set(0, mode="drop"))
    lp = token_logprobs(out.logits[:, 0], first, shape.logprobs) if shape.logprobs else ()
    return state.replace(slots=slots, target_cache=tc, draft_cache=dc, pending=pending), \
        (first, finish, *lp)


def dspark_prefill_context(shape: EngineShape, state: EngineState, tparams, dparams, slot_idx,
                           tokens, lengths, taps, first) -> DraftCache:
    """The prompts' projected target features into their slots' context caches."""
    R, (J, P) = shape.slots, tokens.shape
    take = jnp.minimum(slot_idx, R - 1)
    positions = jnp.broadcast_to(jnp.arange(P), (J, P))
    dc = state.draft_cache
    sub_d = DraftCache(k=dc.k[:, take], v=dc.v[:, take])
    sub_d = extend_context(dparams, shape.tcfg, shape.dcfg, sub_d, taps, positions,
                           positions < lengths[:, None])
    return DraftCache(k=dc.k.at[:, slot_idx].set(sub_d.k, mode="drop"),
                      v=dc.v.at[:, slot_idx].set(sub_d.v, mode="drop"))


def flush_pending(shape: EngineShape, state: EngineState, dparams, when: jax.Array | None = None
                  ) -> EngineState:
    """Projects every slot's held-back features into the drafter's context cache (PendingContext),
    if any slot holds some (or `when`); the state unchanged otherwise."""
    pending = state.pending
    if pending is None:
        return state
    s, P = state.slots, pending.taps.shape[1]
    offset = jnp.arange(P)
    positions = s.length[:, None] - pending.count[:, None] + offset

    def project(width):  # the first `width` held-back positions of every slot, padded to P
        def run(taps):
            k, v = context_kv(dparams, shape.tcfg, shape.dcfg, taps[:, :width], positions[:, :width])
            pad = [(0, 0), (0, 0), (0, P - width), (0, 0), (0, 0)]
            return jnp.pad(k, pad), jnp.pad(v, pad)
        return run

    kv = jax.eval_shape(project(P), pending.taps)
    nothing = lambda taps: tuple(jnp.zeros(x.shape, x.dtype) for x in kv)  # noqa: E731
    widths = flush_widths(P)
    # The projection costs what it reads: the smallest width that holds every slot's count. Only
    # the new rows leave the switch: XLA copied a cache passed through the branches whole, keys
    # and values, in every round with a proposal, most of which have nothing to flush.
    which = jnp.searchsorted(jnp.asarray(widths), jnp.max(pending.count))
    when = jnp.any(pending.count > 0) if when is None else when
    k_new, v_new = jax.lax.switch(jnp.where(when, 1 + which, 0),
                                  [nothing] + [project(w) for w in widths], pending.taps)
    dc = write_context(state.draft_cache, k_new, v_new, positions,
                       when & (offset < pending.count[:, None]))
    return state.replace(draft_cache=dc, pending=pending.replace(count=jnp.zeros_like(pending.count)))


def flush_widths(pending: int) -> tuple[int, ...]:
    """The widths a flush projects at, up to the buffer's `pending` positions: powers of 4 (the
    projection's cost follows its width; a branch each is compiled into every flushing program)."""
    return tuple(w for w in (4, 16) if w < pending) + (pending,)


def dspark_propose(shape: EngineShape, state: EngineState, tparams, dparams
                   ) -> tuple[EngineState, Draft]:
    """`propose_stage` as a DrafterStages.propose (the state is unchanged)."""
    return state, propose_stage(shape, state, tparams, dparams)


def propose_stage(shape: EngineShape, state: EngineState, tparams, dparams) -> Draft:
    """Every slot's block of γ drafts with calibrated confidences. Without a confidence head the
    drafter's own top probability at each position stands in (known before the draft is drawn)."""
    s, dcfg = state.slots, shape.dcfg
    keys = row_keys(state.key, s.seed, s.length, PROPOSE)
    prop = propose(dparams, tparams, shape.tcfg, dcfg, state.draft_cache, s.anchor, s.length,
                   s.temperature, keys)
    z = prop.conf_logits
    if not dcfg.enable_confidence_head:
        top = jnp.clip(jnp.max(jax.nn.softmax(prop.base_logits, -1), -1), 1e-6, 1 - 1e-6)
        z = jnp.log(top) - jnp.log1p(-top)
    c, a = calibrated(shape, z)
    return Draft(tokens=prop.tokens, probs=prop.probs, conf_logits=z, confidence=c, survival=a)


def verify_and_commit(shape: EngineShape, bucket: int, state: EngineState, tparams, dparams,
                      draft: Draft | None, ell: jax.Array) -> tuple[EngineState, tuple]:
    """Verifies every active slot's anchor and its first ℓ_r drafts in one flat batch of `bucket`
    tokens, accepts, and commits. `draft` None: no proposal (each slot verifies its anchor only);
    ℓ [R] is clipped here to each slot's room. Returns (state, the packed RoundOutput)."""
    tcfg, R, S = shape.tcfg, shape.slots, shape.max_len
    s = state.slots
    drafts = jnp.zeros((R, 0), jnp.int32) if draft is None else draft.tokens
    W = drafts.shape[1] + 1
    ell = jnp.minimum(ell, room(shape, s))
    counts = jnp.where(s.active, 1 + ell, 0)
    ends = jnp.cumsum(counts)
    i = jnp.arange(bucket)
    row = jnp.minimum(jnp.searchsorted(ends, i, side="right"), R - 1).astype(jnp.int32)
    j = i - (ends - counts)[row]
    valid = i < ends[-1]
    prev = jnp.concatenate([s.anchor[:, None], drafts], axis=1)  # [R, W]
    tok = prev[row, jnp.clip(j, 0, W - 1)]
    out = forward_flat(tparams, tcfg, state.target_cache, tok, row, s.length[row] + j, valid,
                       row * W + j, W)
    grid = jnp.where(valid, row * W + j, R * W)
    logits = jnp.zeros((R * W, tcfg.vocab_size), jnp.float32).at[grid].set(
        out.logits, mode="drop").reshape(R, W, -1)
    p = target_probs(logits, s.temperature[:, None], s.top_p[:, None], s.top_k[:, None])
    keys = row_keys(state.key, s.seed, s.length, ACCEPT)
    if draft is not None:
        acc = shape.acceptance(keys, drafts, draft.probs, p, ell)
        k, nxt = acc.num_accepted, acc.next_token
    else:
        k, nxt = jnp.zeros((R,), jnp.int32), sample(split_rows(keys)[1], p[:, 0])
    jw = jnp.arange(W)
    padded = jnp.concatenate([drafts, jnp.zeros((R, 1), jnp.int32)], axis=1)
    tokens = jnp.where(jw < k[:, None], padded, nxt[:, None])
    remaining = s.max_new - s.generated
    count, finish = truncate(tokens, k + 1, s.stop_ids, remaining)
    new_length = s.length + k + 1
    finish = jnp.where((finish == RUNNING) & (new_length >= S), CONTEXT, finish)
    finish = jnp.where(s.active, finish, RUNNING)
    count = jnp.where(s.active, count, 0)
    if state.draft_cache is not None:  # the drafter's context gains the committed tokens
        verified = Verified(taps=out.taps, grid=grid, row=row, valid=valid, tokens=tokens, accepted=k)
        state = drafter_stages(shape).commit_context(shape, state, tparams, dparams, verified,
                                                     draft is not None)
    slots = s.replace(active=s.active & (finish == RUNNING),
                      length=jnp.where(s.active, new_length, s.length),
                      anchor=jnp.where(s.active, nxt, s.anchor),
                      generated=s.generated + count)
    no_conf = jnp.zeros((R, 0), jnp.float32)
    state = state.replace(slots=slots, target_cache=out.cache)
    lp = {}
    if shape.logprobs:  # token j was predicted by the logits at offset j (p_j)
        lp = dict(zip(("logprob", "top_ids", "top_logprobs"),
                      token_logprobs(logits, tokens, shape.logprobs)))
    return state, RoundOutput(
        tokens=tokens, count=count, verified=ell, accepted=k, finish=finish, was_active=s.active,
        conf_logits=no_conf if draft is None else draft.conf_logits,
        survival=no_conf if draft is None else draft.survival, **lp).pack()


def dspark_commit_context(shape: EngineShape, state: EngineState, tparams, dparams,
                          verified: Verified, proposed: bool) -> EngineState:
    """After a proposal the committed tokens' features are projected into the context cache at
    once; after a round without one, each anchor's features are held back (PendingContext)."""
    s, R, W = state.slots, shape.slots, verified.tokens.shape[1]
    dc, pending = state.draft_cache, state.pending
    if proposed:
        jw = jnp.arange(W)
        dc = extend_context(dparams, shape.tcfg, shape.dcfg, dc, verified.taps_grid(R, W),
                            s.length[:, None] + jw,
                            (jw <= verified.accepted[:, None]) & s.active[:, None])
    else:  # flat token i is the anchor of slot row[i]
        # Every valid anchor is a distinct slot; padding goes to distinct rows past the end. Declared
        # unique, XLA:CPU writes the rows in place where it copied the whole [R, pending, m*d]
        # buffer every round (the drafter engine's plain round at 16 slots on the bundled pair:
        # 1.04x the plain engine's -> 1.02x). On one device only: with it, the 2 x 2 mesh over two
        # processes of tests/test_multihost_decode.py stalled mid-job in 2 of 18 runs (both beside
        # other CPU-heavy work), never in 6 such runs without it; its partitioned program holds the
        # same collectives either way, and the cause is not known.
        row = verified.row
        slot = jnp.where(verified.valid, row, R + jnp.arange(row.shape[0]))
        pending = pending.replace(
            taps=pending.taps.at[slot, pending.count[row]].set(
                verified.taps.astype(pending.taps.dtype), mode="drop",
                unique_indices=shape.one_device),
            count=pending.count + s.active)
    return state.replace(draft_cache=dc, pending=pending)


DSPARK = DrafterStages(prefill_context=dspark_prefill_context, propose=dspark_propose,
                       commit_context=dspark_commit_context)
EAGLE3 = DrafterStages(prefill_context=eagle3_stages.prefill_context, propose=eagle3_stages.propose,
                       commit_context=eagle3_stages.commit_context)
STAGES = {"dspark": DSPARK, "eagle3": EAGLE3}


def drafter_stages(shape: EngineShape) -> DrafterStages:
    """The stages of the shape's kind of drafter (`drafter.kind`)."""
    return STAGES[shape.dcfg.kind]


def end_requests(shape: EngineShape, state: EngineState, tparams, dparams, ended: jax.Array
                 ) -> EngineState:
    """Deactivates the slots `ended` [R] bool: requests the host ended (a stop string)."""
    s = state.slots
    return state.replace(slots=s.replace(active=s.active & ~ended,
                                         max_new=jnp.where(ended, s.generated, s.max_new)))


def flush_round(shape: EngineShape, state: EngineState, tparams, dparams) -> EngineState:
    """Projects the held-back features now: the host dispatches it before a slot's buffer of
    PENDING positions could overflow (after that many rounds without a proposal in a row)."""
    return flush_pending(shape, state, dparams, jnp.bool_(True))


def plain_round(shape: EngineShape, bucket: int, state: EngineState, tparams, dparams):
    """No proposal: every active slot's anchor is verified (plain target decoding); with a
    drafter, the committed token's features are held back for its context (PendingContext)."""
    return verify_and_commit(shape, bucket, state, tparams, dparams, None,
                             jnp.zeros((shape.slots,), jnp.int32))


def scheduled_round(shape: EngineShape, bucket: int, state: EngineState, tparams, dparams):
    """fixed / threshold: ℓ_r per request on the device; the bucket holds every active anchor plus
    the scheduler's most drafts."""
    state = flush_pending(shape, state, dparams)
    state, draft = drafter_stages(shape).propose(shape, state, tparams, dparams)
    ell = schedule(shape.scheduler, draft.confidence)
    if shape.scheduler.bucket_fill:
        s = state.slots
        ell = fill_bucket(ell, draft.survival, room(shape, s), bucket - jnp.sum(s.active))
    return verify_and_commit(shape, bucket, state, tparams, dparams, draft, ell)


def topk_round(shape: EngineShape, bucket: int, state: EngineState, tparams, dparams):
    """async: the bucket (chosen on the host from earlier rounds) is filled by every active anchor
    and the bucket - n candidates with the highest current survival."""
    state = flush_pending(shape, state, dparams)
    state, draft = drafter_stages(shape).propose(shape, state, tparams, dparams)
    s = state.slots
    if bucket >= shape.slots * shape.width:  # every candidate fits: ℓ = room, nothing to rank
        ell = room(shape, s)
    else:
        order, a_sorted = candidate_order(draft.survival, room(shape, s))
        ell = admit_first(order, a_sorted, bucket - jnp.sum(s.active), shape.slots)
    return verify_and_commit(shape, bucket, state, tparams, dparams, draft, ell)


def greedy_plan(shape: EngineShape, state: EngineState, tparams, dparams, sps: jax.Array
                ) -> GreedyPlan:
    """Algorithm 1 on this round's proposal; the host reads `tokens` (B) to pick the bucket.
    sps [B_max + 1]: the profiled steps per second of a verification of B tokens."""
    state = flush_pending(shape, state, dparams)  # a copy: greedy_verify flushes the real one
    _, draft = drafter_stages(shape).propose(shape, state, tparams, dparams)  # (the same way)
    s = state.slots
    order, a_sorted = candidate_order(draft.survival, room(shape, s))
    n = jnp.sum(s.active).astype(jnp.int32)
    m = greedy_count(a_sorted, n, sps)
    return GreedyPlan(draft=draft, ell=admit_first(order, a_sorted, m, shape.slots), order=order,
                      a_sorted=a_sorted, tokens=n + m)


def greedy_verify(shape: EngineShape, bucket: int, state: EngineState, tparams, dparams,
                  plan: GreedyPlan):
    """Verifies the plan in `bucket`; with bucket fill the padding takes the next candidates in
    the same order (the bucket was decided by candidates ranked before them)."""
    state = flush_pending(shape, state, dparams)
    ell = plan.ell
    if shape.scheduler.bucket_fill:  # greedy's own choice is a prefix of the same order
        ell = admit_first(plan.order, plan.a_sorted, bucket - jnp.sum(state.slots.active),
                          shape.slots)
    return verify_and_commit(shape, bucket, state, tparams, dparams, plan.draft, ell)
