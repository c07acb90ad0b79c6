"""The engine's static shape and its device state (DESIGN §7).

`EngineShape` is everything static (configs, slot count, context, the scheduler, calibration); it is
hashable, so each device program is a `jax.jit` of a pure function with the shape bound. The state
is a pytree: per-slot arrays, the target KV cache, the drafter's context cache (a DSpark `DraftCache`,
or an `Eagle3Context` for an Eagle3 drafter) and the base key.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from dspark_jax.config import DrafterConfig, Eagle3Config, TargetConfig
from dspark_jax.decoding.acceptance import accept
from dspark_jax.decoding.calibration import Sts
from dspark_jax.decoding.schedulers import SchedulerConfig
from dspark_jax.models.drafter import DraftCache
from dspark_jax.models.eagle3 import Eagle3Cache
from dspark_jax.models.target import KVCache, new_cache, param_dtype
from dspark_jax.sharding import logical_to_spec

RUNNING, STOP, LENGTH, CONTEXT = 0, 1, 2, 3
PENDING = 64  # committed positions a slot may hold back from the drafter's context (see below)
FINISH_REASONS = {STOP: "stop", LENGTH: "length", CONTEXT: "context"}
NO_STOP = -1  # padding of the stop-id table


@dataclasses.dataclass(frozen=True)
class EngineShape:
    """What every program is compiled for; per-request values are arrays in the state instead."""

    tcfg: TargetConfig
    dcfg: DrafterConfig | Eagle3Config | None  # None: plain target decoding
    slots: int  # R
    max_len: int  # S, context positions per slot
    max_stop_ids: int  # NS
    scheduler: SchedulerConfig
    sts: Sts | None = None  # the confidence calibration, one temperature and bias per draft position
    acceptance: Callable = accept  # the rule; replaceable only to test that tests can fail
    logprobs: int = 0  # N > 0: every committed token's target logprob and the top N; 0 = off
    pending: int = PENDING  # rounds without a proposal a slot's PendingContext holds
    # The programs run on one device, not a mesh: rounds without a proposal then write the held-back
    # features in place (a scatter declared unique, see `dspark_commit_context`).
    one_device: bool = False

    @property
    def gamma(self) -> int:
        return self.dcfg.proposal_length if self.dcfg else 0

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
    seed: jax.Array  # uint32: the request's random stream (sampling.row_keys)
    stop_ids: jax.Array  # int32 [R, NS], NO_STOP padded


@struct.dataclass
class PendingContext:
    """Target features of tokens committed by rounds without a proposal, not yet projected into the
    drafter's context cache: a round without a proposal only stores them, and the next proposal
    projects them all at once (or `flush_round`, which the host dispatches before a buffer can
    overflow), so that a plain round costs what plain decoding costs."""

    taps: jax.Array  # [R, pending, m*d] target dtype
    count: jax.Array  # [R] int32: they hold positions length - count .. length - 1


@struct.dataclass
class Eagle3Context:
    """An Eagle3 drafter's per-slot context: its one layer's KV cache (rows at positions
    0..length-1, row p = token p+1 with the target features of position p, so the last row holds
    the anchor) and that last row's layer output, where the next chain starts."""

    cache: Eagle3Cache  # k, v [R, S, k, h]
    hidden: jax.Array  # [R, d] drafter compute dtype

    @classmethod
    def create(cls, tcfg: TargetConfig, ecfg: Eagle3Config, slots: int, max_len: int) -> "Eagle3Context":
        return cls(cache=Eagle3Cache.create(tcfg, ecfg, slots, max_len),
                   hidden=jnp.zeros((slots, tcfg.hidden_size), jnp.dtype(ecfg.dtype)))


def calibrated(shape: EngineShape, z: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Confidence logits z [R, γ] -> (c [R, γ], a [R, γ]) under the engine's calibration
    (`calibration.Sts`): the factor form scales each logit, c_j = σ(z_j / T_j + b_j), a = Π c; the
    survival form scales the log prefix survival, log a_j = log(Π_{i≤j} σ(z_i)) / T_j + b_j, and
    c_j = a_j / a_{j-1}. No calibration: c = σ(z)."""
    sts = shape.sts
    if sts is None or sts.form == "factor":
        if sts is not None:
            z = z / jnp.asarray(sts.temperatures, jnp.float32) + jnp.asarray(sts.biases, jnp.float32)
        c = jax.nn.sigmoid(z)
        return c, jnp.cumprod(c, axis=-1)
    log_a = (jnp.cumsum(jax.nn.log_sigmoid(z), axis=-1) / jnp.asarray(sts.temperatures, jnp.float32)
             + jnp.asarray(sts.biases, jnp.float32))
    # ≤ 0 and non-increasing along j already (the file's checks); the clamps only make sure that
    # float rounding cannot break what top-K's rank argument relies on.
    log_a = jax.lax.cummin(jnp.minimum(log_a, 0.0), axis=z.ndim - 1)
    prev = jnp.concatenate([jnp.zeros_like(log_a[..., :1]), log_a[..., :-1]], axis=-1)
    return jnp.exp(log_a - prev), jnp.exp(log_a)


@struct.dataclass
class Draft:
    """One round's proposal for every slot."""

    tokens: jax.Array  # [R, γ] int32 d_1..d_γ
    probs: jax.Array  # [R, γ, V] float32 q_j the drafts were sampled from
    conf_logits: jax.Array  # [R, γ] raw confidence logits
    confidence: jax.Array  # [R, γ] calibrated c_j
    survival: jax.Array  # [R, γ] calibrated prefix survival a_j


@struct.dataclass
class Verified:
    """What a drafter's context learns from a round's verification (`commit_context`)."""

    taps: jax.Array  # [F, m*d] target features of the flat verified tokens
    grid: jax.Array  # [F] int32 row * W + offset of each flat token; R * W for padding
    row: jax.Array  # [F] int32 the slot of each flat token
    valid: jax.Array  # [F] bool: a real token, not padding
    tokens: jax.Array  # [R, W] int32 committed tokens: the first k + 1 of each row count
    accepted: jax.Array  # [R] int32 k

    def taps_grid(self, R: int, W: int) -> jax.Array:
        """[R, W, m*d]: the features by slot and offset (zeros where nothing was verified)."""
        out = jnp.zeros((R * W, self.taps.shape[-1]), self.taps.dtype)
        return out.at[self.grid].set(self.taps, mode="drop").reshape(R, W, -1)


@struct.dataclass
class EngineState:
    slots: Slots
    target_cache: KVCache
    draft_cache: DraftCache | Eagle3Context | None
    pending: PendingContext | None  # with a drafter
    key: jax.Array  # the engine's base key; never advanced (streams are per request and position)


@struct.dataclass
class RoundOutput:
    """What the host reads back of a round. It crosses to the host packed into two arrays (a read
    costs per array, and the host reads one round per round)."""

    tokens: jax.Array  # [R, W] committed tokens (first `count` valid)
    count: jax.Array  # [R] tokens committed this round (bonus included, after stop/budget cuts)
    verified: jax.Array  # [R] ℓ: drafts verified
    accepted: jax.Array  # [R] k: drafts accepted (before cuts)
    finish: jax.Array  # [R] RUNNING or a finish code
    was_active: jax.Array  # [R] bool
    conf_logits: jax.Array  # [R, γ] raw confidence logits of the round's block ([R, 0]: none)
    survival: jax.Array  # [R, γ] calibrated prefix survival a_j ([R, 0]: no proposal)
    # With EngineShape.logprobs = N > 0 (else None): per committed token, the log-softmax of the
    # target's raw logits (T = 1, unfiltered) at the token and at its N most likely tokens.
    logprob: jax.Array | None = None  # [R, W] float32
    top_ids: jax.Array | None = None  # [R, W, N] int32
    top_logprobs: jax.Array | None = None  # [R, W, N] float32

    def pack(self) -> tuple[jax.Array, ...]:
        """(int32 [R, W + 5], float32 [R, 2γ]) on the device; with logprobs also (int32 [R, W, N],
        float32 [R, W, 1 + N])."""
        columns = (self.count, self.verified, self.accepted, self.finish, self.was_active)
        ints = jnp.concatenate([self.tokens] + [c.astype(jnp.int32)[:, None] for c in columns], 1)
        packed = (ints, jnp.concatenate([self.conf_logits, self.survival], 1))
        if self.logprob is None:
            return packed
        return packed + (self.top_ids, jnp.concatenate([self.logprob[..., None],
                                                        self.top_logprobs], -1))

    @classmethod
    def unpack(cls, packed) -> "RoundOutput":
        """numpy RoundOutput from the host copy of `pack()`."""
        ints, floats, *lp = packed
        W, gamma = ints.shape[1] - 5, floats.shape[1] // 2
        extra = {"logprob": lp[1][..., 0], "top_ids": lp[0], "top_logprobs": lp[1][..., 1:]} \
            if lp else {}
        return cls(tokens=ints[:, :W], count=ints[:, W], verified=ints[:, W + 1],
                   accepted=ints[:, W + 2], finish=ints[:, W + 3], was_active=ints[:, W + 4] > 0,
                   conf_logits=floats[:, :gamma], survival=floats[:, gamma:], **extra)


def init_state(shape: EngineShape, seed: int, mesh: Mesh | None = None) -> EngineState:
    """Empty slots and zeroed caches; on `mesh`, requests over (data, fsdp), KV heads over tensor
    (a single KV head is held whole: the caches' `logical_axes`) and the small per-slot arrays
    replicated (`state_shardings`). On a mesh the state is made by
    one program with those output shardings: each device allocates only its own shard, and no
    process ships host values to another."""
    if mesh is None:
        return empty_state(shape, seed)
    return _state_builder(shape, seed, mesh)()


def abstract_state(shape: EngineShape, mesh: Mesh | None = None) -> EngineState:
    """The state `init_state` makes, as jax.ShapeDtypeStruct leaves (with their shardings on
    `mesh`): for compiling the device programs without allocating it."""
    state = jax.eval_shape(functools.partial(empty_state, shape, 0))
    if mesh is None:
        return state
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), state,
                        state_shardings(shape, mesh))


def empty_state(shape: EngineShape, seed: int) -> EngineState:
    """The state of empty slots, unplaced (a pure function: `init_state` jits it on a mesh)."""
    R, NS = shape.slots, shape.max_stop_ids
    slots = Slots(active=jnp.zeros(R, bool), length=jnp.zeros(R, jnp.int32),
                  anchor=jnp.zeros(R, jnp.int32), generated=jnp.zeros(R, jnp.int32),
                  max_new=jnp.zeros(R, jnp.int32), temperature=jnp.zeros(R, jnp.float32),
                  top_p=jnp.ones(R, jnp.float32), top_k=jnp.zeros(R, jnp.int32),
                  seed=jnp.zeros(R, jnp.uint32), stop_ids=jnp.full((R, NS), NO_STOP, jnp.int32))
    draft = pending = None
    if isinstance(shape.dcfg, Eagle3Config):  # its context is extended every round: nothing held back
        draft = Eagle3Context.create(shape.tcfg, shape.dcfg, R, shape.max_len)
    elif shape.dcfg:
        tcfg = shape.tcfg
        draft = DraftCache.create(tcfg, shape.dcfg, R, shape.max_len)
        pending = PendingContext(
            taps=jnp.zeros((R, shape.pending, tcfg.num_taps * tcfg.hidden_size), param_dtype(tcfg)),
            count=jnp.zeros(R, jnp.int32))
    target_cache = new_cache(shape.tcfg, R, shape.max_len, max_step=1 + shape.max_verify)
    return EngineState(slots=slots, target_cache=target_cache,
                       draft_cache=draft, pending=pending, key=jax.random.key(seed))


def state_shardings(shape: EngineShape, mesh: Mesh) -> EngineState:
    """NamedSharding of every state leaf: caches by their logical axes, the rest replicated."""
    state = jax.eval_shape(functools.partial(empty_state, shape, 0))
    by_axes = lambda axes_tree: jax.tree.map(  # noqa: E731
        lambda axes: NamedSharding(mesh, logical_to_spec(axes)), axes_tree,
        is_leaf=lambda x: isinstance(x, tuple))
    replicated = NamedSharding(mesh, PartitionSpec())
    shard = jax.tree.map(lambda _: replicated, state)
    draft = state.draft_cache
    if isinstance(draft, Eagle3Context):  # one layer: no layers axis
        one = NamedSharding(mesh, logical_to_spec(("batch", "cache_seq", "kv_heads", "head_dim")))
        draft_shard = Eagle3Context(cache=Eagle3Cache(k=one, v=one), hidden=replicated)
    else:
        draft_shard = None if draft is None else by_axes(draft.logical_axes())
    target_shard = by_axes(state.target_cache.logical_axes())
    return shard.replace(target_cache=target_shard, draft_cache=draft_shard)


@functools.lru_cache(maxsize=16)
def _state_builder(shape: EngineShape, seed: int, mesh: Mesh):
    """The program that makes the empty state on `mesh` (cached: `Engine.reset` calls it often)."""
    return jax.jit(functools.partial(empty_state, shape, seed),
                   out_shardings=state_shardings(shape, mesh))


def prefill_arrays(R: int, NS: int, J: int, P: int, batch=None) -> tuple:
    """Host arrays for one prefill call of J prompts padded to P tokens, from (slot, Request) pairs
    in `batch` (unused rows point at slot R, past the last; all of them when `batch` is None)."""
    slot_idx = np.full(J, R, np.int32)
    tokens = np.zeros((J, P), np.int32)
    lengths = np.ones(J, np.int32)
    max_new = np.ones(J, np.int32)
    temperature = np.zeros(J, np.float32)
    top_p = np.ones(J, np.float32)
    top_k = np.zeros(J, np.int32)
    seed = np.zeros(J, np.uint32)
    stop_ids = np.full((J, NS), NO_STOP, np.int32)
    for i, (slot, req) in enumerate(batch or []):
        slot_idx[i] = slot
        tokens[i, :len(req.prompt_ids)] = req.prompt_ids
        lengths[i] = len(req.prompt_ids)
        max_new[i] = req.max_new_tokens
        temperature[i], top_p[i], top_k[i] = req.temperature, req.top_p, req.top_k
        seed[i] = req.stream
        stop_ids[i, :len(req.stop_ids)] = req.stop_ids
    return slot_idx, tokens, lengths, max_new, temperature, top_p, top_k, seed, stop_ids
