"""The schedulers' pieces by hand (DESIGN §5): per-request rules, the candidate order and its
admission, Algorithm 1's walk against the paper's pseudo-code, and the async bucket search.

Survival values and SPS tables are dyadic (multiples of 1/256 and 1/16), so float32 and Python
floats compute the same Θ exactly and ties (Θ equal to the best, equal survival) really occur.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dspark_jax.decoding.schedulers import (
    BucketTable,
    SchedulerConfig,
    admit_first,
    candidate_order,
    choose_bucket,
    fixed,
    greedy_count,
    schedule,
    survival,
    threshold,
)


def ells(a, room, count):
    """admit_first after candidate_order, as numpy."""
    a = jnp.asarray(a, jnp.float32)
    order, a_sorted = candidate_order(a, jnp.asarray(room, jnp.int32))
    return np.asarray(admit_first(order, a_sorted, jnp.int32(count), a.shape[0]))


# ----------------------------------------------------------------------------- per request


def test_survival_is_the_prefix_product():
    c = jnp.asarray([[0.5, 0.5, 1.0, 0.0], [1.0, 0.75, 0.5, 0.25]])
    np.testing.assert_array_equal(survival(c), [[0.5, 0.25, 0.25, 0.0],
                                                [1.0, 0.75, 0.375, 0.09375]])


def test_fixed_lengths():
    c = jnp.zeros((3, 4))
    np.testing.assert_array_equal(fixed(c, 0), [4, 4, 4])  # 0 means the block size
    np.testing.assert_array_equal(fixed(c, 1), [1, 1, 1])
    np.testing.assert_array_equal(fixed(c, 9), [4, 4, 4])  # never past γ
    assert fixed(c, 2).dtype == jnp.int32


def test_threshold_counts_leading_positions_only():
    c = jnp.asarray([[0.5, 0.9, 0.9, 0.9],  # c_j == t counts
                     [0.9, 0.4, 0.9, 0.9],  # a low c_j stops: later high ones do not count
                     [0.1, 0.9, 0.9, 0.9],  # all rejected
                     [1.0, 1.0, 1.0, 1.0]])  # all verified
    np.testing.assert_array_equal(threshold(c, 0.5), [4, 1, 0, 4])
    np.testing.assert_array_equal(schedule(SchedulerConfig("threshold", threshold=0.5), c),
                                  [4, 1, 0, 4])
    np.testing.assert_array_equal(schedule(SchedulerConfig("fixed", verify_len=3), c), [3] * 4)


@pytest.mark.parametrize("kind", ["greedy", "async"])
def test_schedule_refuses_load_aware_kinds(kind):
    with pytest.raises(ValueError, match=kind):
        schedule(SchedulerConfig(kind), jnp.ones((2, 3)))


# ----------------------------------------------------------------------------- candidate order


def test_candidate_order_ties_go_to_lower_j_then_lower_r():
    # Flat index j·R + r. Survival 0.75 three times: (j0, r0), (j0, r1), (j1, r1); 0.5 three times:
    # (j0, r2), (j1, r0), (j1, r2).
    a = [[0.75, 0.5], [0.75, 0.75], [0.5, 0.5]]
    order, a_sorted = candidate_order(jnp.asarray(a), jnp.asarray([2, 2, 2]))
    np.testing.assert_array_equal(order, [0, 1, 4, 2, 3, 5])
    np.testing.assert_array_equal(a_sorted, [0.75, 0.75, 0.75, 0.5, 0.5, 0.5])


def test_candidate_order_puts_candidates_past_the_room_last():
    # Row 1 is an empty slot (room 0), row 2 may verify one draft; its first draft is certain to
    # fail (a = 0) but still valid, ahead of every invalid candidate.
    a = [[1.0, 0.5, 0.25], [1.0, 1.0, 1.0], [0.0, 0.0, 0.0]]
    order, a_sorted = candidate_order(jnp.asarray(a), jnp.asarray([3, 0, 1]))
    np.testing.assert_array_equal(order[:4], [0, 3, 6, 2])  # (0,0), (0,1), (0,2), (2,0)
    np.testing.assert_array_equal(a_sorted, [1.0, 0.5, 0.25, 0.0, -1, -1, -1, -1, -1])
    assert sorted(np.asarray(order[4:])) == [1, 4, 5, 7, 8]  # row 1 and row 2's j >= 1


def test_admit_first_by_hand():
    a = [[0.75, 0.5], [0.75, 0.75], [0.5, 0.5]]
    expected = {0: [0, 0, 0], 1: [1, 0, 0], 2: [1, 1, 0], 3: [1, 2, 0], 4: [1, 2, 1],
                5: [2, 2, 1], 6: [2, 2, 2], 7: [2, 2, 2], 100: [2, 2, 2]}
    for count, ell in expected.items():
        np.testing.assert_array_equal(ells(a, [2, 2, 2], count), ell, err_msg=f"count {count}")


def test_admit_first_respects_the_room():
    a = [[1.0, 0.5, 0.25], [1.0, 1.0, 1.0], [0.0, 0.0, 0.0]]
    room = [3, 0, 1]
    np.testing.assert_array_equal(ells(a, room, 0), [0, 0, 0])
    np.testing.assert_array_equal(ells(a, room, 3), [3, 0, 0])
    np.testing.assert_array_equal(ells(a, room, 4), [3, 0, 1])  # a zero-survival draft fills too
    np.testing.assert_array_equal(ells(a, room, 9), [3, 0, 1])  # more than the valid candidates
    np.testing.assert_array_equal(ells(a, [0, 0, 0], 9), [0, 0, 0])  # no room anywhere


def random_table(rng, R, gamma):
    """Survival [R, γ] non-increasing along j, with exact ties (c = 1) and zeros (c = 0)."""
    c = rng.choice([0.0, 0.25, 0.5, 0.75, 1.0], size=(R, gamma), p=[0.05, 0.1, 0.2, 0.3, 0.35])
    return np.cumprod(c, axis=1)


def test_admitted_drafts_are_a_prefix_of_every_row():
    rng = np.random.default_rng(0)
    order_of = jax.jit(candidate_order)
    admit = jax.jit(admit_first, static_argnums=3)
    R, gamma = 5, 4
    for _ in range(50):
        a, room = random_table(rng, R, gamma), rng.integers(0, gamma + 1, R)
        order, a_sorted = order_of(jnp.asarray(a, jnp.float32), jnp.asarray(room, jnp.int32))
        order, a_sorted = np.asarray(order), np.asarray(a_sorted)
        assert np.all(np.diff(a_sorted) <= 0)
        for count in range(R * gamma + 2):
            ell = np.asarray(admit(order, a_sorted, count, R))
            taken = [divmod(int(i), R) for i, s in zip(order[:count], a_sorted[:count]) if s >= 0]
            for r in range(R):
                assert sorted(j for j, row in taken if row == r) == list(range(ell[r]))
            assert np.all(ell <= room) and ell.sum() == min(count, room.sum())


# ----------------------------------------------------------------------------- Algorithm 1


def algorithm1(a, room, n, sps):
    """The paper's pseudo-code: ℓ* for survival a [R, γ] (candidates past room[r] excluded), n
    active requests and SPS(B) = sps[B]."""
    R = a.shape[0]
    candidates = [(r, j) for r in range(R) for j in range(room[r]) if a[r, j] > 0]
    candidates.sort(key=lambda rj: (-a[rj], rj[1], rj[0]))  # descending; ties: lower j, lower r
    ell, best_ell = [0] * R, [0] * R
    B, tau = n, float(n)
    best = tau * sps[B]
    for r, j in candidates:
        ell[r] = j + 1
        B += 1
        tau += a[r, j]
        theta = tau * sps[B]
        if theta > best:
            best, best_ell[r] = theta, ell[r]
        else:
            break
    return np.array(best_ell)


def random_sps(rng, size):
    """A non-increasing step function over random buckets: SPS(B) is the value of the smallest
    bucket >= B, 0 past the largest (multiples of 1/16, equal steps allowed)."""
    buckets = np.sort(rng.choice(np.arange(1, size), rng.integers(1, 7), replace=False))
    values = np.sort(rng.integers(1, 33, len(buckets)))[::-1] / 16
    table = []
    for B in range(size):
        i = np.searchsorted(buckets, B)
        table.append(values[i] if i < len(buckets) else 0.0)
    return np.array(table)


@jax.jit
def greedy_ell(a, room, n, sps):
    order, a_sorted = candidate_order(a, room)
    m = greedy_count(a_sorted, n, sps)
    return m, admit_first(order, a_sorted, m, a.shape[0])


def test_greedy_matches_the_papers_pseudo_code():
    rng = np.random.default_rng(1)
    R, gamma = 5, 4
    stops = set()
    for case in range(400):
        a = random_table(rng, R, gamma)
        active = rng.random(R) < 0.8
        room = np.where(active, rng.integers(0, gamma + 1, R), 0)  # inactive slots: room 0
        n = int(active.sum())
        sps = random_sps(rng, R * (gamma + 1) + 1)  # the engine's table covers every B
        expected = algorithm1(a, room, n, sps)
        m, ell = greedy_ell(jnp.asarray(a, jnp.float32), jnp.asarray(room, jnp.int32),
                            jnp.int32(n), jnp.asarray(sps, jnp.float32))
        assert int(m) == expected.sum(), f"case {case}"
        np.testing.assert_array_equal(ell, expected, err_msg=f"case {case}")
        stops.add(int(m) == room[active].sum())
    assert stops == {True, False}  # walks that stopped early and walks that took everything


def test_greedy_appendix_a_numbers():
    # One request, γ = 2, SPS(1) = 1.0, SPS(2) = 0.5, SPS(3) = 0.45: Θ0 = 1.0 beats Θ1 = 0.9, so
    # the walk stops at once, even when a2 = 0.72 would make Θ2 = 1.134 the global maximum.
    sps = jnp.asarray([1.0, 1.0, 0.5, 0.45])
    one = jnp.int32(1)
    for a in ([0.8, 0.72], [0.8, 0.0]):
        m, ell = greedy_ell(jnp.asarray([a]), jnp.asarray([2]), one, sps)
        assert int(m) == 0 and ell.tolist() == [0]
    # With SPS(2) = 0.6, Θ1 = 1.08 improves and Θ2 = 1.134 improves again; a zero never does.
    sps = jnp.asarray([1.0, 1.0, 0.6, 0.45])
    m, ell = greedy_ell(jnp.asarray([[0.8, 0.72]]), jnp.asarray([2]), one, sps)
    assert int(m) == 2 and ell.tolist() == [2]
    m, ell = greedy_ell(jnp.asarray([[0.8, 0.0]]), jnp.asarray([2]), one, sps)
    assert int(m) == 1 and ell.tolist() == [1]


def test_greedy_stops_on_an_equal_throughput():
    # Θ1 = (1 + 1)·0.5 = 1.0 = Θ0: no improvement, so nothing is admitted (Θ <= Θ_best breaks).
    m, _ = greedy_ell(jnp.asarray([[1.0, 1.0]]), jnp.asarray([2]), jnp.int32(1),
                      jnp.asarray([1.0, 1.0, 0.5, 0.5]))
    assert int(m) == 0
    # A flat SPS admits every positive candidate and stops at the first zero.
    m, ell = greedy_ell(jnp.asarray([[1.0, 0.5, 0.0], [0.25, 0.25, 0.25]]), jnp.asarray([3, 3]),
                        jnp.int32(2), jnp.ones(9))
    assert int(m) == 5 and ell.tolist() == [2, 3]


# ----------------------------------------------------------------------------- async bucket


def test_choose_bucket_prefers_plain_when_drafts_cost_too_much():
    est = np.full((4, 3), 0.5)
    assert choose_bucket(est, 4, {8: 3.0, 16: 6.0}, {4: 1.0, 8: 1.5}) == ("plain", 4)
    assert choose_bucket(est, 5, {8: 3.0, 16: 6.0}, {4: 1.0, 8: 1.5}) == ("plain", 8)


def test_choose_bucket_takes_every_candidate_when_all_survive():
    est = np.ones((4, 3))  # 12 candidates
    assert choose_bucket(est, 4, {8: 1.0, 16: 1.0}, {4: 1.0}) == ("spec", 16)
    # a bucket past what the candidates can fill never wins a tie
    assert choose_bucket(est, 4, {8: 1.0, 16: 1.0, 32: 1.0}, {4: 1.0}) == ("spec", 16)


def test_choose_bucket_jumps_across_an_sps_cliff():
    est = np.full((4, 4), 0.5)  # 16 candidates, 0.5 each
    spec = {5: 1.0, 6: 1.5, 8: 1.75, 16: 2.0}
    theta = {F: (4 + 0.5 * (F - 4)) / s for F, s in spec.items()}
    # bucket 5 beats its neighbour 6 (a stepwise search would stop there), bucket 16 beats all
    assert theta[5] > theta[6] and max(theta, key=theta.get) == 16 and theta[5] > 4.0
    assert choose_bucket(est, 4, spec, {4: 1.0}) == ("spec", 16)


def test_choose_bucket_without_plain_always_proposes():
    assert choose_bucket(np.zeros((4, 2)), 4, {8: 100.0}, {}) == ("spec", 8)
    assert choose_bucket(np.zeros((4, 2)), 4, {6: 2.0, 8: 1.0}, {}) == ("spec", 8)  # the cheapest
    assert choose_bucket(np.zeros((8, 2)), 8, {8: 1.0}, {}) == ("spec", 8)  # anchors only
    rng = np.random.default_rng(2)
    for _ in range(200):
        n = int(rng.integers(1, 8))
        spec = {F: float(rng.uniform(0.5, 4)) for F in (8, 16, 32)}
        kind, F = choose_bucket(rng.random((n, 4)), n, spec, {})
        assert kind == "spec" and F in spec


def test_choose_bucket_is_the_argmax_over_every_bucket():
    rng = np.random.default_rng(3)
    for _ in range(200):
        n = int(rng.integers(1, 9))
        est = np.cumprod(rng.random((n, 4)), axis=1)
        spec = {F: float(rng.uniform(0.5, 4)) for F in (4, 8, 12, 16, 24, 32, 48) if F > n}
        plain = {F: float(rng.uniform(0.2, 1.5)) for F in (8, 16)}
        pool = np.sort(est.reshape(-1))[::-1]
        options = {("plain", 8 if n <= 8 else 16): n / plain[8 if n <= 8 else 16]}
        options.update({("spec", F): (n + pool[:F - n].sum()) / s for F, s in spec.items()})
        best = max(options.values())
        assert options[choose_bucket(est, n, spec, plain)] == pytest.approx(best, rel=1e-12)


def test_async_estimates_absorbed_lazily_equal_one_round_at_a_time():
    """The async policy folds the rounds read since its last decision in at once; the survival
    estimates, the per-position correction and a new request's prior are those of reading them
    one by one (DECAY per round), with requests joining between rounds."""
    from types import SimpleNamespace

    from dspark_jax.decoding.policies import AsyncPolicy
    from dspark_jax.decoding.state import RoundOutput

    R, gamma = 4, 3
    rng = np.random.default_rng(0)
    engine = SimpleNamespace(R=R, gamma=gamma)
    lazy, eager = AsyncPolicy(engine), AsyncPolicy(engine)

    def by_hand(policy, out):  # the rule, one round at a time
        active = np.flatnonzero(out.was_active)
        a = out.survival[active].astype(np.float64)
        j = np.arange(gamma)
        verified = j < out.verified[active][:, None]
        survived = j < out.accepted[active][:, None]
        policy.predicted = policy.DECAY * policy.predicted + np.where(verified, a, 0.0).sum(0)
        policy.observed = policy.DECAY * policy.observed + survived.sum(0)
        policy.estimates[active] = a
        policy.prior = a.mean(0)

    for t in range(11):
        a = np.cumprod(rng.uniform(0.3, 1.0, (R, gamma)), 1).astype(np.float32)
        ell = rng.integers(0, gamma + 1, R)
        out = RoundOutput(tokens=np.zeros((R, gamma + 1), np.int32), count=ell + 1, verified=ell,
                          accepted=np.minimum(ell, rng.integers(0, gamma + 1, R)),
                          finish=np.zeros(R, np.int32), was_active=rng.random(R) < 0.7,
                          conf_logits=np.zeros((R, gamma), np.float32), survival=a)
        out.was_active[0] = True
        lazy.observe(out, list(range(R)))
        by_hand(eager, out)
        if t in (3, 7):  # a request joins slot 2
            lazy.admitted(2)
            eager.estimates[2] = eager.prior
    lazy._absorb()
    for name in ("estimates", "predicted", "observed", "prior"):
        np.testing.assert_allclose(getattr(lazy, name), getattr(eager, name), rtol=1e-12, err_msg=name)
    np.testing.assert_allclose(lazy.correction(), eager.correction(), rtol=1e-12)


def _cadence_engine(spec_seconds: float, rounds: list):
    """The part of an engine the async policy touches: compiled buckets, a profile, and
    `run_round`/`flush` that only record what was dispatched."""
    from types import SimpleNamespace

    spec_buckets, plain_buckets = [2, 4, 5], [1]
    profile = SimpleNamespace(spec={F: spec_seconds for F in spec_buckets}, plain={1: 1.0})
    return SimpleNamespace(R=1, gamma=4, shape=SimpleNamespace(pending=16),
                           spec_buckets=spec_buckets, plain_buckets=plain_buckets,
                           profile=profile, run_round=lambda key: rounds.append(key),
                           flush=lambda: rounds.append(("flush",)))


def test_async_probes_are_single_rounds_that_grow_apart_while_plain_wins():
    """Proposals priced out: after PROBE_EVERY plain rounds one round with a proposal, and after
    each probe that changes nothing the wait doubles, up to PROBE_MAX; a held-back-feature flush
    at least every `pending` plain rounds."""
    from dspark_jax.decoding import policies

    rounds = []
    engine = _cadence_engine(100.0, rounds)
    policy, PENDING = policies.AsyncPolicy(engine), engine.shape.pending
    for _ in range(6000):
        policy.dispatch([0], lambda: [4])
    kinds = [k[0] for k in rounds if k[0] != "flush"]
    spec_at = np.flatnonzero(np.array(kinds) == "topk")
    gaps = np.diff(np.r_[-1, spec_at]) - 1  # plain rounds before each probe
    assert list(gaps) == [min(policies.PROBE_EVERY * 2 ** i, policies.PROBE_MAX)
                          for i in range(len(gaps))]
    # Between proposals, a flush before every PENDING + 1-th plain round in a row.
    since = 0
    for key in rounds:
        if key[0] == "flush":
            assert since == PENDING
            since = 0
        elif key[0] == "plain":
            since += 1
            assert since <= PENDING
        else:
            since = 0


def test_async_probes_when_requests_join_without_doubling_the_wait():
    """Proposals priced out at one request: each request that joins gets one round with a proposal
    (its estimate is only the prior); the PROBE_EVERY clock runs beside it, and only its own probes
    that change nothing double its wait."""
    from dspark_jax.decoding import policies

    rounds = []
    policy = policies.AsyncPolicy(_cadence_engine(100.0, rounds))
    for t in range(300):
        if t in (0, 100, 200):
            policy.admitted(0)
        policy.dispatch([0], lambda: [4])
    kinds = np.array([k[0] for k in rounds if k[0] != "flush"])
    assert list(np.flatnonzero(kinds == "topk")) == [0, policies.PROBE_EVERY + 1, 100, 200]
    assert policy.probe_every == 2 * policies.PROBE_EVERY


def test_async_probes_in_the_smallest_bucket_holding_the_anchors():
    """A probe is for the proposal (every live request's estimate refreshed), not for drafts the
    search has just priced out: whatever bucket the estimates would fill best, a probe dispatches
    the smallest one holding the live anchors, which verifies no draft once they fill it. Here the
    drafts survive well (0.9 a position) but a proposal costs 100 plain rounds."""
    from types import SimpleNamespace

    from dspark_jax.decoding import policies
    from dspark_jax.decoding.state import RoundOutput

    R, gamma = 4, 4
    spec = {F: 100.0 for F in (2, 4, 8, 16, 20)}
    rounds = []
    engine = SimpleNamespace(R=R, gamma=gamma, shape=SimpleNamespace(pending=1000),
                             spec_buckets=sorted(spec), plain_buckets=[1, 2, 4],
                             profile=SimpleNamespace(spec=spec, plain={1: 1.0, 2: 1.0, 4: 1.0}),
                             run_round=lambda key: rounds.append(key), flush=lambda: None)
    a = np.full((R, gamma), 0.9, np.float32)
    zeros = np.zeros(R, np.int32)
    free = policies.AsyncPolicy(SimpleNamespace(**{**vars(engine), "profile": SimpleNamespace(
        spec={F: 1.0 for F in spec}, plain=engine.profile.plain)}))
    # priced as the plain round, a proposal would fill the largest bucket
    assert free._search(a, R, [gamma] * R)[:2] == ("spec", 20)

    for live in ([0, 1, 2], [0, 1, 2, 3]):
        rounds.clear()
        policy = policies.AsyncPolicy(engine)
        policy.observe(RoundOutput(tokens=np.zeros((R, gamma + 1), np.int32), count=zeros + 1,
                                   verified=zeros, accepted=zeros, finish=zeros,
                                   was_active=np.ones(R, bool),
                                   conf_logits=np.zeros((R, gamma), np.float32), survival=a), [])
        for _ in range(policies.PROBE_EVERY + 3):
            policy.dispatch(live, lambda: [gamma] * len(live))
        probes = [(t, key) for t, key in enumerate(rounds) if key[0] == "topk"]
        assert probes == [(policies.PROBE_EVERY, ("topk", 4))], live  # 1 draft, then none


def test_async_probe_is_judged_once_its_round_is_read():
    """The host reads round t after dispatching t+1: the decision for t+1 cannot have seen a probe
    dispatched at t, so the policy decides again at t+2, with the probe's survival, which here says
    that proposals pay."""
    from dspark_jax.decoding import policies
    from dspark_jax.decoding.state import RoundOutput

    rounds = []
    policy = policies.AsyncPolicy(_cadence_engine(1.0, rounds))
    policy.estimates[:], policy.prior[:] = 0.0, 0.0  # what the last request's drafts were worth
    policy.admitted(0)
    for _ in range(2):
        policy.dispatch([0], lambda: [4])
    assert [k[0] for k in rounds] == ["topk", "plain"]  # the probe, then a decision without it
    a = np.full((1, 4), 0.9, np.float32)
    policy.observe(RoundOutput(tokens=np.zeros((1, 5), np.int32), count=np.array([1]),
                               verified=np.array([1]), accepted=np.array([1]),
                               finish=np.zeros(1, np.int32), was_active=np.array([True]),
                               conf_logits=np.zeros((1, 4), np.float32), survival=a), [0])
    policy.dispatch([0], lambda: [4])
    assert rounds[-1] == ("topk", 5)


def test_async_a_switch_to_proposals_is_judged_once_its_first_round_is_read():
    """Plain rounds win while the estimates are 0; estimates that then promise much (the slots'
    last read proposals, stale after a run of plain rounds) switch to proposals, and the decision
    stands SWITCH_HOLD rounds: the third round is decided with the first one's survival, which here
    says the drafts are worth nothing, so it is plain again (two rounds with a proposal, not
    REDECIDE_EVERY)."""
    from dspark_jax.decoding import policies
    from dspark_jax.decoding.state import RoundOutput

    rounds = []
    policy = policies.AsyncPolicy(_cadence_engine(1.0, rounds))
    for _ in range(policies.REDECIDE_EVERY):
        policy.dispatch([0], lambda: [4])
    policy.estimates[:] = 0.9  # what the slot's last read proposal promised
    for _ in range(policies.SWITCH_HOLD):
        policy.dispatch([0], lambda: [4])
    assert [k[0] for k in rounds] == ["plain"] * policies.REDECIDE_EVERY + ["topk"] * 2
    assert policy.hold == policies.SWITCH_HOLD == 2
    nothing = np.zeros((1, 4), np.float32)  # the switch's first round, read: no draft survives
    policy.observe(RoundOutput(tokens=np.zeros((1, 5), np.int32), count=np.array([1]),
                               verified=np.array([4]), accepted=np.array([0]),
                               finish=np.zeros(1, np.int32), was_active=np.array([True]),
                               conf_logits=np.zeros((1, 4), np.float32), survival=nothing), [0])
    policy.dispatch([0], lambda: [4])
    assert rounds[-1] == ("plain", 1)


def test_async_a_confirmed_switch_stands_ever_longer():
    """The same switch confirmed by its first round's survival: the decision then stands 4, 8, ...
    rounds as any repeated one."""
    from dspark_jax.decoding import policies

    rounds, searched_at = [], []
    policy = policies.AsyncPolicy(_cadence_engine(1.0, rounds))
    choose = policy.choose
    policy.choose = lambda live, rooms, **kw: searched_at.append(len(rounds)) or choose(live, rooms, **kw)
    for _ in range(policies.REDECIDE_EVERY):
        policy.dispatch([0], lambda: [4])
    policy.estimates[:] = 0.9
    for _ in range(40):
        policy.dispatch([0], lambda: [4])
    n = policies.REDECIDE_EVERY
    assert rounds[n:] == [("topk", 5)] * 40
    assert searched_at == [0, n, n + 2, n + 6, n + 14, n + 30]  # holds 2, 4, 8, 16, 32


def test_async_decision_stands_longer_while_it_repeats():
    """Proposals pay: every round proposes in the largest bucket, and the search runs ever more
    rarely (REDECIDE_EVERY doubling to REDECIDE_MAX) while its answer repeats."""
    from dspark_jax.decoding import policies

    rounds, searches = [], []
    policy = policies.AsyncPolicy(_cadence_engine(1.0, rounds))
    policy.estimates[:], policy.prior[:] = 0.9, 0.9  # what the request's drafts were worth
    choose = policy.choose
    policy.choose = lambda live, rooms, **kw: searches.append(1) or choose(live, rooms, **kw)
    for _ in range(400):
        policy.dispatch([0], lambda: [4])
    assert set(rounds) == {("topk", 5)}
    expected, total, hold = 0, 0, policies.REDECIDE_EVERY  # 4, 8, 16, 32, 32, ... rounds
    while total < 400:
        total, expected, hold = total + hold, expected + 1, min(2 * hold, policies.REDECIDE_MAX)
    assert len(searches) == expected


def test_choose_bucket_overhead_lowers_the_price_of_verifying_more():
    """A cost every round pays beyond its profiled time makes the bigger bucket worth it."""
    table = BucketTable({2: 1.0, 5: 4.0}, {1: 1.0})
    est = np.full((1, 4), 0.5)  # bucket 5: 1 + 2 tokens; bucket 2: 1.5; plain: 1
    assert table.choose(est, 1) == ("spec", 2)  # 1.5 / 1 beats 3 / 4 and 1 / 1
    assert table.choose(est, 1, overhead={"spec": 4.0, "plain": 4.0}) == ("spec", 5)  # 3/8 > 1.5/5, 1/5
    assert table.choose(est, 1, overhead={"spec": 4.0}) == ("plain", 1)  # 1 / 1 beats 3 / 8


def test_choose_bucket_margin_keeps_plain_near_break_even():
    """A proposal promising 4 % more tokens/s than the plain round loses to it under a 5 % margin;
    one promising 10 % more wins."""
    table = BucketTable({2: 1.0}, {1: 1.0})
    assert table.choose(np.full((1, 1), 0.04), 1) == ("spec", 2)
    assert table.choose(np.full((1, 1), 0.04), 1, margin=0.05) == ("plain", 1)
    assert table.choose(np.full((1, 1), 0.10), 1, margin=0.05) == ("spec", 2)


def test_choose_bucket_scale_discounts_the_estimated_drafts():
    """Estimates that have lately delivered 40 % of their sum no longer pay for the proposal."""
    table = BucketTable({5: 2.0}, {1: 1.0})
    est = np.full((1, 4), 0.5)  # bucket 5: (1 + 2) / 2 s beats plain's 1 / 1 s
    assert table.choose(est, 1) == ("spec", 5)
    assert table.choose(est, 1, scale=0.4) == ("plain", 1)  # (1 + 0.8) / 2 s


def test_async_scale_is_what_the_priced_proposals_delivered():
    """The head's survival says 0.9 a draft, and its rounds are then read back with no draft
    accepted (estimates that are stale by the time the search uses them). Each proposal is
    paired with the round that reads it back, plain rounds with none; the scale falls as
    (accepted + PRICE_PRIOR) / (priced + PRICE_PRIOR) until proposals no longer pay."""
    from dspark_jax.decoding import policies
    from dspark_jax.decoding.state import RoundOutput

    rounds = []
    policy = policies.AsyncPolicy(_cadence_engine(1.6, rounds))
    policy.correction = lambda: np.ones(4)  # the per-position correction is tested apart
    policy.estimates[:] = 0.9
    priced = delivered = 0.0
    kinds = []
    for t in range(60):
        policy.dispatch([0], lambda: [4])
        kinds.append(rounds[-1][0])
        if t:  # one round in flight: round t - 1 is read after round t was dispatched
            spec = kinds[-2] == "topk"
            policy.observe(RoundOutput(
                tokens=np.zeros((1, 5), np.int32), count=np.array([1]),
                verified=np.array([4 if spec else 0]), accepted=np.array([0]),
                finish=np.zeros(1, np.int32), was_active=np.array([True]),
                conf_logits=np.zeros((1, 4 if spec else 0), np.float32),
                survival=np.full((1, 4 if spec else 0), 0.9, np.float32)), [0])
            if spec:
                priced = policy.DECAY * priced + 3.6
                delivered = policy.DECAY * delivered
        assert policy.scale() == pytest.approx((delivered + policy.PRICE_PRIOR)
                                               / (priced + policy.PRICE_PRIOR), rel=1e-6)
    first_plain = kinds.index("plain")
    assert 10 < first_plain < 60 and set(kinds[first_plain:]) == {"plain"}
    # It flipped at the first decision where 1 + 3.6 x scale fell below 1.6 s x 1.05 tokens/s.
    assert policy.scale() < (1.6 * (1 + policy.MARGIN) - 1) / 3.6


def test_async_measures_the_overhead_between_dispatches():
    """The async policy's overhead: the wall time between dispatches beyond the profiled round,
    averaged per kind of round; idle gaps are clipped and a new generate call does not count the
    time since the last."""
    from dspark_jax.decoding import policies

    rounds, now = [], [0.0]
    policy = policies.AsyncPolicy(_cadence_engine(1.0, rounds))
    policy.clock = lambda: now[0]
    policy.starting()
    policy.estimates[:] = 0.9  # proposals pay
    for _ in range(200):
        policy.dispatch([0], lambda: [4])
        now[0] += 1.0 + 0.25  # the profile says 1.0 for every bucket
    assert rounds[-1][0] == "topk"  # every round proposes here: only that kind was measured
    assert policy.overhead["spec"] == pytest.approx(0.25, rel=1e-6) and policy.overhead["plain"] == 0
    now[0] += 1000.0  # idle: clipped to OVERHEAD_CAP x the round
    policy.dispatch([0], lambda: [4])
    assert policy.overhead["spec"] == pytest.approx(0.9 * 0.25 + 0.1 * policy.OVERHEAD_CAP, rel=1e-6)
    before = dict(policy.overhead)
    policy.starting()
    now[0] += 1000.0
    policy.dispatch([0], lambda: [4])  # the first of a run: nothing to measure yet
    assert policy.overhead == before


def _replay_dispatches(kinds, took):
    """An async policy timing rounds of `kinds` that take `took[kind]` seconds (profiled: 1 s) as
    `Engine.generate` dispatches them, one in flight: dispatch(t) = finish(t - 2). Yields
    (t, policy) after each dispatch."""
    from dspark_jax.decoding import policies

    finish = np.cumsum([took[k] for k in kinds])
    policy = policies.AsyncPolicy(_cadence_engine(1.0, []))
    now = [0.0]
    policy.clock = lambda: now[0]
    policy.starting()
    for t, kind in enumerate(kinds):
        now[0] = finish[t - 2] if t >= 2 else 0.0
        policy._time_round(1.0, kind)
        yield t, policy


def test_async_charges_each_round_its_own_wall_time():
    """With one round in flight, the host dispatches round t+1 and then waits for round t before it
    dispatches t+2 (`Engine.generate`): dispatch(t) = finish(t - 2). Rounds with a proposal that
    really take 2.5 s where the profile says 1 s, between plain rounds that take the profiled 1 s:
    the overhead is the proposal's (1.5 s) and none of it is the plain rounds'. Charging the gap
    to the round just dispatched would swap the two (sparse proposals would look free)."""
    rng = np.random.default_rng(0)
    kinds = ["spec" if k else "plain" for k in rng.random(400) < 0.2]
    for _, policy in _replay_dispatches(kinds, {"spec": 2.5, "plain": 1.0}):
        pass
    assert policy.overhead["spec"] == pytest.approx(1.5, rel=1e-3)
    assert policy.overhead["plain"] == pytest.approx(0.0, abs=1e-9)


def test_async_overhead_counts_its_first_measurement_whole():
    """Plain rounds that take 0.3 s more than profiled, then one proposal that takes 1.5 s more:
    before any proposal has run, the search prices proposals at the plain rounds' 0.3 s; right
    after the one proposal, at its own 1.5 s (an average started at 0 would say 0.15 s, and the
    rare proposals of a plain-heavy load would look nearly free)."""
    kinds = ["plain"] * 12 + ["spec"] + ["plain"] * 3
    for t, policy in _replay_dispatches(kinds, {"spec": 2.5, "plain": 1.3}):
        if t == 0:  # nothing measured: the profile's word
            assert policy.overheads() == {"spec": 0.0, "plain": 0.0}
        if t == 12:  # the proposal dispatched, not yet measured
            assert policy.overheads() == pytest.approx({"spec": 0.3, "plain": 0.3}, rel=1e-6)
    assert policy.overheads() == pytest.approx({"spec": 1.5, "plain": 0.3}, rel=1e-6)


def test_async_overhead_corrects_a_profile_that_overstates_the_rounds():
    """A profile measured on a busy machine (1 s a round) where plain rounds now take 0.7 s: their
    figure goes to -0.3 s, so the search prices them at what they cost; rounds far faster than
    profiled are taken at half their profile at most."""
    kinds = ["plain"] * 40
    for _, policy in _replay_dispatches(kinds, {"spec": 1.0, "plain": 0.7}):
        pass
    assert policy.overheads()["plain"] == pytest.approx(-0.3, rel=1e-6)
    for _, policy in _replay_dispatches(kinds, {"spec": 1.0, "plain": 0.1}):
        pass
    assert policy.overheads()["plain"] == pytest.approx(-policy.OVERHEAD_FLOOR, rel=1e-6)


def test_choose_bucket_negative_overhead_makes_the_plain_round_win():
    """Plain rounds faster than profiled beat a proposal the profile alone would choose; a negative
    figure never prices a bucket below half its profiled time."""
    table = BucketTable({2: 1.0}, {1: 1.0})
    est = np.full((1, 1), 0.3)  # the proposal: 1.3 tokens a round
    assert table.choose(est, 1) == ("spec", 2)
    assert table.choose(est, 1, overhead={"plain": -0.3}) == ("plain", 1)  # 1 / 0.7 > 1.3 / 1
    # -5 s would make the plain round free; it is taken at 0.5 s, and so is the proposal
    assert table.choose(est, 1, overhead={"spec": -5.0, "plain": -5.0}) == ("spec", 2)


def test_async_does_not_sample_an_interval_that_waited_for_a_prefill():
    """Plain rounds that take 0.2 s more than profiled; every fifth dispatch admits a request
    whose prefill (3 s) the next interval also waits for. The prefills are left out: the plain
    rounds' overhead is their own 0.2 s, not 0.2 + 3 / 5."""
    from dspark_jax.decoding import policies

    rounds, now = [], [0.0]
    policy = policies.AsyncPolicy(_cadence_engine(100.0, rounds))
    policy.clock = lambda: now[0]
    policy.starting()
    prefill = 0.0
    for t in range(60):
        now[0] += 1.2 + prefill  # the interval this dispatch closes
        prefill = 0.0
        if t % 5 == 0:
            policy.admitted(0)
            prefill = 3.0  # run on the device before the round dispatched now finishes
        policy.dispatch([0], lambda: [4])
    assert "plain" in {key[0] for key in rounds}
    assert policy.overhead["plain"] == pytest.approx(0.2, rel=1e-6)


def test_async_a_stale_overhead_cannot_shut_a_kind_out():
    """Plain rounds once measured 2 s dearer than profiled (a pause, say), then proposals that
    deliver nothing, each taking exactly its profiled time: priced at the stale 2 s the plain
    round never wins again and is never measured again. After STALE_ROUNDS rounds its figure
    falls to the proposals' 0 s, plain rounds win, and their own figure is measured afresh."""
    from dspark_jax.decoding import policies
    from dspark_jax.decoding.state import RoundOutput

    rounds, now = [], [0.0]
    policy = policies.AsyncPolicy(_cadence_engine(1.6, rounds))
    policy.clock = lambda: now[0]
    policy.starting()
    policy.estimates[:] = 0.9  # what the head says until the first proposal is read
    policy.overhead = {"spec": 0.0, "plain": 2.0}
    policy.overhead_weight = {"spec": 0.0, "plain": 1.0}
    kinds, took = [], {"spec": 1.6, "plain": 1.0}
    for t in range(2 * policies.AsyncPolicy.STALE_ROUNDS):
        if t >= 2:  # one round in flight: round t is dispatched when round t - 2 has finished
            now[0] += took[kinds[t - 2]]
        policy.dispatch([0], lambda: [4])
        kinds.append("plain" if rounds[-1][0] == "plain" else "spec")
        if t and kinds[-1] == "spec":
            policy.observe(RoundOutput(
                tokens=np.zeros((1, 5), np.int32), count=np.array([1]), verified=np.array([4]),
                accepted=np.array([0]), finish=np.zeros(1, np.int32), was_active=np.array([True]),
                conf_logits=np.zeros((1, 4), np.float32),
                survival=np.full((1, 4), 0.9, np.float32)), [0])
    first_plain = kinds.index("plain")
    assert set(kinds[:first_plain]) == {"spec"}
    assert policies.AsyncPolicy.STALE_ROUNDS < first_plain <= policies.AsyncPolicy.STALE_ROUNDS + 40
    assert kinds[-1] == "plain" and policy.overhead["plain"] < 0.5


def test_async_starts_every_generate_call_from_scratch():
    """What one call taught the policy about its drafts (a drafter whose proposals delivered
    nothing, say, or a load that later changed drafter) does not decide the next call's rounds:
    `starting` forgets it, and keeps the measured overheads, which describe the machine."""
    from dspark_jax.decoding import policies
    from dspark_jax.decoding.state import RoundOutput

    rounds = []
    policy = policies.AsyncPolicy(_cadence_engine(1.6, rounds))
    policy.starting()
    policy.admitted(0)
    for t in range(60):
        policy.dispatch([0], lambda: [4])
        if t:
            policy.observe(RoundOutput(
                tokens=np.zeros((1, 5), np.int32), count=np.array([1]), verified=np.array([4]),
                accepted=np.array([0]), finish=np.zeros(1, np.int32), was_active=np.array([True]),
                conf_logits=np.zeros((1, 4), np.float32),
                survival=np.full((1, 4), 0.9, np.float32)), [0])
    assert rounds[-1][0] == "plain" and policy.scale() < 0.5
    overhead = dict(policy.overhead)
    policy.starting()
    assert policy.scale() == 1.0 and policy.overhead == overhead
    np.testing.assert_array_equal(policy.correction(), np.ones(4))
    policy.admitted(0)
    policy.dispatch([0], lambda: [4])
    assert rounds[-1][0] == "topk"  # the new request is probed: learn this call's drafts


def test_async_probes_joiners_only_when_they_could_change_the_decision():
    """Proposals priced out by what the requests so far drafted (survival 0.2 a position): a probe
    for the requests that joined since only when, their mean worth JOINER_Z standard errors above
    that prior, a proposal would pay. One joiner can be far better than the mean; the mean of
    eight cannot, unless the requests' survival spreads widely."""
    from types import SimpleNamespace

    from dspark_jax.decoding import policies
    from dspark_jax.decoding.state import RoundOutput

    R, gamma = 8, 4
    spec = {F: 2.0 for F in (2, 5, 16, 24, 40)}  # a proposal pays from 0.275 a position on
    profile = SimpleNamespace(spec=spec, plain={1: 1.0, 8: 1.0})

    def first_round(survival, live):
        rounds = []
        engine = SimpleNamespace(R=R, gamma=gamma, shape=SimpleNamespace(pending=16),
                                 spec_buckets=sorted(spec), plain_buckets=[1, 8], profile=profile,
                                 run_round=lambda key: rounds.append(key), flush=lambda: None)
        policy = policies.AsyncPolicy(engine)
        a = np.repeat(np.asarray(survival, np.float32)[:, None], gamma, 1)  # [R, γ]
        zeros = np.zeros(R, np.int32)
        policy.observe(RoundOutput(tokens=np.zeros((R, gamma + 1), np.int32), count=zeros + 1,
                                   verified=zeros, accepted=zeros, finish=zeros,
                                   was_active=np.ones(R, bool),
                                   conf_logits=np.zeros((R, gamma), np.float32), survival=a), [])
        for slot in live:  # the requests read above finished; these joined
            policy.admitted(slot)
        policy.dispatch(live, lambda: [gamma] * len(live))
        return rounds[0]

    narrow = [0.1, 0.1, 0.2, 0.2, 0.3, 0.3, 0.2, 0.2]  # mean 0.2, std 0.076
    wide = [0.0, 0.0, 0.0, 0.0, 0.4, 0.4, 0.4, 0.4]  # mean 0.2, std 0.214
    # 0.2 + 2 x 0.076: a proposal could pay (in bucket 5); the probe is the cheapest proposal
    assert first_round(narrow, [0]) == ("topk", 2)
    assert first_round(narrow, list(range(R)))[0] == "plain"  # 0.2 + 2 x 0.076 / √8: it cannot
    assert first_round(wide, list(range(R))) == ("topk", 16)  # 0.2 + 2 x 0.214 / √8: it could


def test_async_processes_whose_clocks_disagree_decide_in_the_same_rounds(monkeypatch):
    """In a job of several processes every decision is process 0's, broadcast, and each process
    must enter that broadcast in the same rounds or the job hangs. Here two policies run in
    lockstep as processes 0 and 1 of one job, the lead's measured overhead making proposals look
    far cheaper than the follower's, and requests join so that whether to probe them is itself a
    priced question (yes for the lead, no for the follower): both dispatch the same rounds and
    meet at every broadcast."""
    from types import SimpleNamespace

    from dspark_jax.decoding import policies

    R, gamma = 8, 4
    spec = {F: 2.0 for F in (2, 5, 16, 24, 40)}
    profile = SimpleNamespace(spec=spec, plain={1: 1.0, 8: 1.0})
    sent, calls, rounds = [], {"lead": 0, "follower": 0}, {"lead": [], "follower": []}
    who = [None]

    def from_lead(values):
        calls[who[0]] += 1
        if who[0] == "lead":
            sent.append(np.asarray(values, np.int32))
            return sent[-1]
        assert sent, "the follower waits in a broadcast the lead never entered: the job would hang"
        return sent.pop(0)

    monkeypatch.setattr(policies.jax, "process_count", lambda: 2)
    monkeypatch.setattr(policies.distributed, "from_lead", from_lead)
    pair = {}
    for name in ("lead", "follower"):
        engine = SimpleNamespace(R=R, gamma=gamma, shape=SimpleNamespace(pending=16),
                                 spec_buckets=sorted(spec), plain_buckets=[1, 8], profile=profile,
                                 run_round=rounds[name].append, flush=lambda: None)
        pair[name] = policies.AsyncPolicy(engine)
    pair["lead"].overhead = {"spec": -1.0, "plain": 2.0}  # its clock: proposals cost nothing
    pair["lead"].overhead_weight = {"spec": 1.0, "plain": 1.0}
    narrow = np.array([0.1, 0.1, 0.2, 0.2, 0.3, 0.3, 0.2, 0.2])  # worth none to the follower
    for policy in pair.values():
        policy.estimates[:] = narrow[:, None]
        policy.prior[:], policy.spread = 0.2, np.full(gamma, 0.076)
    live = list(range(R))
    for t in range(200):
        for name in ("lead", "follower"):
            who[0] = name
            if t % 25 == 0:  # every request finished; eight joined
                for slot in live:
                    pair[name].admitted(slot)
            pair[name].dispatch(live, lambda: [gamma] * R)
        assert calls["lead"] == calls["follower"] and not sent, f"round {t}"
    assert rounds["lead"] == rounds["follower"]
    assert calls["lead"] > 10
