"""The Gemma4 text target (DESIGN §2b) as pure functions, behind the interface of `target.py`.

Params: `embed` [V, d], `sliding` (a stack over the sliding-window layers, in depth order), `full`
(a stack over the full-attention layers), `final_norm` [d], and `lm_head` [d, V] when untied; layer
names in `gemma4_layers.py`.

The two layer types have different shapes, so no single stack can be scanned. The stack is cut into
the shortest period of `layer_types` that repeats to the end (Gemma4-12B: 5 sliding + 1 full, 8
periods); a `lax.scan` runs over periods and the period's layers are unrolled inside it. Compile
time follows the period, not the depth: 6 layers' worth of HLO for the 12B in every prefill and
verification program, against 48 for a plain unrolled loop (a decode step of a 48-layer,
12B-patterned, tiny-width model compiles in 6.4 s of CPU this way, 28.5 s unrolled). A pattern that
never repeats (the tiny golden target) is one period, i.e. fully unrolled.

The decode cache (`Gemma4Cache`) keeps every position for full layers only; sliding layers keep a
ring of W = sliding_window - 1 + max_step slots per request (see there), so a long context costs
memory on the full layers alone.

Shapes: B batch, T tokens, R request rows, F flat tokens, S context positions, W ring slots,
d width, n query heads, k KV heads, h head dim, m taps.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct
from jax.sharding import NamedSharding

from dspark_jax.config import TargetConfig
from dspark_jax.models.gemma4_layers import (
    gelu_mlp,
    kv_heads_axis,
    layer_geometry,
    layer_rope,
    layer_stack_spec,
    scaled_embedding,
    unscaled_attention,
    value_norm,
)
from dspark_jax.models.layers import rms_norm
from dspark_jax.models.target import Taps, TargetOutput, lm_head, param_dtype
from dspark_jax.params import ArrayInfo
from dspark_jax.sharding import constrain

EMPTY = -1  # ring slot position of a slot that holds nothing
FAR = 2 ** 30  # beyond every position: the start of a row without new tokens


def gemma4_spec(cfg: TargetConfig) -> dict:
    """ArrayInfo tree of a Gemma4 target (torch Linear weights transposed to [in, out])."""
    w, V, d = param_dtype(cfg), cfg.vocab_size, cfg.hidden_size
    spec = {
        "embed": ArrayInfo((V, d), w, ("vocab", "embed")),
        "sliding": layer_stack_spec(cfg, len(cfg.sliding_layers), True, w),
        "full": layer_stack_spec(cfg, len(cfg.full_layers), False, w),
        "final_norm": ArrayInfo((d,), jnp.float32, ("norm",), "ones"),
    }
    if not cfg.tie_word_embeddings:
        spec["lm_head"] = ArrayInfo((d, V), w, ("embed", "vocab"))
    return spec


def layer_period(cfg: TargetConfig) -> tuple[bool, ...]:
    """The shortest run of layer types (True: sliding) that repeats to exactly the whole stack."""
    L = cfg.num_hidden_layers
    types = tuple(cfg.is_sliding(i) for i in range(L))
    p = next(p for p in range(1, L + 1) if L % p == 0 and types == types[:p] * (L // p))
    return types[:p]


def ring_slots(cfg: TargetConfig, max_len: int, max_step: int) -> int:
    """W: enough past keys for a window (W >= window - 1) even after a call of `max_step` tokens whose
    tail is then rejected; every position when that is no smaller."""
    return max(1, min(cfg.sliding_window - 1 + max_step, max_len))


@struct.dataclass
class Gemma4Cache:
    """The Gemma4 target's decode cache (the interface of `target.KVCache`).

    Full layers: slot s of a request holds position s (keys normed and rotated; values value-normed,
    from the raw key projection when keys are values). Sliding layers: a ring, slot `p % W` holding
    position p, with `ring_pos` saying which position each slot holds. A call's new tokens of a row
    occupy contiguous positions from the row's first valid one p0; sliding attention reads the ring
    slots at positions < p0 (earlier calls: entries a rejected speculation left at >= p0 are ignored)
    within the window, and then only the row's last W new tokens are written.
    """

    full_k: jax.Array  # [Lf, B, S, Kf, Hf]
    full_v: jax.Array  # [Lf, B, S, Kf, Hf]
    ring_k: jax.Array  # [Ls, B, W, K, H]
    ring_v: jax.Array  # [Ls, B, W, K, H]
    ring_pos: jax.Array  # [B, W] int32 absolute position in each slot, EMPTY when none

    @classmethod
    def create(cls, cfg: TargetConfig, batch: int, max_len: int, max_step: int = 1) -> "Gemma4Cache":
        """An empty cache of `batch` rows and `max_len` positions; `max_step` is the most tokens a row
        adds in one decode call (prefill calls may add any number)."""
        dtype, W = param_dtype(cfg), ring_slots(cfg, max_len, max_step)
        kf, hf, _ = layer_geometry(cfg, sliding=False)
        ks, hs, _ = layer_geometry(cfg, sliding=True)
        full = (len(cfg.full_layers), batch, max_len, kf, hf)
        ring = (len(cfg.sliding_layers), batch, W, ks, hs)
        return cls(full_k=jnp.zeros(full, dtype), full_v=jnp.zeros(full, dtype),  # distinct: donated
                   ring_k=jnp.zeros(ring, dtype), ring_v=jnp.zeros(ring, dtype),
                   ring_pos=jnp.full((batch, W), EMPTY, jnp.int32))

    @property
    def max_len(self) -> int:
        return self.full_k.shape[2]

    @property
    def window_slots(self) -> int:
        return self.ring_pos.shape[1]

    def take_rows(self, rows: jax.Array) -> "Gemma4Cache":
        """The cache of requests `rows` [J]."""
        return Gemma4Cache(full_k=self.full_k[:, rows], full_v=self.full_v[:, rows],
                           ring_k=self.ring_k[:, rows], ring_v=self.ring_v[:, rows],
                           ring_pos=self.ring_pos[rows])

    def put_rows(self, rows: jax.Array, sub: "Gemma4Cache") -> "Gemma4Cache":
        """This cache with rows `rows` [J] replaced by `sub`'s (out-of-range rows are dropped)."""
        put = lambda a, b: a.at[:, rows].set(b, mode="drop")  # noqa: E731
        return Gemma4Cache(full_k=put(self.full_k, sub.full_k), full_v=put(self.full_v, sub.full_v),
                           ring_k=put(self.ring_k, sub.ring_k), ring_v=put(self.ring_v, sub.ring_v),
                           ring_pos=self.ring_pos.at[rows].set(sub.ring_pos, mode="drop"))

    def logical_axes(self) -> "Gemma4Cache":
        """The logical axes of each array; a single KV head is not split (`kv_heads_axis`)."""
        full = ("layers", "batch", "cache_seq", kv_heads_axis(self.full_k.shape[3]), "head_dim")
        ring = ("layers", "batch", "cache_seq", kv_heads_axis(self.ring_k.shape[3]), "head_dim")
        return Gemma4Cache(full_k=full, full_v=full, ring_k=ring, ring_v=ring,
                           ring_pos=("batch", "cache_seq"))


# ----------------------------------------------------------------------------- layers


def _layer(layer, cfg: TargetConfig, sliding: bool, index, x: jax.Array, positions: jax.Array,
           attend, kv):
    """One sandwich layer, entry `index` of its type's stack; returns (x, kv). `attend` sees
    rotated q/k and normed v (see `_run_layers`)."""
    eps = cfg.rms_norm_eps
    h = rms_norm(x, layer["attn_norm"], eps)
    q = rms_norm(jnp.einsum("btd,dnh->btnh", h, layer["wq"]), layer["q_norm"], eps)
    k_raw = jnp.einsum("btd,dkh->btkh", h, layer["wk"])
    v_raw = jnp.einsum("btd,dkh->btkh", h, layer["wv"]) if "wv" in layer else k_raw
    k = rms_norm(k_raw, layer["k_norm"], eps)
    q, k = layer_rope(cfg, sliding, q, positions), layer_rope(cfg, sliding, k, positions)
    out, kv = attend(q, k, value_norm(v_raw, eps), kv, sliding, index)
    x = x + rms_norm(jnp.einsum("btnh,nhd->btd", out, layer["wo"]), layer["post_attn_norm"], eps)
    h = gelu_mlp(rms_norm(x, layer["mlp_norm"], eps), layer["w_gate"], layer["w_up"], layer["w_down"])
    x = x + rms_norm(h, layer["post_mlp_norm"], eps)
    return x * layer["layer_scalar"].astype(x.dtype), kv


def _run_layers(params, cfg: TargetConfig, x: jax.Array, positions: jax.Array, attend, kv):
    """The stack as a scan over periods of `layer_period`; returns (final normed hidden, taps, kv).

    `attend(q, k, v, kv, sliding, index) -> (out [b,t,n,h], kv)` is what differs between the
    full-sequence, cached and flat forwards; `index` is the layer's place in its type's stack. The
    cache rides in the carry and is updated by scatters, so a donated cache is written in place.
    """
    period = layer_period(cfg)
    p, n_periods = len(period), cfg.num_hidden_layers // len(period)
    per_type = {True: sum(period), False: p - sum(period)}
    stacks = {sliding: jax.tree.map(lambda a: a.reshape(n_periods, per_type[sliding], *a.shape[1:]),
                                    params["sliding" if sliding else "full"])
              for sliding in (True, False)}

    def period_step(carry, xs):
        x, taps, kv = carry
        layers, i = xs
        seen = {True: 0, False: 0}
        for j, sliding in enumerate(period):
            within = seen[sliding]
            seen[sliding] += 1
            layer = jax.tree.map(lambda a: a[within], layers[sliding])
            index = i * per_type[sliding] + within
            x, kv = _layer(layer, cfg, sliding, index, x, positions, attend, kv)
            taps = taps.record(i * p + j, x)
        return (x, taps, kv), None

    (x, taps, kv), _ = jax.lax.scan(period_step, (x, Taps.start(cfg, x), kv),
                                    (stacks, jnp.arange(n_periods)))
    hidden = rms_norm(x, params["final_norm"], cfg.rms_norm_eps)
    return hidden, taps.concatenated(cfg.num_taps), kv


# ----------------------------------------------------------------------------- masks and ring writes


def _window(cfg: TargetConfig, key_pos: jax.Array, query_pos: jax.Array) -> jax.Array:
    """key_pos [b, 1, s] within the sliding window of query_pos [b, t, 1] (itself included)."""
    return key_pos > query_pos - cfg.sliding_window


def _new_key_mask(cfg: TargetConfig, key_pos_bs, query_pos_bt, sliding: bool) -> jax.Array:
    """[b, t, s]: this call's keys (EMPTY: none) a query sees, causally and within the window."""
    k, q = key_pos_bs[:, None, :], query_pos_bt[:, :, None]
    mask = (k >= 0) & (k <= q)
    return mask & _window(cfg, k, q) if sliding else mask


def _ring_mask(cfg: TargetConfig, ring_pos_bw, first_bt, query_pos_bt) -> jax.Array:
    """[b, t, W]: ring slots a query sees: filled, before its row's first new token, in the window."""
    r = ring_pos_bw[:, None, :]
    return (r >= 0) & (r < first_bt[:, None, None]) & _window(cfg, r, query_pos_bt[:, :, None])


def _ring_write(key_pos: jax.Array, row_last: jax.Array, W: int) -> jax.Array:
    """Ring slot of each new key (W: not written): only a row's last W keys are kept."""
    keep = (key_pos >= 0) & (key_pos > row_last - W)
    return jnp.where(keep, key_pos % W, W)


def _sliding_attention(cfg, q, k, v, kv: Gemma4Cache, index, ring_mask, new_mask):
    """Attention over the ring of layer `index` and this call's keys (on the same rows)."""
    keys = jnp.concatenate([kv.ring_k[index], k], axis=1)
    values = jnp.concatenate([kv.ring_v[index], v], axis=1)
    return unscaled_attention(q, keys, values, jnp.concatenate([ring_mask, new_mask], axis=2))


# ----------------------------------------------------------------------------- forwards


def forward(params, cfg: TargetConfig, tokens: jax.Array, positions: jax.Array, *,
            cache: Gemma4Cache | None = None, valid: jax.Array | None = None,
            logit_index: jax.Array | None = None, compute_logits: bool = True,
            batch_sharding: NamedSharding | None = None) -> TargetOutput:
    """`target.forward` for Gemma4: tokens [B, T] at positions [B, T]; see there and `Gemma4Cache`."""
    B, T = tokens.shape
    valid = jnp.ones((B, T), bool) if valid is None else valid
    x = constrain(scaled_embedding(params["embed"], tokens, param_dtype(cfg)), batch_sharding)  # [B,T,d]
    key_pos = jnp.where(valid, positions, EMPTY)  # [B,T]
    masks = {s: _new_key_mask(cfg, key_pos, positions, s) for s in (True, False)}

    if cache is None:
        def attend(q, k, v, kv, sliding, index):
            return unscaled_attention(q, k, v, masks[sliding]), kv
    else:
        S, W = cache.max_len, cache.window_slots
        rows = jnp.arange(B)[:, None]
        write_pos = jnp.where(valid, positions, S)  # out of range: dropped by the scatter
        full_mask = jnp.arange(S)[None, None, :] <= positions[:, :, None]
        first = jnp.min(jnp.where(valid, positions, FAR), axis=1)  # [B]
        ring_mask = _ring_mask(cfg, cache.ring_pos, first, positions)
        ring_slot = _ring_write(key_pos, jnp.max(key_pos, axis=1, keepdims=True), W)  # [B,T]

        def attend(q, k, v, kv, sliding, index):
            if sliding:
                out = _sliding_attention(cfg, q, k, v, kv, index, ring_mask, masks[True])
                return out, kv.replace(ring_k=kv.ring_k.at[index, rows, ring_slot].set(k, mode="drop"),
                                       ring_v=kv.ring_v.at[index, rows, ring_slot].set(v, mode="drop"))
            fk = kv.full_k.at[index, rows, write_pos].set(k, mode="drop")
            fv = kv.full_v.at[index, rows, write_pos].set(v, mode="drop")
            return unscaled_attention(q, fk[index], fv[index], full_mask), kv.replace(full_k=fk, full_v=fv)

    hidden, taps, kv = _run_layers(params, cfg, x, positions, attend, cache)
    if cache is not None:
        kv = kv.replace(ring_pos=cache.ring_pos.at[rows, ring_slot].set(key_pos, mode="drop"))
    logits = None
    if compute_logits:
        sel = hidden if logit_index is None else jnp.take_along_axis(
            hidden, logit_index[..., None], axis=1)
        logits = lm_head(params, cfg, sel)
    return TargetOutput(logits=logits, taps=taps, hidden=hidden, cache=kv)


def forward_flat(params, cfg: TargetConfig, cache: Gemma4Cache, tokens: jax.Array, rows: jax.Array,
                 positions: jax.Array, valid: jax.Array, grid_index: jax.Array, width: int
                 ) -> TargetOutput:
    """`target.forward_flat` for Gemma4: F flat tokens, row `rows[i]` at `positions[i]`; attention
    on a [R, width] grid (`grid_index[i]` = row * width + offset). Logits [F, V], taps [F, m*d]."""
    R, S, W = cache.ring_pos.shape[0], cache.max_len, cache.window_slots
    x = scaled_embedding(params["embed"], tokens, param_dtype(cfg))[None]  # [1,F,d]
    grid = jnp.where(valid, grid_index, R * width)  # out of range: dropped
    grid_pos = jnp.full((R * width,), EMPTY, jnp.int32).at[grid].set(positions, mode="drop")
    grid_pos = grid_pos.reshape(R, width)  # position of each grid entry, EMPTY where none
    full_mask = jnp.arange(S)[None, None, :] <= grid_pos[:, :, None]  # [R,width,S]
    first = jnp.min(jnp.where(grid_pos >= 0, grid_pos, FAR), axis=1)  # [R]
    ring_mask = _ring_mask(cfg, cache.ring_pos, first, grid_pos)
    new_mask = _new_key_mask(cfg, grid_pos, grid_pos, sliding=True)
    write_pos = jnp.where(valid, positions, S)
    ring_slot = _ring_write(jnp.where(valid, positions, EMPTY), jnp.max(grid_pos, axis=1)[rows], W)

    def to_grid(a):  # [1, F, ...] -> [R, width, ...]
        out = jnp.zeros((R * width,) + a.shape[2:], a.dtype).at[grid].set(a[0], mode="drop")
        return out.reshape((R, width) + a.shape[2:])

    def attend(q, k, v, kv, sliding, index):
        if sliding:
            out = _sliding_attention(cfg, to_grid(q), to_grid(k), to_grid(v), kv, index, ring_mask,
                                     new_mask)
            kv = kv.replace(ring_k=kv.ring_k.at[index, rows, ring_slot].set(k[0], mode="drop"),
                            ring_v=kv.ring_v.at[index, rows, ring_slot].set(v[0], mode="drop"))
        else:
            fk = kv.full_k.at[index, rows, write_pos].set(k[0], mode="drop")
            fv = kv.full_v.at[index, rows, write_pos].set(v[0], mode="drop")
            out = unscaled_attention(to_grid(q), fk[index], fv[index], full_mask)
            kv = kv.replace(full_k=fk, full_v=fv)
        out = out.reshape((R * width,) + out.shape[2:])
        return out[jnp.minimum(grid, R * width - 1)][None], kv

    hidden, taps, kv = _run_layers(params, cfg, x, positions[None], attend, cache)
    kv = kv.replace(ring_pos=cache.ring_pos.at[rows, ring_slot].set(positions, mode="drop"))
    return TargetOutput(logits=lm_head(params, cfg, hidden[0]), taps=taps[0], hidden=hidden[0],
                        cache=kv)
