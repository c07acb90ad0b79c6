"""The Qwen3 target model as pure functions over a params pytree.

One `forward` serves full-sequence evaluation (training), prefill and multi-token extension against a
KV cache at per-request positions. Layers are stacked on a leading `layers` axis and run under
`lax.scan`, so compile time does not grow with depth.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct
from jax.sharding import NamedSharding

from dspark_jax.config import TargetConfig
from dspark_jax.models.gemma4_layers import softcap
from dspark_jax.models.layers import attention, project_qkv, rms_norm, rope, swiglu
from dspark_jax.params import ArrayInfo
from dspark_jax.sharding import constrain


def param_dtype(cfg: TargetConfig):
    return jnp.dtype(cfg.dtype)


def target_spec(cfg: TargetConfig) -> dict:
    """ArrayInfo tree of the target's parameters (torch Linear weights transposed to [in, out])."""
    if cfg.family == "gemma4":
        from dspark_jax.models import gemma4  # it builds on this module
        return gemma4.gemma4_spec(cfg)
    L, d, f = cfg.num_hidden_layers, cfg.hidden_size, cfg.intermediate_size
    n, k, h, V = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.vocab_size
    w = param_dtype(cfg)
    f32 = jnp.float32
    spec = {
        "embed": ArrayInfo((V, d), w, ("vocab", "embed")),
        "layers": {
            "attn_norm": ArrayInfo((L, d), f32, ("layers", "norm"), "ones"),
            "wq": ArrayInfo((L, d, n, h), w, ("layers", "embed", "heads", "head_dim")),
            "wk": ArrayInfo((L, d, k, h), w, ("layers", "embed", "kv_heads", "head_dim")),
            "wv": ArrayInfo((L, d, k, h), w, ("layers", "embed", "kv_heads", "head_dim")),
            "wo": ArrayInfo((L, n, h, d), w, ("layers", "heads", "head_dim", "embed")),
            "q_norm": ArrayInfo((L, h), f32, ("layers", "norm"), "ones"),
            "k_norm": ArrayInfo((L, h), f32, ("layers", "norm"), "ones"),
            "mlp_norm": ArrayInfo((L, d), f32, ("layers", "norm"), "ones"),
            "w_gate": ArrayInfo((L, d, f), w, ("layers", "embed", "mlp")),
            "w_up": ArrayInfo((L, d, f), w, ("layers", "embed", "mlp")),
            "w_down": ArrayInfo((L, f, d), w, ("layers", "mlp", "embed")),
        },
        "final_norm": ArrayInfo((d,), f32, ("norm",), "ones"),
    }
    if not cfg.tie_word_embeddings:
        spec["lm_head"] = ArrayInfo((d, V), w, ("embed", "vocab"))
    return spec


@struct.dataclass
class KVCache:
    """Target KV cache; slot s of a request holds the token at absolute position s."""

    k: jax.Array  # [L, B, S, K, H]
    v: jax.Array  # [L, B, S, K, H]

    @classmethod
    def create(cls, cfg: TargetConfig, batch: int, max_len: int, max_step: int = 1) -> "KVCache":
        """An empty cache of `batch` rows and `max_len` positions. `max_step` (the most tokens one
        row adds in a decode call) sizes what a family keeps for its sliding layers; unused here."""
        shape = (cfg.num_hidden_layers, batch, max_len, cfg.num_key_value_heads, cfg.head_dim)
        zeros = jnp.zeros(shape, param_dtype(cfg))
        return cls(k=zeros, v=jnp.zeros_like(zeros))  # distinct buffers: both are donated

    @property
    def max_len(self) -> int:
        return self.k.shape[2]

    # The engine touches a cache only through these, so a family may lay its cache out as it needs.
    def take_rows(self, rows: jax.Array) -> "KVCache":
        """The cache of requests `rows` [J] (a batch of J rows)."""
        return KVCache(k=self.k[:, rows], v=self.v[:, rows])

    def put_rows(self, rows: jax.Array, sub: "KVCache") -> "KVCache":
        """This cache with rows `rows` [J] replaced by `sub`'s (out-of-range rows are dropped)."""
        return KVCache(k=self.k.at[:, rows].set(sub.k, mode="drop"),
                       v=self.v.at[:, rows].set(sub.v, mode="drop"))

    @staticmethod
    def logical_axes() -> "KVCache":
        """The logical axes of each array (sharding rules map them onto a mesh)."""
        axes = ("layers", "batch", "cache_seq", "kv_heads", "head_dim")
        return KVCache(k=axes, v=axes)


def new_cache(cfg: TargetConfig, batch: int, max_len: int, max_step: int = 1):
    """An empty decode cache of the target's family (see `KVCache` for the interface)."""
    if cfg.family == "gemma4":
        from dspark_jax.models import gemma4
        return gemma4.Gemma4Cache.create(cfg, batch, max_len, max_step)
    return KVCache.create(cfg, batch, max_len, max_step)


@struct.dataclass
class TargetOutput:
    logits: jax.Array | None  # [B, T or K, V] float32
    taps: jax.Array  # [B, T, m*d] tapped layer outputs, concatenated in target_layer_ids order
    hidden: jax.Array  # [B, T, d] final (normed) hidden state, the lm_head input
    cache: KVCache | None


def lm_head(params, cfg: TargetConfig, hidden_btd: jax.Array) -> jax.Array:
    """float32 logits [..., V] from final hidden states (soft-capped when the family caps them)."""
    if cfg.tie_word_embeddings:
        logits = jnp.einsum("...d,vd->...v", hidden_btd, params["embed"],
                            preferred_element_type=jnp.float32)
    else:
        logits = jnp.einsum("...d,dv->...v", hidden_btd, params["lm_head"],
                            preferred_element_type=jnp.float32)
    return softcap(logits, cfg.final_logit_softcapping)


@struct.dataclass
class Taps:
    """The tapped layer outputs as a decoder stack collects them (both families' stacks use it).

    `buf` [max(m, 1), B, T, d] holds tap i in row i (the embedding output already in row 0 when
    layer -1 is tapped); `slot_of_layer` [L] is a layer's row, or -1 when it is not tapped.
    """

    buf: jax.Array
    slot_of_layer: jax.Array

    @classmethod
    def start(cls, cfg: TargetConfig, x: jax.Array) -> "Taps":
        """Empty taps for the embedded stream x [B, T, d]."""
        ids = cfg.target_layer_ids
        slot_of_layer = [-1] * cfg.num_hidden_layers
        for slot, layer_id in enumerate(ids):
            if layer_id >= 0:
                slot_of_layer[layer_id] = slot
        buf = jnp.zeros((max(len(ids), 1),) + x.shape, x.dtype)
        if ids and ids[0] == -1:
            buf = buf.at[0].set(x)
        return cls(buf=buf, slot_of_layer=jnp.asarray(slot_of_layer, jnp.int32))

    def record(self, layer_id: jax.Array, x: jax.Array) -> "Taps":
        """Keeps x as layer `layer_id`'s output when that layer is tapped (a traced id is fine)."""
        slot = self.slot_of_layer[layer_id]
        safe = jnp.maximum(slot, 0)
        keep = jnp.where(slot >= 0, x, self.buf[safe])
        return self.replace(buf=jax.lax.dynamic_update_index_in_dim(self.buf, keep, safe, 0))

    def concatenated(self, m: int) -> jax.Array:
        """[B, T, m*d], the taps side by side in target_layer_ids order."""
        B, T, d = self.buf.shape[1:]
        return jnp.moveaxis(self.buf[:m], 0, 2).reshape(B, T, m * d)


def _run_layers(params, cfg: TargetConfig, x: jax.Array, positions: jax.Array, attend, kv):
    """The decoder stack under lax.scan; returns (final normed hidden, taps [.., m*d], kv).

    `attend(q, k, v, kv, layer_id) -> (out, kv)` is the only part that differs between the full,
    cached and flat forwards: it sees rotated q/k and the whole cache (or None). The cache rides in
    the scan carry and is updated by scatters at the layer index, so a donated cache is written in
    place: a round costs the new tokens' keys and values, not a copy of the cache.
    """
    eps = cfg.rms_norm_eps

    def layer_step(carry, xs):
        x, taps, kv = carry
        layer, layer_id = xs
        q, k, v = project_qkv(rms_norm(x, layer["attn_norm"], eps), layer, eps)
        q, k = rope(q, positions, cfg.rope_theta), rope(k, positions, cfg.rope_theta)
        out, kv = attend(q, k, v, kv, layer_id)
        x = x + jnp.einsum("btnh,nhd->btd", out, layer["wo"])
        h = rms_norm(x, layer["mlp_norm"], eps)
        x = x + swiglu(h, layer["w_gate"], layer["w_up"], layer["w_down"])
        return (x, taps.record(layer_id, x), kv), None

    layer_ids = jnp.arange(cfg.num_hidden_layers)
    (x, taps, kv), _ = jax.lax.scan(layer_step, (x, Taps.start(cfg, x), kv), (params["layers"], layer_ids))
    hidden = rms_norm(x, params["final_norm"], eps)
    return hidden, taps.concatenated(cfg.num_taps), kv


def forward(params, cfg: TargetConfig, tokens: jax.Array, positions: jax.Array, *,
            cache: KVCache | None = None, valid: jax.Array | None = None,
            logit_index: jax.Array | None = None, compute_logits: bool = True,
            batch_sharding: NamedSharding | None = None, span: int | None = None) -> TargetOutput:
    """Runs the target over `tokens` [B, T] at absolute `positions` [B, T].

    Without a cache, tokens attend causally (by position) to the valid tokens of their own row.
    With a cache, new keys/values of valid tokens are written at their positions and each token
    attends to cache slots <= its position; invalid (padding) tokens are never written. `span`
    (static, Qwen3): every position is below it, so attention reads the cache's first `span` slots
    only (a prompt's prefill: its bucket, not the context capacity).
    `logit_index` [B, K] selects the positions whose logits are computed (all when None).
    `batch_sharding` (training on a mesh): the activations' layout, rows over the batch axes.
    """
    if cfg.family == "gemma4":
        from dspark_jax.models import gemma4
        return gemma4.forward(params, cfg, tokens, positions, cache=cache, valid=valid,
                              logit_index=logit_index, compute_logits=compute_logits,
                              batch_sharding=batch_sharding)
    B, T = tokens.shape
    valid = jnp.ones((B, T), bool) if valid is None else valid
    x = constrain(params["embed"][tokens].astype(param_dtype(cfg)), batch_sharding)  # [B,T,d]

    if cache is None:
        mask = (positions[:, None, :] <= positions[:, :, None]) & valid[:, None, :]
        attend = lambda q, k, v, kv, layer_id: (attention(q, k, v, mask), None)
        kv_in = None
    else:
        S = cache.max_len
        mask = jnp.arange(S)[None, None, :] <= positions[:, :, None]
        write_pos = jnp.where(valid, positions, S)  # out of range: dropped by the scatter
        rows = jnp.arange(B)[:, None]

        span = S if span is None else min(span, S)

        def attend(q, k, v, kv, layer_id):
            ck = kv[0].at[layer_id, rows, write_pos].set(k, mode="drop")
            cv = kv[1].at[layer_id, rows, write_pos].set(v, mode="drop")
            sub = lambda c: jax.lax.dynamic_slice(  # noqa: E731
                c, (layer_id, 0, 0, 0, 0), (1, B, span) + c.shape[3:])[0]
            return attention(q, sub(ck), sub(cv), mask[:, :, :span]), (ck, cv)

        kv_in = (cache.k, cache.v)
    hidden, taps, kv_out = _run_layers(params, cfg, x, positions, attend, kv_in)

    logits = None
    if compute_logits:
        sel = hidden if logit_index is None else jnp.take_along_axis(
            hidden, logit_index[..., None], axis=1)
        logits = lm_head(params, cfg, sel)
    new_cache = None if cache is None else KVCache(k=kv_out[0], v=kv_out[1])
    return TargetOutput(logits=logits, taps=taps, hidden=hidden, cache=new_cache)


def attention_spans(max_len: int) -> tuple[int, ...]:
    """The cache prefixes a verification attends over: the whole context and its halves down to a
    sixteenth (at least 16 positions). A round reads the shortest that holds its furthest token,
    so attention and the per-layer read of the cache cost what the live contexts hold, not the
    context capacity (each length is a branch compiled into the round)."""
    return tuple(sorted({max(max_len >> i, min(max_len, 16)) for i in range(5)}))


def forward_flat(params, cfg: TargetConfig, cache: KVCache, tokens: jax.Array, rows: jax.Array,
                 positions: jax.Array, valid: jax.Array, grid_index: jax.Array, width: int
                 ) -> TargetOutput:
    """Verification over a flat token batch [F] (F = the bucket size) against per-request caches.

    Linear layers and MLPs run on the F tokens, so cost follows the bucket. Token i belongs to
    request `rows[i]` at `positions[i]`; for attention the queries are scattered to a [R, width]
    grid (`grid_index[i]` = row * width + offset) to read each request's cache, then gathered back;
    they read the shortest of `attention_spans` that holds the furthest position, not the whole
    context (at 32 slots on 2 CPU cores, contexts under 256 of 512 positions: a round without a
    proposal 22.4 -> 15.8 ms, one with 64 verified tokens 58.6 -> 42.0 ms).
    Invalid (padding) tokens are never written to the cache. Returns logits [F, V] and taps [F, m*d].
    """
    if cfg.family == "gemma4":
        from dspark_jax.models import gemma4
        return gemma4.forward_flat(params, cfg, cache, tokens, rows, positions, valid, grid_index, width)
    R, S = cache.k.shape[1], cache.max_len
    x = params["embed"][tokens].astype(param_dtype(cfg))[None]  # [1,F,d]
    write_pos = jnp.where(valid, positions, S)
    grid = jnp.where(valid, grid_index, R * width)  # out of range: dropped
    grid_pos = jnp.full((R * width,), -1, jnp.int32).at[grid].set(positions, mode="drop")
    mask = jnp.arange(S)[None, None, :] <= grid_pos.reshape(R, width)[:, :, None]  # [R,W,S]
    spans = attention_spans(S)
    span = jnp.searchsorted(jnp.asarray(spans), jnp.max(jnp.where(valid, positions, 0)) + 1)

    def attend(q, k, v, kv, layer_id):
        ck = kv[0].at[layer_id, rows, write_pos].set(k[0], mode="drop")
        cv = kv[1].at[layer_id, rows, write_pos].set(v[0], mode="drop")
        n, h = q.shape[2:]
        q_grid = jnp.zeros((R * width, n, h), q.dtype).at[grid].set(q[0], mode="drop")

        def over(length):  # attention over the cache's first `length` positions
            def run(q_grid, ck, cv):
                sub = lambda c: jax.lax.dynamic_slice(  # noqa: E731
                    c, (layer_id, 0, 0, 0, 0), (1, R, length) + c.shape[3:])[0]
                return attention(q_grid.reshape(R, width, n, h), sub(ck), sub(cv),
                                 mask[:, :, :length])
            return run

        out = jax.lax.switch(span, [over(length) for length in spans], q_grid, ck, cv)
        out = out.reshape(R * width, n, h)
        return out[jnp.minimum(grid, R * width - 1)][None], (ck, cv)

    hidden, taps, kv_out = _run_layers(params, cfg, x, positions[None], attend, (cache.k, cache.v))
    return TargetOutput(logits=lm_head(params, cfg, hidden[0]), taps=taps[0], hidden=hidden[0],
                        cache=KVCache(k=kv_out[0], v=kv_out[1]))
