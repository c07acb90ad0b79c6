"""The engine's device programs (DESIGN §4, §7): pure functions of (static shape, state, params).

`EngineShape` is everything static (configs, slot count, context, the scheduler); it is hashable,
so each program is a `jax.jit` of one of these functions with the shape (and the verification
bucket) bound. The state is a pytree: slots as arrays, the target KV cache, the drafter's context
cache, the random key. A round is built from stages that later rounds reuse:

    propose (drafter + Markov scan + confidence) -> select ℓ_r -> verify_and_commit: verify a flat
    batch of Σ_r (1 + ℓ_r) <= F tokens, accept, commit caches, context features and anchors.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from dspark_jax.config import DrafterConfig, TargetConfig
from dspark_jax.decoding.acceptance import accept
from dspark_jax.decoding.sampling import sample, target_probs
from dspark_jax.decoding.schedulers import SchedulerConfig, schedule
from dspark_jax.models.drafter import DraftCache, extend_context, propose
from dspark_jax.models.target import KVCache, forward, forward_flat
from dspark_jax.sharding import logical_to_spec

RUNNING, STOP, LENGTH, CONTEXT = 0, 1, 2, 3
FINISH_REASONS = {STOP: "stop", LENGTH: "length", CONTEXT: "context"}
NO_STOP = -1  # padding of the stop-id table


@dataclasses.dataclass(frozen=True)
class EngineShape:
    """What every program is compiled for; per-request values are arrays in the state instead."""

    tcfg: TargetConfig
    dcfg: DrafterConfig | None  # None: plain target decoding
    slots: int  # R
    max_len: int  # S, context positions per slot
    max_stop_ids: int  # NS
    scheduler: SchedulerConfig
    acceptance: Callable = accept  # the rule; replaceable only to test that tests can fail

    @property
    def gamma(self) -> int:
        return self.dcfg.block_size if self.dcfg else 0

    @property
    def width(self) -> int:
        """W = γ + 1: the most tokens one request commits in a round."""
        return self.gamma + 1

    @property
    def max_verify(self) -> int:
        """The most drafts one request verifies in a round."""
        return self.scheduler.max_len(self.gamma) if self.dcfg else 0


@struct.dataclass
class Slots:
    """Per-slot decoding state; every field is [R] (stop_ids [R, NS])."""

    active: jax.Array  # bool
    length: jax.Array  # int32 n: positions 0..n-1 are in the caches; the anchor sits at n
    anchor: jax.Array  # int32 last committed token, not yet run through the target
    generated: jax.Array  # int32 output tokens so far
    max_new: jax.Array  # int32 budget
    temperature: jax.Array  # float32, 0 = greedy
    top_p: jax.Array  # float32
    top_k: jax.Array  # int32, 0 = off
    stop_ids: jax.Array  # int32 [R, NS], NO_STOP padded


@struct.dataclass
class EngineState:
    slots: Slots
    target_cache: KVCache
    draft_cache: DraftCache | None
    key: jax.Array


@struct.dataclass
class RoundOutput:
    tokens: jax.Array  # [R, W] committed tokens (first `count` valid)
    count: jax.Array  # [R] tokens committed this round (bonus included, after stop/budget cuts)
    verified: jax.Array  # [R] ℓ: drafts verified
    accepted: jax.Array  # [R] k: drafts accepted (before cuts)
    finish: jax.Array  # [R] RUNNING or a finish code
    was_active: jax.Array  # [R]


def init_state(shape: EngineShape, seed: int, mesh: Mesh | None = None) -> EngineState:
    """Empty slots and zeroed caches; on `mesh`, requests over (data, fsdp), KV heads over tensor
    and the small per-slot arrays replicated."""
    R, NS = shape.slots, shape.max_stop_ids
    slots = Slots(active=np.zeros(R, bool), length=np.zeros(R, np.int32),
                  anchor=np.zeros(R, np.int32), generated=np.zeros(R, np.int32),
                  max_new=np.zeros(R, np.int32), temperature=np.zeros(R, np.float32),
                  top_p=np.ones(R, np.float32), top_k=np.zeros(R, np.int32),
                  stop_ids=np.full((R, NS), NO_STOP, np.int32))
    draft = (DraftCache.create(shape.tcfg, shape.dcfg, R, shape.max_len)
             if shape.dcfg else None)
    state = EngineState(slots=slots, target_cache=KVCache.create(shape.tcfg, R, shape.max_len),
                        draft_cache=draft, key=jax.random.key(seed))
    if mesh is None:
        return jax.tree.map(jnp.asarray, state)
    cache = NamedSharding(mesh, logical_to_spec(
        ("layers", "batch", "cache_seq", "kv_heads", "head_dim")))
    replicated = NamedSharding(mesh, PartitionSpec())
    shard = jax.tree.map(lambda _: replicated, state)
    shard = shard.replace(target_cache=KVCache(k=cache, v=cache),
                          draft_cache=None if draft is None else DraftCache(k=cache, v=cache))
    return jax.device_put(state, shard)


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


def prefill(shape: EngineShape, state: EngineState, tparams, dparams, slot_idx, tokens, lengths,
            max_new, temperature, top_p, top_k, stop_ids):
    """Prompts [J, P] into slots `slot_idx` [J] (R = unused row); samples the first tokens.

    Returns (state, (first tokens [J], finish codes [J])).
    """
    tcfg, R = shape.tcfg, shape.slots
    J, P = tokens.shape
    take = jnp.minimum(slot_idx, R - 1)
    positions = jnp.broadcast_to(jnp.arange(P), (J, P))
    valid = positions < lengths[:, None]
    sub = KVCache(k=state.target_cache.k[:, take], v=state.target_cache.v[:, take])
    out = forward(tparams, tcfg, tokens, positions, cache=sub, valid=valid,
                  logit_index=(lengths - 1)[:, None])
    tc = KVCache(k=state.target_cache.k.at[:, slot_idx].set(out.cache.k, mode="drop"),
                 v=state.target_cache.v.at[:, slot_idx].set(out.cache.v, mode="drop"))
    dc = state.draft_cache
    if dc is not None:
        sub_d = DraftCache(k=dc.k[:, take], v=dc.v[:, take])
        sub_d = extend_context(dparams, tcfg, shape.dcfg, sub_d, out.taps, positions, valid)
        dc = DraftCache(k=dc.k.at[:, slot_idx].set(sub_d.k, mode="drop"),
                        v=dc.v.at[:, slot_idx].set(sub_d.v, mode="drop"))
    key, k_sample = jax.random.split(state.key)
    probs = target_probs(out.logits[:, 0], temperature, top_p, top_k)
    first = sample(k_sample, probs)
    count, finish = truncate(first[:, None], jnp.ones((J,), jnp.int32), stop_ids, max_new)
    finish = jnp.where((finish == RUNNING) & (lengths >= shape.max_len), CONTEXT, finish)
    s = state.slots
    upd = lambda field, value: field.at[slot_idx].set(value, mode="drop")  # noqa: E731
    slots = Slots(active=upd(s.active, finish == RUNNING), length=upd(s.length, lengths),
                  anchor=upd(s.anchor, first), generated=upd(s.generated, count),
                  max_new=upd(s.max_new, max_new), temperature=upd(s.temperature, temperature),
                  top_p=upd(s.top_p, top_p), top_k=upd(s.top_k, top_k),
                  stop_ids=upd(s.stop_ids, stop_ids))
    return EngineState(slots=slots, target_cache=tc, draft_cache=dc, key=key), (first, finish)


def verify_and_commit(shape: EngineShape, bucket: int, state: EngineState, tparams, dparams,
                      drafts: jax.Array, draft_probs: jax.Array | None, ell: jax.Array, key: jax.Array
                      ) -> tuple[EngineState, RoundOutput]:
    """Verifies every active slot's anchor and its first ℓ_r drafts in one flat batch of `bucket`
    tokens, accepts, and commits. drafts [R, γ] int32, draft_probs [R, γ, V] (None without a
    drafter), ℓ [R] as scheduled (clipped here to each slot's room and budget)."""
    tcfg, R, S, W = shape.tcfg, shape.slots, shape.max_len, shape.width
    s = state.slots
    k_acc = key
    remaining = s.max_new - s.generated
    # Verify positions n..n+ℓ < S, and no more drafts than the budget can still use.
    ell = jnp.clip(ell, 0, jnp.minimum(shape.max_verify, S - 1 - s.length))
    ell = jnp.where(s.active, jnp.minimum(ell, jnp.maximum(remaining - 1, 0)), 0)
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
    if draft_probs is not None:
        acc = shape.acceptance(k_acc, drafts, draft_probs, p, ell)
        k, nxt = acc.num_accepted, acc.next_token
    else:
        k, nxt = jnp.zeros((R,), jnp.int32), sample(k_acc, p[:, 0])
    jw = jnp.arange(W)
    padded = jnp.concatenate([drafts, jnp.zeros((R, 1), jnp.int32)], axis=1)
    tokens = jnp.where(jw < k[:, None], padded, nxt[:, None])
    count, finish = truncate(tokens, k + 1, s.stop_ids, remaining)
    new_length = s.length + k + 1
    finish = jnp.where((finish == RUNNING) & (new_length >= S), CONTEXT, finish)
    finish = jnp.where(s.active, finish, RUNNING)
    count = jnp.where(s.active, count, 0)
    dc = state.draft_cache
    if dc is not None:  # the drafter's context gains the anchor and the accepted drafts
        taps = jnp.zeros((R * W, out.taps.shape[-1]), out.taps.dtype).at[grid].set(
            out.taps, mode="drop").reshape(R, W, -1)
        dc = extend_context(dparams, tcfg, shape.dcfg, dc, taps, s.length[:, None] + jw,
                            (jw <= k[:, None]) & s.active[:, None])
    slots = s.replace(active=s.active & (finish == RUNNING),
                      length=jnp.where(s.active, new_length, s.length),
                      anchor=jnp.where(s.active, nxt, s.anchor),
                      generated=s.generated + count)
    new_state = EngineState(slots=slots, target_cache=out.cache, draft_cache=dc, key=state.key)
    return new_state, RoundOutput(tokens=tokens, count=count, verified=ell, accepted=k,
                                  finish=finish, was_active=s.active)


def scheduled_round(shape: EngineShape, bucket: int, state: EngineState, tparams, dparams
                    ) -> tuple[EngineState, RoundOutput]:
    """One decoding round for every active slot: the scheduler picks ℓ_r on the device, and at
    most `bucket` tokens are verified (the bucket holds every slot's anchor plus `max_verify`).
    Without a drafter it is plain target decoding (ℓ = 0)."""
    R, s = shape.slots, state.slots
    key, k_prop, k_acc = jax.random.split(state.key, 3)
    if shape.dcfg is not None:
        prop = propose(dparams, tparams, shape.tcfg, shape.dcfg, state.draft_cache, s.anchor,
                       s.length, s.temperature, k_prop)
        ell = schedule(shape.scheduler, jax.nn.sigmoid(prop.conf_logits))
        drafts, draft_probs = prop.tokens, prop.probs
    else:
        ell = jnp.zeros((R,), jnp.int32)
        drafts, draft_probs = jnp.zeros((R, 0), jnp.int32), None
    state, out = verify_and_commit(shape, bucket, state, tparams, dparams, drafts, draft_probs,
                                   ell, k_acc)
    return state.replace(key=key), out
