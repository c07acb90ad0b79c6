"""The DSpark drafter (DESIGN §3): KV-injection backbone, sequential (Markov) head, confidence head.

The drafter owns only its own weights; the token embedding and the lm_head are the target's frozen
ones, passed in as `target_params`. Shapes: B batch, N anchored blocks per row, T = block size,
S context length, d width, m tapped layers, r Markov rank, V vocabulary, K KV heads, g query heads
per KV head, h head_dim.

Two paths share every layer function:
- training (`train_forward`): many anchored blocks of one sequence in one pass; block b sees the
  context before its anchor and its own block, never another block;
- inference (`propose`): one block per request against a draft context cache holding the projected,
  normalised and rotated context keys/values of every draft layer.

The target's family (`tcfg.family`) decides what a draft layer is; everything else is shared. On a
Gemma4 target (DeepSpec's `Gemma4DSparkModel`, DESIGN §2b) the block embedding is scaled by
sqrt(d), each layer is a Gemma4 sandwich layer with the target's full-attention geometry (its head
dim, KV heads, partial RoPE, weightless value norm, keys as values when the target does so, score
scale 1) and no sliding window; the final softcap comes with the target's lm_head.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import struct
from jax.sharding import NamedSharding

from dspark_jax.config import DrafterConfig, TargetConfig
from dspark_jax.models import gemma4_layers as g4
from dspark_jax.models.layers import (
    NEG_INF,
    by_temperature,
    first_argmax,
    rms_norm,
    rope,
    sample_inverse_cdf,
    swiglu,
)
from dspark_jax.models.target import attention_spans, lm_head, target_spec
from dspark_jax.params import ArrayInfo
from dspark_jax.sharding import constrain


def layer_config(tcfg: TargetConfig, dcfg: DrafterConfig) -> TargetConfig:
    """The draft layers' shapes: the target's, with `num_draft_layers` layers (on a Gemma4 target
    all of them full-attention layers)."""
    types = ("full_attention",) * dcfg.num_draft_layers if tcfg.layer_types else ()
    return dataclasses.replace(tcfg, num_hidden_layers=dcfg.num_draft_layers, target_layer_ids=(),
                               layer_types=types, dtype="float32")


def is_gemma4(tcfg: TargetConfig) -> bool:
    return tcfg.family == "gemma4"


def layers_spec(tcfg: TargetConfig, dcfg: DrafterConfig) -> dict:
    """ArrayInfo tree of the stacked draft layers (float32 masters)."""
    lcfg = layer_config(tcfg, dcfg)
    if is_gemma4(tcfg):
        return g4.layer_stack_spec(lcfg, dcfg.num_draft_layers, sliding=False, dtype=jnp.float32)
    return target_spec(lcfg)["layers"]


def drafter_spec(tcfg: TargetConfig, dcfg: DrafterConfig) -> dict:
    """ArrayInfo tree of the drafter's own (trainable, float32 master) weights."""
    d, m, r, V = tcfg.hidden_size, tcfg.num_taps, dcfg.markov_rank, tcfg.vocab_size
    f32 = jnp.float32
    spec = {
        "fc": ArrayInfo((m * d, d), f32, ("taps", "embed")),
        "hidden_norm": ArrayInfo((d,), f32, ("norm",), "ones"),
        "layers": layers_spec(tcfg, dcfg),
        "final_norm": ArrayInfo((d,), f32, ("norm",), "ones"),
    }
    if dcfg.has_markov:
        spec["markov_w1"] = ArrayInfo((V, r), f32, ("vocab", "rank"))
        spec["markov_w2"] = ArrayInfo((r, V), f32, ("rank", "vocab"))
        if dcfg.markov_head_type == "gated":
            spec["markov_gate_w"] = ArrayInfo((d + r, r), f32, (None, "rank"))
            spec["markov_gate_b"] = ArrayInfo((r,), f32, ("rank",), "zeros")
        elif dcfg.markov_head_type == "rnn":
            spec["markov_joint_w"] = ArrayInfo((2 * r + d, 3 * r), f32, (None, "rank"))
            spec["markov_joint_b"] = ArrayInfo((3 * r,), f32, ("rank",), "zeros")
    if dcfg.enable_confidence_head:
        width = d + (r if dcfg.conf_uses_markov else 0)
        spec["conf_w"] = ArrayInfo((width,), f32, (None,))
        spec["conf_b"] = ArrayInfo((1,), f32, (None,), "zeros")
    return spec


def cast_compute(dparams, dcfg: DrafterConfig):
    """Weights in the compute dtype; norms stay float32."""
    dt = jnp.dtype(dcfg.dtype)
    return jax.tree_util.tree_map_with_path(
        lambda p, x: x if "norm" in jax.tree_util.keystr(p) else x.astype(dt), dparams)


# ----------------------------------------------------------------------------- backbone


def context_features(dparams, tcfg: TargetConfig, taps_bsm: jax.Array) -> jax.Array:
    """H_ctx = RMSNorm_hidden(W_fc [H(l_1); ...; H(l_m)]): [B, S, m*d] -> [B, S, d]."""
    h = jnp.einsum("bsm,md->bsd", taps_bsm.astype(dparams["fc"].dtype), dparams["fc"])
    return rms_norm(h, dparams["hidden_norm"], tcfg.rms_norm_eps)


def _rope(tcfg: TargetConfig, x_bthd: jax.Array, pos_bt: jax.Array) -> jax.Array:
    """The draft layers' RoPE: the target's (on Gemma4 its full layers', partial)."""
    if is_gemma4(tcfg):
        return g4.layer_rope(tcfg, False, x_bthd, pos_bt)
    return rope(x_bthd, pos_bt, tcfg.rope_theta)


def layer_kv(layer, tcfg: TargetConfig, x_btd: jax.Array, pos_bt: jax.Array):
    """One draft layer's keys (k_norm, then RoPE at `pos_bt`) and values of rows `x_btd`: the
    projected context (no input norm, at its own positions) or the block's normed stream. Gemma4 values are the weightless value norm of the
    value projection, or of the raw key projection when the target takes keys as values."""
    eps = tcfg.rms_norm_eps
    k_raw = jnp.einsum("btd,dkh->btkh", x_btd, layer["wk"])
    k = _rope(tcfg, rms_norm(k_raw, layer["k_norm"], eps), pos_bt)
    if not is_gemma4(tcfg):
        return k, jnp.einsum("btd,dkh->btkh", x_btd, layer["wv"])
    v = k_raw if tcfg.attention_k_eq_v else jnp.einsum("btd,dkh->btkh", x_btd, layer["wv"])
    return k, g4.value_norm(v, eps)


def layer_q(layer, tcfg: TargetConfig, x_btd: jax.Array, pos_bt: jax.Array) -> jax.Array:
    """Queries of the block's normed stream: q_norm, then RoPE."""
    q = rms_norm(jnp.einsum("btd,dnh->btnh", x_btd, layer["wq"]), layer["q_norm"], tcfg.rms_norm_eps)
    return _rope(tcfg, q, pos_bt)


def score_scale(tcfg: TargetConfig) -> float:
    """Attention score scale: 1/sqrt(head_dim), 1 on Gemma4."""
    return 1.0 if is_gemma4(tcfg) else tcfg.full_head_dim ** -0.5


def layer_residual(layer, tcfg: TargetConfig, x_bntd: jax.Array, attn_bntd: jax.Array) -> jax.Array:
    """The stream after one layer, given its projected attention output.

    Qwen3: x + attn, then x + SwiGLU(mlp_norm(x)). Gemma4 (sandwich): x + post_attn_norm(attn),
    then x + post_mlp_norm(GELU-MLP(mlp_norm(x))), the whole stream times `layer_scalar`."""
    B, N, T, d = x_bntd.shape
    eps = tcfg.rms_norm_eps
    flat = lambda a: a.reshape(B, N * T, d)
    if not is_gemma4(tcfg):
        x = x_bntd + attn_bntd
        mlp = swiglu(flat(rms_norm(x, layer["mlp_norm"], eps)), layer["w_gate"], layer["w_up"],
                     layer["w_down"])
        return x + mlp.reshape(B, N, T, d)
    x = x_bntd + rms_norm(attn_bntd, layer["post_attn_norm"], eps)
    mlp = g4.gelu_mlp(flat(rms_norm(x, layer["mlp_norm"], eps)), layer["w_gate"], layer["w_up"],
                      layer["w_down"])
    x = x + rms_norm(mlp.reshape(B, N, T, d), layer["post_mlp_norm"], eps)
    return x * layer["layer_scalar"].astype(x.dtype)


def _block_attention(scale: float, q_bntnh, k_ctx_bskh, v_ctx_bskh, k_blk_bntkh, v_blk_bntkh,
                     ctx_mask_bns):
    """Block queries attend to the visible context and, bidirectionally, to their own block."""
    B, N, T, n, h = q_bntnh.shape
    K = k_ctx_bskh.shape[2]
    q = q_bntnh.reshape(B, N, T, K, n // K, h)
    s_ctx = jnp.einsum("bntkgh,bskh->bnkgts", q, k_ctx_bskh, preferred_element_type=jnp.float32)
    s_ctx = jnp.where(ctx_mask_bns[:, :, None, None, None, :], s_ctx * scale, NEG_INF)
    s_blk = jnp.einsum("bntkgh,bnukh->bnkgtu", q, k_blk_bntkh,
                       preferred_element_type=jnp.float32) * scale
    S = s_ctx.shape[-1]
    probs = jax.nn.softmax(jnp.concatenate([s_ctx, s_blk], axis=-1), axis=-1)
    probs = probs.astype(v_ctx_bskh.dtype)
    out = (jnp.einsum("bnkgts,bskh->bntkgh", probs[..., :S], v_ctx_bskh)
           + jnp.einsum("bnkgtu,bnukh->bntkgh", probs[..., S:], v_blk_bntkh))
    return out.reshape(B, N, T, n, h)


def _chunked_block_attention(chunk: int, scale: float, q, k_ctx, v_ctx, k_blk, v_blk, ctx_mask):
    """_block_attention over groups of `chunk` blocks, one group at a time, each rematerialised in
    the backward pass: the [.., blocks, heads, T, S] scores exist for one group only, which is what
    bounds training memory with hundreds of anchors over long sequences."""
    B, N = q.shape[:2]
    if not chunk or chunk >= N:
        return _block_attention(scale, q, k_ctx, v_ctx, k_blk, v_blk, ctx_mask)
    pad = -N % chunk
    grouped = lambda a: jnp.moveaxis(
        jnp.pad(a, [(0, 0), (0, pad)] + [(0, 0)] * (a.ndim - 2)).reshape(
            B, (N + pad) // chunk, chunk, *a.shape[2:]), 1, 0)
    step = jax.checkpoint(lambda xs: _block_attention(scale, xs[0], k_ctx, v_ctx, xs[1], xs[2], xs[3]))
    out = jax.lax.map(step, (grouped(q), grouped(k_blk), grouped(v_blk), grouped(ctx_mask)))
    return jnp.moveaxis(out, 0, 1).reshape(B, N + pad, *q.shape[2:])[:, :N]


def backbone(dparams, tcfg: TargetConfig, x_bntd: jax.Array, pos_bnt: jax.Array,
             ctx_mask_bns: jax.Array, *, h_ctx: jax.Array | None = None,
             ctx_pos: jax.Array | None = None, cache: "DraftCache | None" = None,
             attention_chunk: int = 0) -> jax.Array:
    """Draft layers + final norm over embedded blocks; context from `h_ctx` (training) or `cache`.
    `attention_chunk` > 0 computes attention that many blocks at a time (training memory)."""
    B, N, T, d = x_bntd.shape
    eps = tcfg.rms_norm_eps
    flat_pos = pos_bnt.reshape(B, N * T)

    def layer_step(x, xs):
        layer, kv = xs
        if kv is None:
            k_ctx, v_ctx = layer_kv(layer, tcfg, h_ctx, ctx_pos)
        else:
            k_ctx, v_ctx = kv
        xn = rms_norm(x.reshape(B, N * T, d), layer["attn_norm"], eps)
        q = layer_q(layer, tcfg, xn, flat_pos)
        k, v = layer_kv(layer, tcfg, xn, flat_pos)
        split = lambda a: a.reshape(B, N, T, *a.shape[2:])
        out = _chunked_block_attention(attention_chunk, score_scale(tcfg), split(q), k_ctx, v_ctx,
                                       split(k), split(v), ctx_mask_bns)
        x = layer_residual(layer, tcfg, x, jnp.einsum("bntqh,qhd->bntd", out, layer["wo"]))
        return x, None

    kv = None if cache is None else (cache.k, cache.v)
    x, _ = jax.lax.scan(layer_step, x_bntd, (dparams["layers"], kv))
    return rms_norm(x, dparams["final_norm"], eps)


def embed_blocks(target_params, tcfg: TargetConfig, anchor_tokens: jax.Array, block_size: int,
                 dtype) -> jax.Array:
    """[anchor, MASK x (T-1)] embedded with the target's frozen embedding (Gemma4: scaled by
    sqrt(d), as the target scales it): [..., T, d]."""
    masks = jnp.full(anchor_tokens.shape + (block_size - 1,), tcfg.mask_token_id, jnp.int32)
    tokens = jnp.concatenate([anchor_tokens[..., None].astype(jnp.int32), masks], axis=-1)
    if is_gemma4(tcfg):
        return g4.scaled_embedding(target_params["embed"], tokens, dtype)
    return target_params["embed"][tokens].astype(dtype)


# ----------------------------------------------------------------------------- heads


def head_init_state(dcfg: DrafterConfig, batch_shape: tuple[int, ...]) -> jax.Array:
    """The rnn head's state (zeros at block start); an empty placeholder for other heads."""
    width = dcfg.markov_rank if dcfg.markov_head_type == "rnn" and dcfg.has_markov else 0
    return jnp.zeros(batch_shape + (width,), jnp.float32)


def head_step(dparams, dcfg: DrafterConfig, h_d: jax.Array, prev: jax.Array, state: jax.Array):
    """One block position: Markov bias [..., V] (or None), confidence logit [...] (or None), state.

    `h_d` is the backbone output at position k, `prev` the token x_{k-1} before it.
    """
    bias, conf = None, None
    e = None
    if dcfg.has_markov:
        e = dparams["markov_w1"][prev].astype(jnp.float32)  # [..., r]
        h32 = h_d.astype(jnp.float32)
        kind = dcfg.markov_head_type
        if kind == "vanilla":
            u = e
        elif kind == "gated":
            gate = jax.nn.sigmoid(jnp.concatenate([h32, e], -1) @ dparams["markov_gate_w"]
                                  + dparams["markov_gate_b"])
            u = gate * e
        else:  # rnn: the output uses the old state; the new one serves the next position
            z = jnp.concatenate([state, e, h32], -1) @ dparams["markov_joint_w"] + dparams["markov_joint_b"]
            g, c, o = jnp.split(z, 3, axis=-1)
            u = jnp.tanh(o)
            state = jax.nn.sigmoid(g) * state + (1 - jax.nn.sigmoid(g)) * jnp.tanh(c)
        bias = u @ dparams["markov_w2"].astype(jnp.float32)
    if dcfg.enable_confidence_head:
        feats = h_d.astype(jnp.float32)
        if dcfg.conf_uses_markov:
            feats = jnp.concatenate([feats, e], -1)
        conf = feats @ dparams["conf_w"] + dparams["conf_b"][0]
    return bias, conf, state


def heads_teacher_forced(dparams, dcfg: DrafterConfig, h_bntd: jax.Array, prev_bnt: jax.Array):
    """Markov bias [B,N,T,V] (None without head) and confidence logits [B,N,T] (None)."""
    B, N, T, _ = h_bntd.shape

    def step(state, xs):
        h, prev = xs
        bias, conf, state = head_step(dparams, dcfg, h, prev, state)
        return state, (bias, conf)

    xs = (jnp.moveaxis(h_bntd, 2, 0), jnp.moveaxis(prev_bnt, 2, 0))
    _, (bias, conf) = jax.lax.scan(step, head_init_state(dcfg, (B, N)), xs)
    bias = None if bias is None else jnp.moveaxis(bias, 0, 2)
    conf = None if conf is None else jnp.moveaxis(conf, 0, 2)
    return bias, conf


# ----------------------------------------------------------------------------- training path


@struct.dataclass
class TrainBlocks:
    logits: jax.Array  # [B,N,T,V] float32 Markov-corrected draft logits
    conf_logits: jax.Array | None  # [B,N,T] pre-sigmoid confidence
    labels: jax.Array  # [B,N,T] ground-truth next tokens
    eval_mask: jax.Array  # [B,N,T] bool prefix-valid supervision
    aligned_index: jax.Array  # [B,N,T] sequence position whose target logits predict the label
    hidden: jax.Array  # [B,N,T,d] backbone output (final-normed), the heads' input


def block_targets(input_ids: jax.Array, loss_mask: jax.Array, anchors: jax.Array,
                  anchor_keep: jax.Array, block_size: int):
    """Labels, prefix-valid eval mask and aligned target positions of anchored blocks.

    Output k of the block at anchor p predicts position p+k+1; it is supervised while that position
    exists and every label up to it is in the loss mask. Dummy anchors supervise nothing.
    """
    L = input_ids.shape[1]
    raw = anchors[..., None] + 1 + jnp.arange(block_size)  # [B,N,T]
    label_index = jnp.where(anchor_keep[..., None], jnp.minimum(raw, L - 1), 0)
    labels = jnp.take_along_axis(input_ids[:, None, :], label_index, axis=2)
    supervised = (raw < L) & jnp.take_along_axis(loss_mask[:, None, :].astype(bool), label_index, 2)
    eval_mask = (jnp.cumprod(supervised.astype(jnp.int32), axis=-1) > 0) & anchor_keep[..., None]
    return labels, eval_mask, jnp.maximum(label_index - 1, 0)


def train_forward(dparams, target_params, tcfg: TargetConfig, dcfg: DrafterConfig,
                  input_ids: jax.Array, loss_mask: jax.Array, taps: jax.Array,
                  anchors: jax.Array, anchor_keep: jax.Array,
                  batch_sharding: NamedSharding | None = None) -> TrainBlocks:
    """All anchored blocks of each sequence in one pass, teacher-forced.

    input_ids/loss_mask [B, L]; taps [B, L, m*d] (target features); anchors/anchor_keep [B, N].
    `batch_sharding`: the blocks' layout on a mesh (rows over the batch axes).
    """
    T = dcfg.block_size
    dp = cast_compute(dparams, dcfg)
    B, L = input_ids.shape
    labels, eval_mask, aligned = block_targets(input_ids, loss_mask, anchors, anchor_keep, T)
    anchor_tokens = jnp.take_along_axis(input_ids, anchors, axis=1)  # [B,N]
    x = constrain(embed_blocks(target_params, tcfg, anchor_tokens, T, jnp.dtype(dcfg.dtype)),
                  batch_sharding)
    pos = anchors[..., None] + jnp.arange(T)
    ctx_pos = jnp.broadcast_to(jnp.arange(L), (B, L))
    ctx_mask = ctx_pos[:, None, :] < anchors[..., None]  # block b sees context before its anchor
    h_ctx = context_features(dp, tcfg, taps)
    h = backbone(dp, tcfg, x, pos, ctx_mask, h_ctx=h_ctx, ctx_pos=ctx_pos,
                 attention_chunk=dcfg.attention_chunk)
    logits = lm_head(target_params, tcfg, h.astype(target_params["embed"].dtype))
    prev = jnp.concatenate([anchor_tokens[..., None], labels[..., :-1]], axis=-1)
    bias, conf = heads_teacher_forced(dparams, dcfg, h, prev)
    if bias is not None:
        logits = logits + bias
    return TrainBlocks(logits=logits, conf_logits=conf, labels=labels, eval_mask=eval_mask,
                       aligned_index=aligned, hidden=h)


# ----------------------------------------------------------------------------- inference path


@struct.dataclass
class DraftCache:
    """Per draft layer, the context keys (normed, rotated) and values; slot s = position s. K and h
    are the draft layers' (on Gemma4 the target's full-attention KV heads and head dim)."""

    k: jax.Array  # [Ld, B, S, K, h]
    v: jax.Array  # [Ld, B, S, K, h]

    @classmethod
    def create(cls, tcfg: TargetConfig, dcfg: DrafterConfig, batch: int, max_len: int) -> "DraftCache":
        shape = (dcfg.num_draft_layers, batch, max_len, tcfg.full_kv_heads, tcfg.full_head_dim)
        zeros = jnp.zeros(shape, jnp.dtype(dcfg.dtype))
        return cls(k=zeros, v=jnp.zeros_like(zeros))  # distinct buffers: both are donated

    def logical_axes(self) -> "DraftCache":
        """The logical axes of each array; a single KV head (a Gemma4 drafter's) is not split over
        tensor devices but held whole by each (`gemma4_layers.kv_heads_axis`)."""
        axes = ("layers", "batch", "cache_seq", g4.kv_heads_axis(self.k.shape[3]), "head_dim")
        return DraftCache(k=axes, v=axes)


def context_kv(dparams, tcfg: TargetConfig, dcfg: DrafterConfig, taps: jax.Array,
               positions: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Every draft layer's keys and values [Ld, B, T, K, h] of new target features [B, T, m*d]
    at `positions` [B, T] (the projected context; `write_context` puts them in the cache)."""
    dp = cast_compute(dparams, dcfg)
    h_ctx = context_features(dp, tcfg, taps)
    return jax.vmap(lambda layer: layer_kv(layer, tcfg, h_ctx, positions))(dp["layers"])


def write_context(cache: DraftCache, k_new: jax.Array, v_new: jax.Array, positions: jax.Array,
                  valid: jax.Array) -> DraftCache:
    """The cache with rows [Ld, B, T, K, h] written at `positions` [B, T] where `valid` (a donated
    cache is written in place)."""
    write = jnp.where(valid, positions, cache.k.shape[2])  # out of range: dropped
    rows = jnp.arange(positions.shape[0])[:, None]
    return DraftCache(k=cache.k.at[:, rows, write].set(k_new.astype(cache.k.dtype), mode="drop"),
                      v=cache.v.at[:, rows, write].set(v_new.astype(cache.v.dtype), mode="drop"))


def extend_context(dparams, tcfg: TargetConfig, dcfg: DrafterConfig, cache: DraftCache,
                   taps: jax.Array, positions: jax.Array, valid: jax.Array) -> DraftCache:
    """Writes the projected context of new target features [B, T, m*d] at `positions` [B, T]."""
    k_new, v_new = context_kv(dparams, tcfg, dcfg, taps, positions)
    return write_context(cache, k_new, v_new, positions, valid)


@struct.dataclass
class Proposal:
    tokens: jax.Array  # [B,T] int32 draft tokens d_1..d_T
    probs: jax.Array  # [B,T,V] float32 distributions the tokens were sampled from (q_k)
    conf_logits: jax.Array  # [B,T] pre-sigmoid confidence (zeros without a confidence head)
    base_logits: jax.Array  # [B,T,V] float32 backbone logits before the Markov head
    hidden: jax.Array  # [B,T,d] backbone output


def draft_distribution(logits: jax.Array, temperature: jax.Array) -> jax.Array:
    """softmax(logits / T) per row; one-hot argmax where T == 0 (greedy)."""
    greedy = temperature <= 0
    safe_t = jnp.where(greedy, 1.0, temperature)[..., None]
    return by_temperature(greedy, lambda: jax.nn.one_hot(first_argmax(logits), logits.shape[-1],
                                                         dtype=jnp.float32),
                          lambda: jax.nn.softmax(logits / safe_t, axis=-1))


def propose(dparams, target_params, tcfg: TargetConfig, dcfg: DrafterConfig, cache: DraftCache,
            anchor: jax.Array, anchor_pos: jax.Array, temperature: jax.Array,
            keys: jax.Array) -> Proposal:
    """One block per request: draft tokens sampled left to right through the Markov head.

    anchor/anchor_pos/temperature/keys [B]: the last committed token, its position (the context
    cache holds positions < anchor_pos), the sampling temperature (0 = greedy) and the request's
    random key for this block.
    """
    T = dcfg.block_size
    dp = cast_compute(dparams, dcfg)
    B = anchor.shape[0]
    S = cache.k.shape[2]
    x = embed_blocks(target_params, tcfg, anchor[:, None], T, jnp.dtype(dcfg.dtype))  # [B,1,T,d]
    pos = anchor_pos[:, None, None] + jnp.arange(T)
    ctx_mask = jnp.arange(S)[None, None, :] < anchor_pos[:, None, None]

    def over(length):  # the block attends to the context cache's first `length` positions
        def run(k, v):
            sub = DraftCache(k=k[:, :, :length], v=v[:, :, :length])
            return backbone(dp, tcfg, x, pos, ctx_mask[..., :length], cache=sub)
        return run

    spans = attention_spans(S)  # the shortest that holds every row's context, as the target's
    which = jnp.searchsorted(jnp.asarray(spans), jnp.max(anchor_pos))
    h = jax.lax.switch(which, [over(length) for length in spans], cache.k, cache.v)[:, 0]  # [B,T,d]
    base = lm_head(target_params, tcfg, h.astype(target_params["embed"].dtype))  # [B,T,V]

    def step(carry, xs):
        prev, state = carry
        h_k, base_k, u_k = xs
        bias, conf, state = head_step(dparams, dcfg, h_k, prev, state)
        logits = base_k if bias is None else base_k + bias
        probs = draft_distribution(logits, temperature)
        token = by_temperature(temperature <= 0, lambda: first_argmax(logits)[:, None],
                               lambda: sample_inverse_cdf(probs, u_k)[:, None])[:, 0]
        token = token.astype(jnp.int32)
        conf = jnp.zeros((B,), jnp.float32) if conf is None else conf
        return (token, state), (token, probs, conf)

    u = jax.vmap(lambda k: jax.random.uniform(k, (T,)))(keys)  # [B, T]: one number per draft
    xs = (jnp.moveaxis(h, 1, 0), jnp.moveaxis(base, 1, 0), u.T)
    init = (anchor.astype(jnp.int32), head_init_state(dcfg, (B,)))
    _, (tokens, probs, conf) = jax.lax.scan(step, init, xs)
    return Proposal(tokens=tokens.T, probs=jnp.moveaxis(probs, 0, 1), conf_logits=conf.T,
                    base_logits=base, hidden=h)
