"""Parity of the JAX Qwen3 target with transformers (torch CPU, float32) on tiny random models."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

from dspark_jax.formats import hf_checkpoint
from dspark_jax.models.target import KVCache, forward

# (name, checkpoint kwargs): GQA ratios 1, 2, 4; tied and untied; head_dim != hidden / heads.
CASES = [
    ("mha_tied", dict(seed=0, heads=4, kv_heads=4, head_dim=8, tied=True)),
    ("gqa2_untied", dict(seed=1, heads=4, kv_heads=2, head_dim=12, tied=False)),
    ("gqa4_untied", dict(seed=2, heads=8, kv_heads=2, head_dim=6, tied=False, hidden=40)),
]
TAPS = [-1, 0, 1]  # embedding output and two decoder layers (3 layers; the last is not allowed)


def torch_forward(directory, ids: np.ndarray):
    model = transformers.Qwen3ForCausalLM.from_pretrained(
        directory, dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():
        out = model(torch.from_numpy(ids).long(), output_hidden_states=True)
    return out.logits.numpy(), [h.numpy() for h in out.hidden_states]


@pytest.fixture(scope="module", params=CASES, ids=[c[0] for c in CASES])
def case(request, hf_models):
    directory = hf_models(**request.param[1])
    cfg, params = hf_checkpoint.load_target(directory, target_layer_ids=TAPS)
    rng = np.random.default_rng(request.param[1]["seed"])
    ids = rng.integers(0, cfg.vocab_size, size=(2, 11))
    logits, hidden = torch_forward(directory, ids)
    return directory, cfg, params, ids, logits, hidden


def full_forward(params, cfg, ids, **kw):
    pos = jnp.broadcast_to(jnp.arange(ids.shape[1]), ids.shape)
    return jax.jit(forward, static_argnums=1, static_argnames="compute_logits")(
        params, cfg, jnp.asarray(ids), pos, **kw)


def test_full_sequence_logits_and_taps(case):
    _, cfg, params, ids, ref_logits, ref_hidden = case
    out = full_forward(params, cfg, ids)
    np.testing.assert_allclose(out.logits, ref_logits, atol=1e-4, rtol=0)
    d = cfg.hidden_size
    for slot, layer_id in enumerate(TAPS):
        np.testing.assert_allclose(out.taps[..., slot * d:(slot + 1) * d],
                                   ref_hidden[layer_id + 1], atol=1e-4, rtol=0)
    # HF's last hidden state is post-norm: ours is the lm_head input.
    np.testing.assert_allclose(out.hidden, ref_hidden[-1], atol=1e-4, rtol=0)


def test_selected_logits(case):
    _, cfg, params, ids, ref_logits, _ = case
    index = jnp.asarray([[0, 5, 10], [3, 3, 7]])
    out = full_forward(params, cfg, ids, logit_index=index)
    np.testing.assert_allclose(out.logits, np.take_along_axis(ref_logits, np.asarray(index)[..., None], 1),
                               atol=1e-4, rtol=0)


def test_cache_prefill_then_extend_equals_full(case):
    """Ragged prefill (padding never written), then 1-token and 3-token extensions per request."""
    _, cfg, params, ids, ref_logits, _ = case
    step = jax.jit(forward, static_argnums=1, static_argnames="compute_logits")
    B, T = ids.shape
    cache = KVCache.create(cfg, B, 16)
    # Request 0 prefills 4 tokens, request 1 prefills 6; both padded to 6.
    lengths = np.array([4, 6])
    pos = np.broadcast_to(np.arange(6), (B, 6))
    valid = pos < lengths[:, None]
    # Poison the padding tokens: if they were written to the cache the logits would differ.
    tokens = np.where(valid, ids[:, :6], cfg.vocab_size - 1)
    out = step(params, cfg, jnp.asarray(tokens), jnp.asarray(pos), cache=cache, valid=jnp.asarray(valid))
    cache = out.cache
    got = {0: [out.logits[0, :4]], 1: [out.logits[1, :6]]}
    n = lengths.copy()
    for width in (1, 3, 1):
        pos = n[:, None] + np.arange(width)
        toks = np.take_along_axis(ids, np.minimum(pos, T - 1), 1)
        valid = pos < T
        out = step(params, cfg, jnp.asarray(toks), jnp.asarray(pos), cache=cache,
                   valid=jnp.asarray(valid))
        cache = out.cache
        for r in range(B):
            got[r].append(out.logits[r, : int(valid[r].sum())])
        n = np.minimum(n + width, T)
    for r in range(B):
        seen = np.concatenate(got[r])
        np.testing.assert_allclose(seen, ref_logits[r, : len(seen)], atol=1e-4, rtol=0)
    # Slots at or beyond the last written position stay untouched (zeros).
    assert not np.asarray(cache.k[:, :, T:]).any()


def test_attention_reads_only_the_span_that_holds_the_tokens(case):
    """A prefill attends over its prompt bucket and a flat verification over the shortest of
    `attention_spans` that holds its furthest token (here 64 of 128 positions, then 16): the logits
    are transformers' all the same."""
    from dspark_jax.models.target import attention_spans, forward_flat

    directory, cfg, params = case[:3]
    assert attention_spans(128) == (16, 32, 64, 128) and attention_spans(8) == (8,)
    assert attention_spans(512) == (32, 64, 128, 256, 512)
    ids = np.random.default_rng(5).integers(0, cfg.vocab_size, size=(2, 40))
    ref, _ = torch_forward(directory, ids)
    lengths = np.array([10, 37])
    pos = np.broadcast_to(np.arange(37), (2, 37))
    valid = pos < lengths[:, None]
    prefill = jax.jit(forward, static_argnums=1, static_argnames=("compute_logits", "span"))
    out = prefill(params, cfg, jnp.asarray(np.where(valid, ids[:, :37], 0)), jnp.asarray(pos),
                  cache=KVCache.create(cfg, 2, 128), valid=jnp.asarray(valid), span=37)
    np.testing.assert_allclose(out.logits[1], ref[1, :37], atol=1e-4, rtol=0)
    np.testing.assert_allclose(out.logits[0, :10], ref[0, :10], atol=1e-4, rtol=0)
    flat = jax.jit(forward_flat, static_argnums=(1, 8))
    W = 4
    rows, offsets = np.array([0, 0, 0, 1, 1]), np.array([0, 1, 2, 0, 1])  # positions up to 38: 64
    positions = lengths[rows] + offsets
    out = flat(params, cfg, out.cache, jnp.asarray(ids[rows, positions]), jnp.asarray(rows),
               jnp.asarray(positions), jnp.ones(5, bool), jnp.asarray(rows * W + offsets), W)
    np.testing.assert_allclose(out.logits, ref[rows, positions], atol=1e-4, rtol=0)
    one = np.array([0])  # row 0 alone at position 13: 16 positions
    out = flat(params, cfg, out.cache, jnp.asarray(ids[0, 13:14]), jnp.asarray(one),
               jnp.asarray([13]), jnp.ones(1, bool), jnp.asarray(one), W)
    np.testing.assert_allclose(out.logits, ref[0, 13:14], atol=1e-4, rtol=0)


def test_export_reload_in_transformers(case, tmp_path):
    directory, cfg, params, ids, ref_logits, _ = case
    out_dir = hf_checkpoint.save_target(params, cfg, tmp_path / "export",
                                        max_shard_bytes=20_000)
    assert (out_dir / "model.safetensors.index.json").is_file()  # several shards
    logits, _ = torch_forward(out_dir, ids)
    np.testing.assert_array_equal(logits, ref_logits)
    _, params2 = hf_checkpoint.load_target(out_dir, target_layer_ids=TAPS)
    jax.tree.map(np.testing.assert_array_equal, params, params2)


def test_bfloat16_within_tolerance(case):
    """bf16 weights and activations (float32 norms and softmax) against the float32 torch logits.
    Stated tolerance: max-abs error below 5 % of max(1, largest |logit|) (bf16 keeps 8 mantissa
    bits; these random models have logits up to ~5)."""
    directory, cfg, _, ids, ref_logits, _ = case
    cfg16, params16 = hf_checkpoint.load_target(directory, target_layer_ids=TAPS, dtype="bfloat16")
    assert params16["layers"]["wq"].dtype == jnp.bfloat16
    assert params16["layers"]["attn_norm"].dtype == jnp.float32
    out = full_forward(params16, cfg16, ids)
    assert out.logits.dtype == jnp.float32
    err = float(np.max(np.abs(np.asarray(out.logits) - ref_logits)))
    assert err < 5e-2 * max(1.0, float(np.abs(ref_logits).max())), err
