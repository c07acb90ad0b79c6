"""Lossless speculative sampling (DESIGN §4, "Lossless means"), tested statistically at T > 0.

1. `accept` alone, exactly and by Monte Carlo: greedy (one-hot) verification accepts exactly the
   matching prefix; at T > 0 the i-th committed token (given that the i drafts before it were
   accepted) is distributed as the target's p_i, for every verified length ℓ.
2. The real engine: a tiny random target with V = 8 and a random drafter. The joint distribution of
   the first three generated tokens after a fixed prompt (token 1 from prefill, tokens 2..3 from
   speculative rounds) is compared, by a Pearson chi-square test over the 512 cells, with the exact
   target distribution P(t1) P(t2|t1) P(t3|t1,t2) computed from full-sequence `forward` in float64.
3. Negative controls: the same procedure with deliberately broken acceptance rules injected into the
   engine must fail the test by a wide margin, so the test above has the power to catch them.

Significance: a correct implementation passes when p > 1e-3 (a false alarm has probability 1e-3 per
test; everything is seeded, so the outcome is deterministic for a given jax version); the broken
rules must give p < 1e-6.

Compile cost dominates this module (each engine compiles one program per prefill batch bucket and per
verification bucket, a few seconds each on CPU), so one engine per scheduler is shared across
temperatures (temperature is a per-request array), and the two broken-rule engines use a smaller
slot count (fewer buckets; the rules act per row, so the slot count does not change what they do).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from dspark_jax.config import DrafterConfig, TargetConfig
from dspark_jax.decoding import profile
from dspark_jax.decoding.acceptance import Acceptance, accept, split_rows
from dspark_jax.decoding.engine import Engine, Request
from dspark_jax.decoding.sampling import sample
from dspark_jax.decoding.schedulers import SchedulerConfig
from dspark_jax.models.drafter import drafter_spec
from dspark_jax.models.target import forward, target_spec
from dspark_jax.params import init_params

PASS_P = 1e-3  # a correct implementation must give p > PASS_P
FAIL_P = 1e-6  # a broken rule must give p < FAIL_P

# ----------------------------------------------------------------------------- chi-square


def chi_square_p(counts: np.ndarray, probs: np.ndarray, min_expected: float = 5.0):
    """Pearson goodness-of-fit p-value of `counts` against `probs` (cells with expected count below
    `min_expected` are merged into one bin; that bin is dropped if it is still below it)."""
    counts = np.asarray(counts, np.float64).ravel()
    probs = np.asarray(probs, np.float64).ravel()
    n = counts.sum()
    assert n > 0 and abs(probs.sum() - 1.0) < 1e-9, (n, probs.sum())
    expected = n * probs
    small = expected < min_expected
    obs = list(counts[~small])
    exp = list(expected[~small])
    if small.any():
        obs.append(counts[small].sum())
        exp.append(expected[small].sum())
        if exp[-1] < min_expected:  # the merged bin is itself tiny: merge it into the smallest
            o, e = obs.pop(), exp.pop()
            j = int(np.argmin(exp))
            obs[j] += o
            exp[j] += e
    obs, exp = np.asarray(obs), np.asarray(exp)
    assert len(obs) >= 2
    stat = float(np.sum((obs - exp) ** 2 / exp))
    return float(stats.chi2.sf(stat, len(obs) - 1)), stat, len(obs)


def test_chi_square_helper():
    rng = np.random.default_rng(0)
    p = rng.dirichlet(np.ones(20) * 0.3)
    ok = rng.multinomial(20_000, p)
    assert chi_square_p(ok, p)[0] > PASS_P
    q = 0.9 * p + 0.1 / 20
    assert chi_square_p(rng.multinomial(20_000, q), p)[0] < FAIL_P


# ----------------------------------------------------------------------------- accept alone

V_UNIT, GAMMA_UNIT, R_UNIT = 5, 3, 200_000


def _unit_dists(kind: str):
    """(p [γ+1, V], q [γ, V]) float32 for the unit tests."""
    rng = np.random.default_rng({"dense": 1, "sparse": 2}[kind])
    p = rng.dirichlet(np.ones(V_UNIT) * 0.7, size=GAMMA_UNIT + 1)
    q = rng.dirichlet(np.ones(V_UNIT) * 0.7, size=GAMMA_UNIT)
    if kind == "sparse":
        # Exact zeros (as top-k / top-p produce): drafts the target can never emit, target tokens
        # the drafter never proposes, and one position where q equals p (no residual mass).
        p[0, 4] = 0.0
        q[0, 0] = 0.0
        p[1, 2] = 0.0
        p = p / p.sum(-1, keepdims=True)
        q = q / q.sum(-1, keepdims=True)
        q[2] = p[2]
    return p.astype(np.float32), q.astype(np.float32)


@functools.partial(jax.jit, static_argnums=(0, 5))
def _run_rule(rule, key, p, q, ell, R):
    """R independent rounds: drafts d_j ~ q_j (the drafter's q here does not depend on earlier
    drafts), then the acceptance `rule` with verified length ell; returns (drafts, k, next)."""
    k_draft, k_acc = jax.random.split(key)
    logq = jnp.where(q > 0, jnp.log(jnp.where(q > 0, q, 1.0)), -jnp.inf)
    drafts = jax.random.categorical(k_draft, logq, axis=-1, shape=(R, q.shape[0])).astype(jnp.int32)
    out = rule(jax.random.split(k_acc, R), drafts, jnp.broadcast_to(q, (R,) + q.shape),
               jnp.broadcast_to(p, (R,) + p.shape), jnp.full((R,), ell, jnp.int32))
    return drafts, out.num_accepted, out.next_token


def committed_token_p_values(rule, p, q, ell, seed):
    """For i = 0..ℓ: chi-square p-value of the i-th committed token over the rounds with k >= i
    (d_{i+1} if accepted, else the residual / bonus token) against the target's p_i."""
    drafts, k, nxt = jax.device_get(_run_rule(rule, jax.random.key(seed), p, q, ell, R_UNIT))
    assert k.min() >= 0 and k.max() <= ell
    committed = np.concatenate([drafts, np.zeros((R_UNIT, 1), np.int32)], 1)
    committed[np.arange(R_UNIT), k] = nxt  # row r: d_1..d_k, next
    out = []
    for i in range(ell + 1):
        tok = committed[k >= i, i]
        assert not np.any(p[i][tok] == 0), "emitted a token the target gives probability 0"
        p_i = p[i].astype(np.float64)
        out.append(chi_square_p(np.bincount(tok, minlength=V_UNIT), p_i / p_i.sum())[0])
    return out


@pytest.mark.parametrize("kind", ["dense", "sparse"])
def test_accept_committed_tokens_follow_target(kind):
    """For every ℓ: the first committed token ~ p_0; more generally, among rounds with k >= i the
    i-th committed token (d_{i+1} if accepted, else the residual / bonus token) ~ p_i (p > 1e-3)."""
    p, q = _unit_dists(kind)
    for ell in range(GAMMA_UNIT + 1):
        pvs = committed_token_p_values(accept, p, q, ell, seed=100 + ell)
        assert min(pvs) > PASS_P, (kind, ell, pvs)


def test_accept_greedy_one_hot_is_exact():
    """One-hot p and q (T = 0): k = length of the matching prefix (capped at ℓ), next = argmax p_k."""
    rng = np.random.default_rng(3)
    R, V, g = 4096, V_UNIT, GAMMA_UNIT
    tgt = rng.integers(0, V, size=(R, g + 1))  # argmax p_j
    match = rng.random((R, g)) < 0.7
    drafts = np.where(match, tgt[:, :g], (tgt[:, :g] + rng.integers(1, V, size=(R, g))) % V)
    ell = rng.integers(0, g + 1, size=R)
    p = np.eye(V, dtype=np.float32)[tgt]
    q = np.eye(V, dtype=np.float32)[drafts]
    out = jax.device_get(jax.jit(accept)(jax.random.split(jax.random.key(0), R),
                                         jnp.asarray(drafts, jnp.int32),
                                         jnp.asarray(q), jnp.asarray(p),
                                         jnp.asarray(ell, jnp.int32)))
    prefix = np.sum(np.cumprod(drafts == tgt[:, :g], axis=1), axis=1)
    want_k = np.minimum(prefix, ell)
    np.testing.assert_array_equal(out.num_accepted, want_k)
    np.testing.assert_array_equal(out.next_token, tgt[np.arange(R), want_k])


# ----------------------------------------------------------------------------- the engine

TCFG = TargetConfig(vocab_size=8, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=8, target_layer_ids=(0,),
                    mask_token_id=3, max_position_embeddings=64)
DCFG = DrafterConfig(num_draft_layers=1, block_size=4, markov_rank=4, num_anchors=4)
TARGET_SEED, TARGET_SCALE = 0, 12.0
DRAFTER_SEED, DRAFTER_SCALE = 3, 8.0
PROMPT = (1, 2, 5, 6)
MAX_LEN = 16
N_SAMPLES = 16_000  # requests per positive case (a broken rule fails at 4,000: see the controls)
N_CONTROL = 4_000  # requests per negative control
SLOTS, CONTROL_SLOTS = 8, 2
SCHEDULERS = {"fixed": SchedulerConfig("fixed", 4), "threshold": SchedulerConfig("threshold", 0, 0.5),
              "greedy": SchedulerConfig("greedy"), "async": SchedulerConfig("async"),
              "threshold-fill": SchedulerConfig("threshold", 0, 0.5, bucket_fill=True)}


def _scaled(params, scale):
    """Matrices (and embeddings) multiplied by `scale`; norm weights and biases left alone."""
    return jax.tree.map(lambda x: x * scale if x.ndim >= 2 else x, params)


@pytest.fixture(scope="module")
def models():
    tp = _scaled(init_params(target_spec(TCFG), jax.random.key(TARGET_SEED)), TARGET_SCALE)
    dp = _scaled(init_params(drafter_spec(TCFG, DCFG), jax.random.key(DRAFTER_SEED)), DRAFTER_SCALE)
    return tp, dp


@pytest.fixture(scope="module")
def exact_logits(models):
    """float64 logits [8, 8, 3, V]: for prefix (t1, t2), the target's logits after the prompt, after
    t1 and after t2, from one full-sequence forward (no cache) over all 64 continuations."""
    tp, _ = models
    V = TCFG.vocab_size
    t1, t2 = np.meshgrid(np.arange(V), np.arange(V), indexing="ij")
    seqs = np.concatenate([np.tile(PROMPT, (V * V, 1)), t1.reshape(-1, 1), t2.reshape(-1, 1)], 1)
    n = len(PROMPT)
    pos = np.broadcast_to(np.arange(n + 2), seqs.shape)
    fwd = jax.jit(lambda params, tokens, positions: forward(params, TCFG, tokens, positions).logits)
    logits = fwd(tp, jnp.asarray(seqs, jnp.int32), jnp.asarray(pos, jnp.int32))
    return np.asarray(logits, np.float64)[:, n - 1:n + 2].reshape(V, V, 3, V)


def exact_joint(logits: np.ndarray, temperature: float) -> np.ndarray:
    """P(t1, t2, t3) [V, V, V] = P(t1) P(t2 | t1) P(t3 | t1, t2) at the given temperature."""
    z = logits / temperature
    z = z - z.max(-1, keepdims=True)
    probs = np.exp(z) / np.exp(z).sum(-1, keepdims=True)
    p1 = probs[0, 0, 0]  # the same for every prefix (causal)
    p2 = probs[:, 0, 1]  # [t1, t2]
    p3 = probs[:, :, 2]  # [t1, t2, t3]
    joint = p1[:, None, None] * p2[:, :, None] * p3
    assert abs(joint.sum() - 1) < 1e-9
    return joint


def _make_engine(models, scheduler, slots, acceptance=accept):
    tp, dp = models
    engine = Engine(TCFG, tp, DCFG, dp, slots=slots, max_len=MAX_LEN, scheduler=scheduler,
                    prefill_buckets=(MAX_LEN,), max_prefill_batch=slots, seed=0,
                    acceptance=acceptance)
    if scheduler.load_aware:
        # Made-up round times under which the choice really varies: a proposal round costs
        # 1 + F/400 (the best bucket depends on the survival), a round without one 0.7.
        engine.use_profile(profile.SpsProfile(
            measured_on=profile.engine_key(engine), spec={F: 1 + F / 400 for F in engine.spec_buckets},
            plain={F: 0.7 for F in engine.plain_buckets}), "test")
    return engine


@pytest.fixture(scope="module")
def engines(models):
    """One engine per scheduler, built on first use and shared across temperatures."""
    cache = {}

    def get(kind):
        if kind not in cache:
            cache[kind] = _make_engine(models, SCHEDULERS[kind], SLOTS)
        return cache[kind]

    return get


def run_joint(engine, n, temperature):
    """Generates n identical requests; returns (counts [V,V,V] of (t1,t2,t3), metrics, results)."""
    V = TCFG.vocab_size
    results = []
    reqs = [Request(id=str(i), prompt_ids=PROMPT, max_new_tokens=4, temperature=temperature,
                    stop_ids=()) for i in range(n)]
    metrics = engine.generate(reqs, results.append)
    assert len(results) == n
    toks = np.asarray([r.token_ids[:3] for r in results])
    assert toks.shape == (n, 3) and toks.min() >= 0 and toks.max() < V
    assert all(len(r.token_ids) == 4 and r.finish_reason == "length" for r in results)
    counts = np.bincount(toks[:, 0] * V * V + toks[:, 1] * V + toks[:, 2], minlength=V ** 3)
    return counts.reshape(V, V, V), metrics, results


# T = 0.7 through async (the tempered path is shared by every scheduler); T = 1 through the rest.
CASES = [(1.0, "fixed"), (1.0, "threshold"), (1.0, "greedy"), (0.7, "async"), (1.0, "threshold-fill")]


@pytest.mark.parametrize("temperature,kind", CASES, ids=[f"T{t}-{k}" for t, k in CASES])
def test_engine_matches_target_distribution(engines, exact_logits, temperature, kind):
    """Chi-square goodness of fit (p > 1e-3) of the first three generated tokens of N identical
    requests against the exact target distribution, with the drafts really exercised."""
    engine = engines(kind)
    counts, m, results = run_joint(engine, N_SAMPLES, temperature)
    joint = exact_joint(exact_logits, temperature)
    # The setting is meaningful: far from uniform, drafts accepted often but not always.
    assert joint.max() > 4 / joint.size and np.mean(joint < 0.2 / joint.size) > 0.05
    assert 0.2 < m["acceptance_rate"] < 0.9, m
    first_round = np.asarray([r.verified[0] for r in results])
    if kind == "fixed":
        assert m["mean_verified"] >= 1.0, m
        assert np.all(first_round == 2)  # fixed(4) clipped to the budget: t2, t3 and the bonus
    elif kind == "threshold-fill":  # the padding verifies what threshold(0.5) alone leaves out
        assert m["mean_verified"] > 1.15, m  # threshold(0.5) alone: 1.03; all the budget allows: 1.24
    elif kind != "async":  # the confidences vary: some requests verify fewer drafts than others
        assert 0.0 < m["mean_verified"] < engine.max_verify, m
        share = np.bincount(first_round, minlength=3) / len(first_round)
        assert np.sum(share > 0.05) >= 2, share
    assert m["compilations_after_warmup"] == 0, m
    pv, stat, bins = chi_square_p(counts, joint)
    print(f"\n[lossless] T={temperature} {kind}: p={pv:.4g} chi2={stat:.1f} bins={bins} "
          f"acceptance={m['acceptance_rate']:.3f} mean_verified={m['mean_verified']:.3f} "
          f"buckets={m['buckets']}")
    if kind == "async":  # both kinds of round, and more than one verification bucket
        assert sum(k.startswith("plain") for k in m["buckets"]) >= 1, m["buckets"]
        assert sum(k.startswith("spec") for k in m["buckets"]) >= 2, m["buckets"]
    assert pv > PASS_P, (pv, stat, bins)


# ----------------------------------------------------------------------------- negative controls


def accept_everything(keys, draft_tokens, draft_probs, target_probs, verify_len) -> Acceptance:
    """BROKEN: every verified draft is accepted (k = ℓ), the next token drawn from p_ℓ."""
    k = verify_len.astype(jnp.int32)
    p_k = jnp.take_along_axis(target_probs, k[:, None, None], 1)[:, 0]
    return Acceptance(num_accepted=k, next_token=sample(split_rows(keys)[1], p_k))


def resample_from_target(keys, draft_tokens, draft_probs, target_probs, verify_len) -> Acceptance:
    """BROKEN: the acceptance test is right, but a rejected draft is replaced by a sample of p_k
    instead of the residual norm(max(0, p_k − q_{k+1}))."""
    R, gamma = draft_tokens.shape
    k_u, k_next = split_rows(keys)
    p_d = jnp.take_along_axis(target_probs[:, :-1], draft_tokens[..., None], -1)[..., 0]
    q_d = jnp.take_along_axis(draft_probs, draft_tokens[..., None], -1)[..., 0]
    u = jax.vmap(lambda k: jax.random.uniform(k, (gamma,)))(k_u)
    ok = (u * q_d < p_d) & (jnp.arange(gamma) < verify_len[:, None])
    k = jnp.sum(jnp.cumprod(ok.astype(jnp.int32), axis=-1), axis=-1).astype(jnp.int32)
    p_k = jnp.take_along_axis(target_probs, k[:, None, None], 1)[:, 0]
    return Acceptance(num_accepted=k, next_token=sample(k_next, p_k))


@pytest.mark.parametrize("rule", [accept_everything, resample_from_target],
                         ids=lambda f: f.__name__)
def test_broken_acceptance_is_detected(models, exact_logits, rule):
    """The same procedure (fewer samples) rejects deliberately broken rules with p < 1e-6."""
    engine = _make_engine(models, SCHEDULERS["fixed"], CONTROL_SLOTS, acceptance=rule)
    counts, m, _ = run_joint(engine, N_CONTROL, 1.0)
    pv, stat, bins = chi_square_p(counts, exact_joint(exact_logits, 1.0))
    print(f"\n[lossless] broken {rule.__name__}: p={pv:.4g} chi2={stat:.1f} bins={bins} "
          f"acceptance={m['acceptance_rate']:.3f}")
    assert pv < FAIL_P, (pv, stat, bins)


@pytest.mark.parametrize("rule", [accept_everything, resample_from_target],
                         ids=lambda f: f.__name__)
def test_accept_check_detects_broken_rules(rule):
    """The unit-level check has power too: the first committed token of a broken rule is far from
    p_0 whenever at least one draft is verified."""
    p, q = _unit_dists("dense")
    for ell in (1, GAMMA_UNIT):
        assert committed_token_p_values(rule, p, q, ell, seed=7)[0] < FAIL_P, (rule, ell)
