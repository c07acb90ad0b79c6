"""The paper's Appendix A counterexample: a scheduler that looks at a draft token before deciding
whether to verify it biases the output; ours decide from pre-token information and do not.

Vocabulary {A, B}; the target's first-position distribution is (0.7, 0.3), the drafter's (0.5, 0.5),
so the first draft survives with probability a1 = 0.8. SPS(1) = 1.0, SPS(2) = 0.5, SPS(3) = 0.45.
A global search without early stopping evaluates Θ2 = (1 + a1 + a1·c2)·SPS(3), where c2 depends on
the sampled x1 (A gives c2 = 0.9, B gives c2 = 0): it verifies 2 drafts after A and none after B, and
the first output token comes out (0.85, 0.15). The real `accept` is used for the verification.

The second part gives the real load-aware schedulers (`greedy_count`, `candidate_order`,
`admit_first`, `choose_bucket`) confidences that depend on the previous draft, as DSpark's Markov
confidence head does, over batches of 4 rows: each keeps the target's joint distribution of the
first two tokens, and two schedulers that let c2 decide whether d1 is verified do not.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from scipy import stats

from dspark_jax.decoding.acceptance import accept
from dspark_jax.decoding.schedulers import (
    SchedulerConfig,
    admit_first,
    candidate_order,
    choose_bucket,
    greedy_count,
    schedule,
    survival,
)

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


# ---------------------------------------------------------------------------------------------
# Confidences that depend on the previous draft, through the real load-aware schedulers.
#
# Each round drafts γ = 2 tokens for R = 4 rows: d1 ~ Q1, d2 ~ Q2[d1]. c1 = C1[r] is known before
# anything is drafted; c2 = C2_AFTER[d1], as a Markov-conditioned confidence head gives it, so
# every scheduler sees confidences (and survival a = cumprod(c)) that depend on the drafts. The
# target gives P0 for the first token and P2[t1] for the second, so a row's first two committed
# tokens (t1, t2) must follow P0[t1]·P2[t1][t2] whatever ℓ is, provided that whether d_j is
# verified never depends on d_j itself (here: the verification of d1 must not follow c2).

R, GAMMA = 4, 2
ROUNDS = 50_000  # R·ROUNDS = 200k row-samples per scheduler
C1 = np.array([0.9, 0.9, 0.6, 0.35])  # rows 0 and 1 tie exactly
C2_AFTER = np.array([0.9, 0.2])  # c2 after d1 = A, B
Q1 = np.array([0.5, 0.5])
Q2 = np.array([[0.3, 0.7], [0.5, 0.5]])  # Q2[d1]
P0 = np.array([0.7, 0.3])
P2 = np.array([[0.6, 0.4], [0.2, 0.8]])  # P2[t1]
P3 = np.array([0.5, 0.5])  # the bonus after two accepted drafts: (t1, t2) never reads it
JOINT = (P0[:, None] * P2).reshape(-1)  # cells (A,A), (A,B), (B,A), (B,B)

# greedy: a verification of B tokens takes 1 + 0.08·B. The walk then verifies d2 exactly when
# d1 = A for rows 0-2 (c2 = 0.9 pays, 0.2 does not), and row 3's d1 (a = 0.35, ranked after the
# d2 candidates of rows 0 and 1 when they drafted A) only when rows 0 and 1 both drafted B.
GREEDY_SPS = [0.0] + [1.0 / (1.0 + 0.08 * b) for b in range(1, R * (GAMMA + 1) + 1)]

# greedy + bucket fill: power-of-two buckets and the SPS step function of their round times. The
# walk fills bucket 8 (the 4 best candidates) and crosses the cliff to bucket 16 only when rows 0
# and 1 both drafted A; otherwise bucket 8 holds row 0's d2 exactly when row 0 drafted A.
FILL_BUCKETS = [4, 8, 16]
FILL_SECONDS = {4: 1.0, 8: 1.2, 16: 1.294}
FILL_SPS = [0.0] + [1.0 / FILL_SECONDS[min(F for F in FILL_BUCKETS if F >= b)]
                    for b in range(1, R * (GAMMA + 1) + 1)]

# A cliff: the anchors alone in 1 s, up to 12 tokens in 2.06 s. Algorithm 1 stops before it (the
# best first candidate gives 4.9 / 2.06 < 4 / 1); a search without the stop verifies all 8 drafts
# when their survival sums past 4.24, i.e. when enough rows drafted A, and nothing otherwise.
CLIFF_SPS = [1.0] * (R + 1) + [1.0 / 2.06] * (R * GAMMA)

# async: `choose_bucket` on a round's survival picks bucket 8 (the 4 best candidates) when row 0
# or row 1 drafted A, and a plain round (no drafts verified) otherwise.
ASYNC_SPEC, ASYNC_PLAIN = {8: 1.78}, {4: 1.0}


def confidences(d1):
    """c [R, γ] after the first drafts d1 [R]."""
    return jnp.stack([jnp.asarray(C1, jnp.float32), jnp.asarray(C2_AFTER, jnp.float32)[d1]], -1)


# Schedulers: (c [R, γ], key) -> ℓ [R]; the key is independent of the round's drafts.

def per_request(cfg):
    return lambda c, key: schedule(cfg, c)


def top_candidates(budget):
    """ℓ from the real on-device pieces: `candidate_order`, then `admit_first` of
    budget(n, a_sorted, key) candidates. Every row is active with room γ."""
    def verify_len_of(c, key):
        order, a_sorted = candidate_order(survival(c), jnp.full((R,), GAMMA, jnp.int32))
        return admit_first(order, a_sorted, budget(jnp.int32(R), a_sorted, key), R)
    return verify_len_of


def greedy(n, a_sorted, key):
    return greedy_count(a_sorted, n, jnp.asarray(GREEDY_SPS, jnp.float32))


def greedy_bucket_fill(n, a_sorted, key):
    """The host rounds B = n + m up to a bucket F; the padding takes the next candidates."""
    m = greedy_count(a_sorted, n, jnp.asarray(FILL_SPS, jnp.float32))
    buckets = jnp.asarray(FILL_BUCKETS)
    return buckets[jnp.searchsorted(buckets, n + m)] - n


def fixed_bucket(F):
    return lambda n, a_sorted, key: F - n


def bucket_budgets():
    """`choose_bucket`'s F - n (0 for a plain round) for every pattern of first drafts, indexed by
    Σ_r d1_r·2^r: a round's survival estimates are a function of that pattern."""
    budgets = []
    for pattern in range(2 ** R):
        d1 = np.array([(pattern >> r) & 1 for r in range(R)])
        estimates = np.cumprod(np.stack([C1, C2_AFTER[d1]], -1), -1)
        kind, F = choose_bucket(estimates, R, ASYNC_SPEC, ASYNC_PLAIN)
        budgets.append(F - R if kind == "spec" else 0)
    return np.array(budgets, np.int32)


def budget_of(d1):
    return jnp.asarray(bucket_budgets())[jnp.sum(d1 * 2 ** jnp.arange(R))]


def bucket_from_an_earlier_round(n, a_sorted, key):
    """The estimates of an earlier round (t-2): drafted independently of this round's."""
    return budget_of(jax.random.categorical(key, jnp.log(jnp.asarray(Q1)), shape=(R,)))


def bucket_from_this_round(c, key):
    """The same search run on this round's own survival (in which c2 reveals d1)."""
    d1 = (c[:, 1] < C2_AFTER[A]).astype(jnp.int32)
    return top_candidates(lambda n, a_sorted, key: budget_of(d1))(c, key)


def greedy_without_the_break(n, a_sorted, key):
    """Algorithm 1 with an argmax over every prefix of the walk in place of the early stop, on
    CLIFF_SPS: it crosses the cliff (verifying every draft) exactly when the d2 candidates, and so
    the d1 drafts, promise enough."""
    sps = jnp.asarray(CLIFF_SPS, jnp.float32)
    tau = n + jnp.cumsum(jnp.maximum(a_sorted, 0.0))
    theta = jnp.concatenate([(n * sps[n])[None], tau * sps[n + 1 + jnp.arange(a_sorted.shape[0])]])
    return jnp.argmax(theta).astype(jnp.int32)


def look_ahead_per_row(c, key):
    """Appendix A per row: the argmax of Θ_j = (1 + a_1 + .. + a_j)·SPS(1 + j) over j = 0, 1, 2,
    SPS = (1.0, 0.5, 0.45). Rows 0 and 1 verify both drafts after A and none after B."""
    theta = jnp.concatenate([jnp.ones((R, 1)), 1.0 + jnp.cumsum(survival(c), -1)], -1)
    return jnp.argmax(theta * jnp.asarray([1.0, 0.5, 0.45]), -1).astype(jnp.int32)


LOSSLESS = {
    # ℓ = 1 + [d1 = A] for the rows with c1 >= t: it stops at the first low c_j, and c_j is known
    # before d_j is drafted.
    "threshold(0.5)": per_request(SchedulerConfig("threshold", threshold=0.5)),
    "threshold(0.85)": per_request(SchedulerConfig("threshold", threshold=0.85)),
    # Algorithm 1: every candidate that depends on d_j ranks after d_j's own, and the walk stops on
    # the candidates ranked up to the one it stops at.
    "greedy": top_candidates(greedy),
    # the bucket is a non-decreasing function of m, so whether the k-th candidate gets in is
    # decided by the walk's first k steps: candidates ranked no later than itself.
    "greedy + bucket fill": top_candidates(greedy_bucket_fill),
    # top-K with K fixed before the round: rank-preserving, and d_j's rank ignores d_j.
    **{f"async, bucket {F}": top_candidates(fixed_bucket(F)) for F in (5, 6, 7, 8)},
    # K searched on an earlier round's estimates: the causal barrier of §5.2.
    "async, bucket from an earlier round": top_candidates(bucket_from_an_earlier_round),
}
FOLLOWS_D1 = ("threshold(0.5)", "threshold(0.85)", "greedy", "greedy + bucket fill",
              "async, bucket 7", "async, bucket 8")  # ℓ verifies d2 exactly when d1 = A

# (scheduler, P(t1 = A) of each row): whether d1 is verified depends on c2, hence on d1 itself.
ANTICIPATING = {
    # rows 0 and 1 verify d1 only after A: P(t1 = A) = 0.5·1 + 0.5·0.7 = 0.85.
    "look-ahead per row": (look_ahead_per_row, [0.85, 0.85, 0.7, 0.7]),
    # the round is plain (nothing verified) unless row 0 or 1 drafted A: after its own A row 0's
    # d1 is always verified, after B half the time: P(t1 = A) = 0.7 + 0.15·(1 - 0.5) = 0.775.
    "async, bucket from this round": (bucket_from_this_round, [0.775, 0.775, 0.7, 0.7]),
    # all or nothing on Σ a2 > 1.49: rows 0-2 are verified with probability 3/4 after their own A,
    # 1/4 after B (row 3's c2 is never pivotal): P(t1 = A) = 0.7 + 0.15·(3/4 - 1/4) = 0.775.
    "greedy without the break": (top_candidates(greedy_without_the_break),
                                 [0.775, 0.775, 0.775, 0.7]),
}
SCHEDULERS = list(LOSSLESS.items()) + [(name, f) for name, (f, _) in ANTICIPATING.items()]


@functools.cache
def simulator():
    """One program for every scheduler (compiling dominates the run time): (keys [ROUNDS], which)
    -> (t1, t2, ℓ, d1), each [ROUNDS, R], for SCHEDULERS[which]. A round drafts, schedules and
    runs `accept`; when it accepts no draft it commits t1 only, and t2 is drawn from P2[t1] as the
    following round would."""
    q1, q2 = jnp.asarray(Q1, jnp.float32), jnp.asarray(Q2, jnp.float32)
    p0, p2, p3 = (jnp.asarray(x, jnp.float32) for x in (P0, P2, P3))
    branches = [f for _, f in SCHEDULERS]

    def one_round(key, which):
        k_d1, k_d2, k_sched, k_acc, k_t2 = jax.random.split(key, 5)
        d1 = jax.random.categorical(k_d1, jnp.log(q1), shape=(R,)).astype(jnp.int32)
        d2 = jax.random.categorical(k_d2, jnp.log(q2[d1])).astype(jnp.int32)
        q = jnp.stack([jnp.broadcast_to(q1, (R, 2)), q2[d1]], 1)  # [R, γ, V]
        p = jnp.stack([jnp.broadcast_to(p0, (R, 2)), p2[d1], jnp.broadcast_to(p3, (R, 2))], 1)
        ell = jax.lax.switch(which, branches, confidences(d1), k_sched)
        acc = accept(jax.random.split(k_acc, R), jnp.stack([d1, d2], -1), q, p, ell)
        k, nxt = acc.num_accepted, acc.next_token
        t1 = jnp.where(k >= 1, d1, nxt)
        later = jax.random.categorical(k_t2, jnp.log(p2[t1])).astype(jnp.int32)
        t2 = jnp.where(k >= 2, d2, jnp.where(k == 1, nxt, later))
        return t1, t2, ell, d1

    return jax.jit(jax.vmap(one_round, in_axes=(0, None)))


def markov_rounds(name, seed):
    which = [n for n, _ in SCHEDULERS].index(name)
    out = simulator()(jax.random.split(jax.random.key(seed), ROUNDS), which)
    return tuple(np.asarray(x) for x in out)


def row_p_values(t1, t2):
    """Chi-square p-value of each row's (t1, t2) counts against the target joint. Rows are tested
    apart: a batch scheduler couples the rows of a round, but rounds are independent."""
    cells = 2 * t1 + t2
    return np.array([stats.chisquare(np.bincount(cells[:, r], minlength=4),
                                     JOINT * len(cells)).pvalue for r in range(R)])


def combined_p(row_p):
    """Bonferroni over the rows: a valid p-value for 'every row follows the target'."""
    return min(1.0, R * row_p.min())


def d2_follows_d1(ell, d1):
    """max over rows of P(ℓ_r = 2 | d1_r = A) - P(ℓ_r = 2 | d1_r = B): 1 when row r verified d2
    exactly after A, so ℓ depended on the drafts through c2."""
    return max(np.mean(ell[d1[:, r] == A, r] == 2) - np.mean(ell[d1[:, r] == B, r] == 2)
               for r in range(R))


def test_markov_confidence_schedulers_keep_the_target_joint():
    for seed, name in enumerate(LOSSLESS, start=1):
        t1, t2, ell, d1 = markov_rounds(name, seed)
        row_p = row_p_values(t1, t2)
        print(f"{name}: p = {combined_p(row_p):.3g} (rows {np.array2string(row_p, precision=3)}), "
              f"mean ℓ {np.array2string(ell.mean(0), precision=2)}, "
              f"d2 verified after A minus after B {d2_follows_d1(ell, d1):.2f}")
        assert combined_p(row_p) > 1e-3, name
        if name in FOLLOWS_D1:  # the test is meaningful: ℓ depended on the drafts
            assert d2_follows_d1(ell, d1) == 1.0, name


def test_load_aware_schedulers_couple_rows():
    """Whether row 3's d1 is verified depends on the other rows' drafts (through their c2): with
    greedy, exactly when rows 0 and 1 both drafted B; with top-K in bucket 8, when rows 0, 1 and 2
    all did. Lossless all the same, since it never depends on row 3's own d1."""
    _, _, ell, d1 = markov_rounds("greedy", 0)
    both_b = (d1[:, 0] == B) & (d1[:, 1] == B)
    np.testing.assert_array_equal(ell[:, 3] >= 1, both_b)
    _, _, ell, d1 = markov_rounds("async, bucket 8", 0)
    np.testing.assert_array_equal(ell[:, 3] >= 1, both_b & (d1[:, 2] == B))


def test_greedy_stops_before_the_cliff():
    """The contrast for 'greedy without the break': on CLIFF_SPS the real walk verifies nothing,
    even when every row drafted A, while the search without the stop then verifies all 8 drafts."""
    _, a_sorted = candidate_order(survival(confidences(jnp.zeros(R, jnp.int32))),
                                  jnp.full((R,), GAMMA, jnp.int32))
    assert int(greedy_count(a_sorted, jnp.int32(R), jnp.asarray(CLIFF_SPS, jnp.float32))) == 0
    assert int(greedy_without_the_break(jnp.int32(R), a_sorted, None)) == R * GAMMA


def test_anticipating_schedulers_are_biased():
    for name, (_, first_a) in ANTICIPATING.items():
        t1, t2, _, _ = markov_rounds(name, 100)
        p = combined_p(row_p_values(t1, t2))
        print(f"{name}: p = {p:.3g}, P(t1 = A) per row "
              f"{np.array2string(np.mean(t1 == A, 0), precision=3)} (target {P0[A]})")
        np.testing.assert_allclose(np.mean(t1 == A, 0), first_a, atol=0.01)
        assert p < 1e-6, name
