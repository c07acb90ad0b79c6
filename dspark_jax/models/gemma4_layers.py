"""Gemma4 building blocks shared by the Gemma4 target and its DSpark drafter (DESIGN §2b).

What differs from Qwen3's layer, in one place: the embedding is scaled by sqrt(width); norms use the
stored weight (not one plus it) and values get a weightless norm; a layer is a sandwich (norm after
attention and after the MLP) whose output is multiplied by `layer_scalar`; the MLP is GELU-tanh;
scores are not scaled by 1/sqrt(head_dim); full layers rotate only `partial_rotary_factor` of their
head dim ("proportional" RoPE) and may take the raw key projection as the value; logits are
soft-capped.

Parameter names of one layer stack (leading `layers` axis of size L), each [L, ...]:
`attn_norm`, `wq` [d,n,h], `wk` [d,k,h], `wv` [d,k,h] (absent when keys are values), `wo` [n,h,d],
`q_norm`, `k_norm` [h], `post_attn_norm`, `mlp_norm` (pre-feed-forward), `post_mlp_norm` [d],
`layer_scalar` [1], `w_gate`, `w_up` [d,f], `w_down` [f,d].
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from dspark_jax.config import TargetConfig
from dspark_jax.models.layers import NEG_INF
from dspark_jax.params import ArrayInfo


def layer_geometry(cfg: TargetConfig, sliding: bool) -> tuple[int, int, bool]:
    """(KV heads, head dim, has a value projection) of a sliding or a full layer."""
    if sliding:
        return cfg.num_key_value_heads, cfg.head_dim, True
    return cfg.full_kv_heads, cfg.full_head_dim, not cfg.attention_k_eq_v


def kv_heads_axis(num_kv_heads: int) -> str | None:
    """The logical axis of a KV-head dimension: a single head (Gemma4's full layers) cannot be split
    over tensor devices, so every tensor shard holds it whole (replicated by name, not by a rule
    that gives up); more heads shard as `kv_heads` and must divide the mesh."""
    return "kv_heads" if num_kv_heads > 1 else None


def layer_stack_spec(cfg: TargetConfig, num_layers: int, sliding: bool, dtype) -> dict:
    """ArrayInfo tree of `num_layers` stacked Gemma4 layers of one type (norms float32)."""
    L, d, f, n = num_layers, cfg.hidden_size, cfg.intermediate_size, cfg.num_attention_heads
    k, h, has_v = layer_geometry(cfg, sliding)
    kv = kv_heads_axis(k)
    f32 = jnp.float32
    spec = {
        "attn_norm": ArrayInfo((L, d), f32, ("layers", "norm"), "ones"),
        "wq": ArrayInfo((L, d, n, h), dtype, ("layers", "embed", "heads", "head_dim")),
        "wk": ArrayInfo((L, d, k, h), dtype, ("layers", "embed", kv, "head_dim")),
        "wo": ArrayInfo((L, n, h, d), dtype, ("layers", "heads", "head_dim", "embed")),
        "q_norm": ArrayInfo((L, h), f32, ("layers", "norm"), "ones"),
        "k_norm": ArrayInfo((L, h), f32, ("layers", "norm"), "ones"),
        "post_attn_norm": ArrayInfo((L, d), f32, ("layers", "norm"), "ones"),
        "mlp_norm": ArrayInfo((L, d), f32, ("layers", "norm"), "ones"),
        "post_mlp_norm": ArrayInfo((L, d), f32, ("layers", "norm"), "ones"),
        "layer_scalar": ArrayInfo((L, 1), f32, ("layers", None), "ones"),
        "w_gate": ArrayInfo((L, d, f), dtype, ("layers", "embed", "mlp")),
        "w_up": ArrayInfo((L, d, f), dtype, ("layers", "embed", "mlp")),
        "w_down": ArrayInfo((L, f, d), dtype, ("layers", "mlp", "embed")),
    }
    if has_v:
        spec["wv"] = ArrayInfo((L, d, k, h), dtype, ("layers", "embed", kv, "head_dim"))
    return spec


def scaled_embedding(table: jax.Array, tokens: jax.Array, dtype) -> jax.Array:
    """table[tokens] * sqrt(width), the factor cast to the table's dtype first (bf16: 62.0 at 3840)."""
    scale = jnp.asarray(math.sqrt(table.shape[-1]), table.dtype)
    return (table[tokens] * scale).astype(dtype)


def value_norm(v: jax.Array, eps: float) -> jax.Array:
    """The weightless RMS norm Gemma4 applies to values, in float32."""
    v32 = v.astype(jnp.float32)
    return (v32 * jax.lax.rsqrt(jnp.mean(v32 * v32, axis=-1, keepdims=True) + eps)).astype(v.dtype)


def rope_partial(x_bthd: jax.Array, positions_bt: jax.Array, theta: float, rotated_pairs: int
                 ) -> jax.Array:
    """Rotate-half RoPE where only the first `rotated_pairs` of the h/2 frequency pairs turn
    (frequency j = theta^(-2j/h), the exponent over the whole head dim); the others have frequency
    0 and pass through. `rotated_pairs = h/2` is the default RoPE."""
    h = x_bthd.shape[-1]
    j = jnp.arange(h // 2, dtype=jnp.float32)
    inv_freq = jnp.where(j < rotated_pairs, 1.0 / (theta ** (2 * j / h)), 0.0)
    angles = positions_bt.astype(jnp.float32)[..., None] * inv_freq
    cos = jnp.cos(jnp.concatenate([angles, angles], -1))[:, :, None, :]
    sin = jnp.sin(jnp.concatenate([angles, angles], -1))[:, :, None, :]
    x = x_bthd.astype(jnp.float32)
    rotated = jnp.concatenate([-x[..., h // 2:], x[..., : h // 2]], axis=-1)
    return (x * cos + rotated * sin).astype(x_bthd.dtype)


def rotated_pairs(cfg: TargetConfig, sliding: bool) -> int:
    """How many frequency pairs a layer rotates: all on sliding layers, floor(factor * h/2) on full."""
    if sliding:
        return cfg.head_dim // 2
    return int(math.floor(cfg.partial_rotary_factor * cfg.full_head_dim / 2))


def layer_rope(cfg: TargetConfig, sliding: bool, x: jax.Array, positions: jax.Array) -> jax.Array:
    """RoPE of a sliding or a full layer."""
    theta = cfg.rope_theta if sliding else cfg.full_rope_theta
    return rope_partial(x, positions, theta, rotated_pairs(cfg, sliding))


def gelu_mlp(x_btd: jax.Array, w_gate_df: jax.Array, w_up_df: jax.Array, w_down_fd: jax.Array
             ) -> jax.Array:
    """down(gelu_tanh(gate(x)) * up(x))."""
    gate = jnp.einsum("btd,df->btf", x_btd, w_gate_df)
    up = jnp.einsum("btd,df->btf", x_btd, w_up_df)
    return jnp.einsum("btf,fd->btd", jax.nn.gelu(gate, approximate=True) * up, w_down_fd)


def softcap(logits: jax.Array, cap: float) -> jax.Array:
    """cap * tanh(logits / cap); identity when cap is 0."""
    return logits if not cap else cap * jnp.tanh(logits / cap)


def unscaled_attention(q_btnh: jax.Array, k_bskh: jax.Array, v_bskh: jax.Array,
                       mask_bts: jax.Array) -> jax.Array:
    """Grouped-query softmax attention with score scale 1 (Gemma4's), float32 scores; [b,t,n,h]."""
    b, t, n, h = q_btnh.shape
    kv = k_bskh.shape[2]
    q = q_btnh.reshape(b, t, kv, n // kv, h)
    scores = jnp.einsum("btkgh,bskh->bkgts", q, k_bskh, preferred_element_type=jnp.float32)
    scores = jnp.where(mask_bts[:, None, None], scores, NEG_INF)
    probs = jax.nn.softmax(scores, axis=-1).astype(v_bskh.dtype)
    return jnp.einsum("bkgts,bskh->btkgh", probs, v_bskh).reshape(b, t, n, h)
