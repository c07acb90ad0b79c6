"""A constructed target/drafter pair of a chosen size whose acceptance rate is known: what the
scheduling benchmarks measure on hardware where no trained pair of that size exists
(`benchmarks/accelerator_sweep.py`).

The target is a counter: random embedding rows, an output head whose column v is row v - 1's
embedding (scaled), and decoder layers whose output projections are scaled down so that the
residual stream keeps the last token's embedding; it continues a sequence with x + 1 with a chosen
probability at T = 1, the rest spread over the vocabulary by the random inner products. The
drafter's final norm is zeroed, so its backbone's logits vanish and its vanilla Markov head alone
drafts, a low-rank bigram prev -> prev + 1 of the same strength; its confidence head states the
per-draft acceptance the pair has (the overlap Σ min(p, q) of the two distributions, measured on
sampled tokens when the pair is built). Every matrix has its real shape and a round's cost does not
depend on the values, so rounds cost what a trained pair of these shapes costs.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from dspark_jax.config import DrafterConfig, TargetConfig
from dspark_jax.errors import DSparkError
from dspark_jax.models.drafter import drafter_spec
from dspark_jax.models.target import forward, target_spec
from dspark_jax.params import count_params, init_params

PRESETS = {
    # 0.94B parameters: 16 x 50.3M in the layers, 2 x 67.1M in the embedding and the output head.
    "1b": dict(vocab_size=32768, hidden_size=2048, intermediate_size=6144, num_hidden_layers=16,
               num_attention_heads=16, num_key_value_heads=8, head_dim=128, markov_rank=256),
    # For a check on a CPU: the same construction at a size that compiles in seconds.
    "tiny": dict(vocab_size=2048, hidden_size=128, intermediate_size=384, num_hidden_layers=6,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=32, markov_rank=64),
}
LAYER_OUTPUT_SCALE = 1e-3  # the decoder layers' output projections: the residual keeps the embedding
SAMPLE = 256  # tokens the pair's probabilities are measured on when it is built


def _solve_scale(scores, target: float) -> float:
    """The s > 0 at which the softmax of s * scores [n, V] puts mean mass `target` on column 0 of
    each row (the successor, rolled there); bisection on log s (the mass rises with s)."""
    def mass(s):
        z = s * scores
        z = z - z.max(-1, keepdims=True)
        e = np.exp(z)
        return float(np.mean(e[:, 0] / e.sum(-1)))

    lo, hi = 1e-3, 1e3
    for _ in range(60):
        mid = math.sqrt(lo * hi)
        lo, hi = (mid, hi) if mass(mid) < target else (lo, mid)
    return math.sqrt(lo * hi)


def _softmax(z):
    z = z - z.max(-1, keepdims=True)
    e = np.exp(z)
    return e / e.sum(-1, keepdims=True)


def counting_pair(preset: str, acceptance: float, max_len: int, seed: int = 0):
    """(tcfg, target params, dcfg, drafter params, facts): the pair described above, in bfloat16,
    for contexts of `max_len` positions. `facts`: parameter counts and what was measured on
    SAMPLE tokens at T = 1 (the target's and the drafter's mass on the successor, their overlap:
    the per-draft acceptance the confidence head states, and the whole block's τ it implies)."""
    if preset not in PRESETS:
        raise DSparkError(f"preset {preset!r}: expected one of {', '.join(sorted(PRESETS))}")
    if not 0.0 < acceptance < 1.0:
        raise DSparkError(f"acceptance {acceptance}: must lie in (0, 1)")
    shape = dict(PRESETS[preset])
    rank = shape.pop("markov_rank")
    L, d, V = shape["num_hidden_layers"], shape["hidden_size"], shape["vocab_size"]
    tcfg = TargetConfig(**shape, dtype="bfloat16", rope_theta=1_000_000.0,
                        max_position_embeddings=max_len, mask_token_id=V - 1,
                        target_layer_ids=(1, L // 2 - 1, L - 3))
    dcfg = DrafterConfig(num_draft_layers=1, block_size=7, markov_rank=rank, dtype="bfloat16",
                         markov_head_type="vanilla", enable_confidence_head=True,
                         confidence_head_with_markov=True)
    k_target, k_drafter, k_embed, k_markov, k_sample = jax.random.split(jax.random.key(seed), 5)

    tparams = init_params(target_spec(tcfg), k_target)
    embed = jax.random.normal(k_embed, (V, d), jnp.float32)
    tparams["embed"] = embed.astype(jnp.bfloat16)
    layers = dict(tparams["layers"])
    for name in ("wo", "w_down"):
        layers[name] = (layers[name].astype(jnp.float32) * LAYER_OUTPUT_SCALE).astype(jnp.bfloat16)
    tparams["layers"] = layers
    successor = jnp.roll(embed, 1, axis=0).T / d  # column v: row v - 1's embedding
    x = np.asarray(jax.random.randint(k_sample, (SAMPLE,), 0, V))
    tparams["lm_head"] = successor.astype(jnp.bfloat16)
    fwd = jax.jit(lambda p, t: forward(p, tcfg, t, jnp.zeros_like(t)).logits[:, -1])
    unit = np.asarray(fwd(tparams, jnp.asarray(x[:, None], jnp.int32)), np.float64)  # [n, V]
    rolled = lambda a: np.stack([np.roll(row, -(int(t) + 1)) for row, t in zip(a, x)])  # noqa: E731
    s = _solve_scale(rolled(unit), acceptance)
    tparams["lm_head"] = (successor * s).astype(jnp.bfloat16)
    p = _softmax(np.asarray(fwd(tparams, jnp.asarray(x[:, None], jnp.int32)), np.float64))

    dparams = init_params(drafter_spec(tcfg, dcfg), k_drafter)
    codes = jax.random.normal(k_markov, (V, rank), jnp.float32)
    dparams["final_norm"] = jnp.zeros_like(dparams["final_norm"])
    dparams["markov_w1"] = codes
    unit_bias = np.asarray(codes[x] @ (jnp.roll(codes, 1, axis=0).T / rank), np.float64)
    beta = _solve_scale(rolled(unit_bias), acceptance)
    dparams["markov_w2"] = jnp.roll(codes, 1, axis=0).T * (beta / rank)
    q = _softmax(beta * unit_bias)
    overlap = float(np.mean(np.minimum(p, q).sum(-1)))
    dparams["conf_w"] = jnp.zeros_like(dparams["conf_w"])
    dparams["conf_b"] = jnp.full_like(dparams["conf_b"], math.log(overlap / (1 - overlap)))
    dparams = jax.tree_util.tree_map_with_path(  # bfloat16 weights, float32 norms, as loaded
        lambda path, a: a if "norm" in jax.tree_util.keystr(path) else a.astype(jnp.bfloat16), dparams)
    rows = np.arange(SAMPLE)
    facts = {"target_params": count_params(tparams), "drafter_params": count_params(dparams),
             "target_successor_mass": float(np.mean(p[rows, (x + 1) % V])),
             "drafter_successor_mass": float(np.mean(q[rows, (x + 1) % V])),
             "acceptance_per_draft": overlap,
             "tau_whole_block": (1 - overlap ** (dcfg.block_size + 1)) / (1 - overlap)}
    return tcfg, tparams, dcfg, dparams, facts
