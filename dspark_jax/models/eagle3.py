"""The Eagle3 baseline drafter (DESIGN §3b) as pure functions: test-time training and a greedy chain.

One decoder layer reads [input_layernorm(embedding of a token); hidden_norm(incoming hidden)], 2d wide,
for its q/k/v; the attention output is added to the un-normed incoming hidden state, then the usual
MLP block. The layer output is the next hidden state; logits are the target's frozen lm_head applied
to its final-normed value. The incoming hidden state is fc(target features) for a committed position
(no norm before fc), the drafter's own previous output inside a chain. The embedding and lm_head are
the target's, passed in as `target_params`.

Shapes: B batch, S sequence, K TTT steps (`ttt_length`), d width, m tapped layers, V vocabulary,
n query heads, k KV heads, g query heads per KV head, h head_dim, J later TTT steps (K - 1).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import struct

from dspark_jax.config import Eagle3Config, TargetConfig
from dspark_jax.models.drafter import cast_compute, draft_distribution
from dspark_jax.models.layers import (
    NEG_INF,
    attention,
    first_argmax,
    project_qkv,
    rms_norm,
    rope,
    sample_inverse_cdf,
    swiglu,
)
from dspark_jax.models.target import lm_head, target_spec
from dspark_jax.params import ArrayInfo


def layer_config(tcfg: TargetConfig, ecfg: Eagle3Config) -> TargetConfig:
    """The draft layer's shapes: the target's, with `num_draft_layers` layers."""
    return dataclasses.replace(tcfg, num_hidden_layers=ecfg.num_draft_layers, target_layer_ids=(),
                               dtype="float32")


def eagle3_spec(tcfg: TargetConfig, ecfg: Eagle3Config) -> dict:
    """ArrayInfo tree of the drafter's own (float32 master) weights; embedding and head are shared."""
    d, m, L = tcfg.hidden_size, tcfg.num_taps, ecfg.num_draft_layers
    n, k, h = tcfg.num_attention_heads, tcfg.num_key_value_heads, tcfg.head_dim
    f32 = jnp.float32
    layers = dict(target_spec(layer_config(tcfg, ecfg))["layers"])
    # q/k/v read [embedding; hidden], twice the model width.
    layers["wq"] = ArrayInfo((L, 2 * d, n, h), f32, ("layers", "embed", "heads", "head_dim"))
    layers["wk"] = ArrayInfo((L, 2 * d, k, h), f32, ("layers", "embed", "kv_heads", "head_dim"))
    layers["wv"] = ArrayInfo((L, 2 * d, k, h), f32, ("layers", "embed", "kv_heads", "head_dim"))
    layers["hidden_norm"] = ArrayInfo((L, d), f32, ("layers", "norm"), "ones")
    return {
        "fc": ArrayInfo((m * d, d), f32, ("taps", "embed")),
        "layers": layers,
        "final_norm": ArrayInfo((d,), f32, ("norm",), "ones"),
    }


# ----------------------------------------------------------------------------- the layer


def project_features(dparams, taps_bsm: jax.Array) -> jax.Array:
    """fc(target features) [B, S, m*d] -> [B, S, d] (no norm: hidden_norm is inside the layer)."""
    return jnp.einsum("bsm,md->bsd", taps_bsm.astype(dparams["fc"].dtype), dparams["fc"])


def _only_layer(dparams):
    return jax.tree.map(lambda x: x[0], dparams["layers"])


def layer_qkv(layer, tcfg: TargetConfig, emb_btd: jax.Array, h_btd: jax.Array, pos_bt: jax.Array):
    """Rotated q [B,T,n,h], rotated k and v [B,T,k,h] from [input_layernorm(emb); hidden_norm(h)]."""
    eps = tcfg.rms_norm_eps
    x = jnp.concatenate([rms_norm(emb_btd, layer["attn_norm"], eps),
                         rms_norm(h_btd, layer["hidden_norm"], eps)], axis=-1)  # [B,T,2d]
    q, k, v = project_qkv(x, layer, eps)
    return rope(q, pos_bt, tcfg.rope_theta), rope(k, pos_bt, tcfg.rope_theta), v


def layer_output(layer, tcfg: TargetConfig, h_btd: jax.Array, attn_btnh: jax.Array) -> jax.Array:
    """The next hidden state: h + o(attn), then the post-attention-normed SwiGLU residual."""
    x = h_btd + jnp.einsum("btnh,nhd->btd", attn_btnh, layer["wo"])
    return x + swiglu(rms_norm(x, layer["mlp_norm"], tcfg.rms_norm_eps), layer["w_gate"],
                      layer["w_up"], layer["w_down"])


def draft_logits(dparams, target_params, tcfg: TargetConfig, h: jax.Array) -> jax.Array:
    """float32 logits [..., V] = lm_head(final_norm(h))."""
    normed = rms_norm(h, dparams["final_norm"], tcfg.rms_norm_eps)
    return lm_head(target_params, tcfg, normed.astype(target_params["embed"].dtype))


# ----------------------------------------------------------------------------- training (TTT)


def ttt_step_tokens(input_ids: jax.Array, ttt_length: int) -> jax.Array:
    """[B, K, S]: the token fed at step k, position t: input_ids[t+1+k], 0 past the end."""
    S = input_ids.shape[1]
    index = jnp.arange(S)[None, :] + 1 + jnp.arange(ttt_length)[:, None]  # [K,S]
    tokens = jnp.take(input_ids, jnp.minimum(index, S - 1), axis=1)  # [B,K,S]
    return jnp.where(index < S, tokens, 0).astype(jnp.int32)


def ttt_positions(seq_len: int, ttt_length: int) -> jax.Array:
    """[K, S]: RoPE position t + k of step k, position t."""
    return jnp.arange(seq_len)[None, :] + jnp.arange(ttt_length)[:, None]


def _ttt_attention(q_bsnh, k0_bukh, v0_bukh, kd_jbskh, vd_jbskh, step, q_valid_bs):
    """Attention of TTT step `step`: a query at position t sees the step-0 keys of positions 0..t and,
    of each later step 1..step, only the key of its own position t (slot j-1 of the `kd`/`vd`
    buffers holds step j). Invalid queries see nothing: their output is zero."""
    B, S, n, h = q_bsnh.shape
    kv, J = k0_bukh.shape[2], kd_jbskh.shape[0]
    q = q_bsnh.reshape(B, S, kv, n // kv, h)
    scale = h ** -0.5
    s0 = jnp.einsum("bskgh,bukh->bkgsu", q, k0_bukh, preferred_element_type=jnp.float32) * scale
    causal_su = jnp.arange(S)[None, :] <= jnp.arange(S)[:, None]
    visible0_bsu = causal_su[None] & q_valid_bs[:, :, None]
    s0 = jnp.where(visible0_bsu[:, None, None], s0, NEG_INF)
    sd = jnp.einsum("bskgh,jbskh->bkgsj", q, kd_jbskh, preferred_element_type=jnp.float32) * scale
    visible_d_bsj = (jnp.arange(J) < step)[None, None, :] & q_valid_bs[:, :, None]
    sd = jnp.where(visible_d_bsj[:, None, None], sd, NEG_INF)
    probs = jax.nn.softmax(jnp.concatenate([s0, sd], axis=-1), axis=-1)
    probs = jnp.where(q_valid_bs[:, None, None, :, None], probs, 0.0).astype(v0_bukh.dtype)
    out = (jnp.einsum("bkgsu,bukh->bskgh", probs[..., :S], v0_bukh)
           + jnp.einsum("bkgsj,jbskh->bskgh", probs[..., S:], vd_jbskh))
    return out.reshape(B, S, n, h)


@struct.dataclass
class TTTOutput:
    logits: jax.Array  # [B,K,S,V] float32 draft logits of every step
    hidden: jax.Array  # [B,K,S,d] layer output of every step: behind its logits, fed to step k+1


def ttt_hidden(dparams, target_params, tcfg: TargetConfig, ecfg: Eagle3Config,
               input_ids: jax.Array, attention_mask: jax.Array, taps: jax.Array) -> jax.Array:
    """[B, K, S, d]: the layer output of K = ttt_length unrolled steps over every position at once,
    teacher-forced.

    input_ids/attention_mask [B, S] (right-padded: the valid length is the mask's sum); taps
    [B, S, m*d] (target features). At step k position t is fed token t+1+k with its own step k-1
    output (fc(features) at k = 0), at RoPE position t+k; keys of every step are kept (see
    `_ttt_attention`); queries with t >= valid length - k see nothing.
    """
    K = ecfg.ttt_length
    dt = jnp.dtype(ecfg.dtype)
    dp = cast_compute(dparams, ecfg)
    layer = _only_layer(dp)
    B, S = input_ids.shape
    valid_len = jnp.sum(attention_mask.astype(jnp.int32), axis=-1)  # [B]
    t = jnp.arange(S)
    emb_kbsd = jnp.moveaxis(target_params["embed"][ttt_step_tokens(input_ids, K)].astype(dt), 1, 0)
    pos_ks = ttt_positions(S, K)
    q_valid = lambda step: t[None, :] < (valid_len[:, None] - step)  # [B,S]

    h0 = project_features(dp, taps).astype(dt)
    pos0 = jnp.broadcast_to(pos_ks[0], (B, S))
    q, k0, v0 = layer_qkv(layer, tcfg, emb_kbsd[0], h0, pos0)
    J = max(K - 1, 1)  # slot j-1 holds step j (one never-visible slot when K = 1)
    kd = jnp.zeros((J,) + k0.shape, k0.dtype)
    vd = jnp.zeros((J,) + v0.shape, v0.dtype)
    h1 = layer_output(layer, tcfg, h0, _ttt_attention(q, k0, v0, kd, vd, 0, q_valid(0)))

    def step_fn(carry, xs):
        h, kd, vd = carry
        step, emb, pos = xs
        q, k, v = layer_qkv(layer, tcfg, emb, h, jnp.broadcast_to(pos, (B, S)))
        kd = jax.lax.dynamic_update_index_in_dim(kd, k, step - 1, 0)
        vd = jax.lax.dynamic_update_index_in_dim(vd, v, step - 1, 0)
        out = layer_output(layer, tcfg, h, _ttt_attention(q, k0, v0, kd, vd, step, q_valid(step)))
        return (out, kd, vd), out

    # Rematerialised in the backward pass: otherwise every step keeps its [B, n, S, S] attention
    # probabilities for the gradient (gigabytes per sequence at S = 4096).
    _, h_out = jax.lax.scan(jax.checkpoint(step_fn), (h1, kd, vd),
                            (jnp.arange(1, K), emb_kbsd[1:], pos_ks[1:]))
    hidden = jnp.concatenate([h1[None], h_out], axis=0)  # [K,B,S,d]
    return jnp.moveaxis(hidden, 0, 1)


def ttt_forward(dparams, target_params, tcfg: TargetConfig, ecfg: Eagle3Config,
                input_ids: jax.Array, attention_mask: jax.Array, taps: jax.Array) -> TTTOutput:
    """`ttt_hidden` and the logits of every step: [B, K, S, V] (training computes them one step at
    a time instead, `training.eagle3_loss.eagle3_train_loss`)."""
    hidden = ttt_hidden(dparams, target_params, tcfg, ecfg, input_ids, attention_mask, taps)
    logits = draft_logits(cast_compute(dparams, ecfg), target_params, tcfg, hidden)
    return TTTOutput(logits=logits, hidden=hidden)


# ----------------------------------------------------------------------------- inference (chain)


@struct.dataclass
class Eagle3Cache:
    """The draft layer's keys (normed, rotated) and values; slot s holds the row at position s."""

    k: jax.Array  # [B, S, k, h]
    v: jax.Array  # [B, S, k, h]

    @classmethod
    def create(cls, tcfg: TargetConfig, ecfg: Eagle3Config, batch: int, max_len: int) -> "Eagle3Cache":
        shape = (batch, max_len, tcfg.num_key_value_heads, tcfg.head_dim)
        zeros = jnp.zeros(shape, jnp.dtype(ecfg.dtype))
        return cls(k=zeros, v=jnp.zeros_like(zeros))  # distinct buffers: both are donated


def _run_rows(dp, target_params, tcfg: TargetConfig, cache: Eagle3Cache, tokens: jax.Array,
              h_btd: jax.Array, positions: jax.Array, valid: jax.Array):
    """Rows (token, incoming hidden) [B, T] at `positions` through the layer against the cache: their
    keys/values are written at their positions (invalid rows are not), each row sees the slots at or
    before its position. Returns (cache, layer outputs [B, T, d]). `dp` is in the compute dtype."""
    layer = _only_layer(dp)
    emb = target_params["embed"][tokens].astype(h_btd.dtype)
    q, k, v = layer_qkv(layer, tcfg, emb, h_btd, positions)
    S = cache.k.shape[1]
    write = jnp.where(valid, positions, S)  # out of range: dropped
    rows = jnp.arange(tokens.shape[0])[:, None]
    ck = cache.k.at[rows, write].set(k.astype(cache.k.dtype), mode="drop")
    cv = cache.v.at[rows, write].set(v.astype(cache.v.dtype), mode="drop")
    mask = jnp.arange(S)[None, None, :] <= positions[:, :, None]
    out = attention(q, ck.astype(q.dtype), cv.astype(q.dtype), mask)
    return Eagle3Cache(k=ck, v=cv), layer_output(layer, tcfg, h_btd, out)


def extend_context(dparams, target_params, tcfg: TargetConfig, ecfg: Eagle3Config,
                   cache: Eagle3Cache, tokens: jax.Array, taps: jax.Array, positions: jax.Array,
                   valid: jax.Array):
    """Committed rows: token p+1 paired with the target features of position p [B, T, m*d], at
    position p. Prefill is the prompt shifted by one (then the anchor) with the prompt's features;
    after verification, the committed tokens with the features of the verified rows. Slots past the
    new rows are stale but never read: a later row writes its own slot before reading it.
    Returns (cache, layer outputs [B, T, d]): the last valid row's output starts the next chain."""
    dp = cast_compute(dparams, ecfg)
    h = project_features(dp, taps).astype(jnp.dtype(ecfg.dtype))
    return _run_rows(dp, target_params, tcfg, cache, tokens, h, positions, valid)


@struct.dataclass
class Eagle3Proposal:
    tokens: jax.Array  # [B,K] int32 draft tokens
    probs: jax.Array  # [B,K,V] float32 distributions the tokens were drawn from
    logits: jax.Array  # [B,K,V] float32 draft logits
    hidden: jax.Array  # [B,K,d] hidden state behind each logits row
    cache: Eagle3Cache  # with the chain's rows at positions + 1 .. + K


def propose(dparams, target_params, tcfg: TargetConfig, ecfg: Eagle3Config, cache: Eagle3Cache,
            hidden: jax.Array, position: jax.Array, temperature: jax.Array,
            keys: jax.Array) -> Eagle3Proposal:
    """A chain of K = ttt_length drafts per request.

    hidden/position [B, d]/[B]: the layer output of the last committed row and its position;
    temperature/keys [B]: sampling temperature (0 = greedy) and the request's key for this chain.
    Each step drafts a token from lm_head(final_norm(h)), then runs that token with h as one row
    at the next position; its output is the next h.
    """
    K = ecfg.ttt_length
    dp = cast_compute(dparams, ecfg)
    B = hidden.shape[0]

    def step(carry, u_b):
        h, pos, cache = carry
        logits = draft_logits(dp, target_params, tcfg, h)  # [B,V]
        probs = draft_distribution(logits, temperature)
        sampled = sample_inverse_cdf(probs, u_b)
        token = jnp.where(temperature <= 0, first_argmax(logits), sampled).astype(jnp.int32)
        cache, out = _run_rows(dp, target_params, tcfg, cache, token[:, None], h[:, None],
                               (pos + 1)[:, None], jnp.ones((B, 1), bool))
        return (out[:, 0], pos + 1, cache), (token, probs, logits, h)

    u = jax.vmap(lambda k: jax.random.uniform(k, (K,)))(keys)  # [B, K]: one number per draft
    init = (hidden.astype(jnp.dtype(ecfg.dtype)), position.astype(jnp.int32), cache)
    (_, _, cache), (tokens, probs, logits, hs) = jax.lax.scan(step, init, u.T)
    swap = lambda a: jnp.moveaxis(a, 0, 1)
    return Eagle3Proposal(tokens=swap(tokens), probs=swap(probs), logits=swap(logits),
                          hidden=swap(hs), cache=cache)
