"""The paper's Appendix A counterexample: a scheduler that looks at a draft token before deciding
whether to verify it biases the output; ours decide from pre-token information and do not.

Vocabulary {A, B}; the target's first-position distribution is (0.7, 0.3), the drafter's (0.5, 0.5),
so the first draft survives with probability a1 = 0.8. SPS(1) = 1.0, SPS(2) = 0.5, SPS(3) = 0.45.
A global search without early stopping evaluates Θ2 = (1 + a1 + a1·c2)·SPS(3), where c2 depends on
the sampled x1 (A gives c2 = 0.9, B gives c2 = 0): it verifies 2 drafts after A and none after B, and
the first output token comes out (0.85, 0.15). The real `accept` is used for the verification.
"""

import jax
import jax.numpy as jnp
import numpy as np
from scipy import stats

from dspark_jax.decoding.acceptance import accept
from dspark_jax.decoding.schedulers import SchedulerConfig, schedule

A, B = 0, 1
P_T = np.array([0.7, 0.3])
Q = np.array([0.5, 0.5])
SPS = {1: 1.0, 2: 0.5, 3: 0.45}
N = 200_000


def first_token_distribution(verify_len_of):
    """Runs `accept` on N rounds whose drafts are sampled from Q; returns the first output token's
    empirical distribution. `verify_len_of(drafts [N, 2]) -> ℓ [N]`."""
    k_draft, k_acc = jax.random.split(jax.random.key(0))
    drafts = jax.random.categorical(k_draft, jnp.log(jnp.asarray(Q)), shape=(N, 2)).astype(jnp.int32)
    q = jnp.broadcast_to(jnp.asarray(Q, jnp.float32), (N, 2, 2))
    p = jnp.broadcast_to(jnp.asarray(P_T, jnp.float32), (N, 3, 2))
    ell = verify_len_of(drafts)
    acc = accept(jax.random.split(k_acc, N), drafts, q, p, ell)
    first = jnp.where(acc.num_accepted >= 1, drafts[:, 0], acc.next_token)
    return np.bincount(np.asarray(first), minlength=2) / N


def look_ahead(drafts):
    """Offline global search over ℓ in {0, 1, 2}; c2 read off the sampled first draft."""
    a1 = 0.8
    c2 = jnp.where(drafts[:, 0] == A, 0.9, 0.0)
    theta = jnp.stack([jnp.full(c2.shape, 1.0 * SPS[1]), jnp.full(c2.shape, (1 + a1) * SPS[2]),
                       (1 + a1 + a1 * c2) * SPS[3]], axis=-1)
    return jnp.argmax(theta, -1).astype(jnp.int32)


def ours(kind, **kw):
    """Our schedulers: ℓ from confidences known before the drafts are sampled (c1 = 0.8, and
    the c2 a Markov head would give for each candidate cannot be consulted)."""
    conf = jnp.broadcast_to(jnp.asarray([0.8, 0.5]), (N, 2))
    return lambda drafts: schedule(SchedulerConfig(kind, **kw), conf)


def p_value(freq):
    return stats.chisquare(freq * N, P_T * N).pvalue


def test_look_ahead_scheduler_is_biased():
    freq = first_token_distribution(look_ahead)
    np.testing.assert_allclose(freq, [0.85, 0.15], atol=0.005)
    assert p_value(freq) < 1e-6


def test_our_schedulers_keep_the_target_distribution():
    for sched in (ours("threshold", threshold=0.75), ours("threshold", threshold=0.9),
                  ours("fixed", verify_len=2), ours("fixed", verify_len=1)):
        freq = first_token_distribution(sched)
        np.testing.assert_allclose(freq, P_T, atol=0.005)
        assert p_value(freq) > 1e-3
