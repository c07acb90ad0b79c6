"""Sampling filters and schedulers, by hand."""

import jax.numpy as jnp
import numpy as np
import pytest

from dspark_jax.decoding.sampling import target_probs
from dspark_jax.decoding.schedulers import SchedulerConfig, schedule, survival

P = np.array([0.5, 0.3, 0.15, 0.05])


def probs(temperature, top_p, top_k, p=P):
    rows = len(temperature)
    logits = jnp.log(jnp.tile(jnp.asarray(p), (rows, 1)))
    return np.asarray(target_probs(logits, jnp.asarray(temperature, jnp.float32),
                                   jnp.asarray(top_p, jnp.float32), jnp.asarray(top_k, jnp.int32)))


def test_filters_per_row():
    out = probs([1.0, 1.0, 1.0, 1.0, 0.0], [1.0, 0.7, 0.85, 0.5, 0.1], [0, 0, 0, 0, 2])
    np.testing.assert_allclose(out[0], P, atol=1e-6)  # no filter
    np.testing.assert_allclose(out[1], [0.625, 0.375, 0, 0], atol=1e-6)  # top-p 0.7: {0, 1}
    np.testing.assert_allclose(out[2], [0.5, 0.3, 0.15, 0] / np.float32(0.95), atol=1e-6)
    np.testing.assert_allclose(out[3], [1, 0, 0, 0], atol=1e-6)  # mass 0.5 reaches top-p 0.5
    np.testing.assert_array_equal(out[4], [1, 0, 0, 0])  # greedy ignores the filters


def test_top_k_and_temperature():
    out = probs([1.0, 0.5, 2.0], [1.0, 1.0, 1.0], [3, 0, 1])
    np.testing.assert_allclose(out[0], [0.5, 0.3, 0.15, 0] / np.float32(0.95), atol=1e-6)
    sharp = P ** 2 / np.sum(P ** 2)
    np.testing.assert_allclose(out[1], sharp, atol=1e-6)
    np.testing.assert_allclose(out[2], [1, 0, 0, 0], atol=1e-6)


def test_schedulers_edge_cases():
    c = jnp.asarray([[0.9, 0.8, 0.2, 0.9],   # cut at the first low confidence
                     [0.1, 0.9, 0.9, 0.9],   # nothing verified
                     [0.9, 0.9, 0.9, 0.9]])  # everything verified
    np.testing.assert_array_equal(schedule(SchedulerConfig("threshold", 0, 0.5), c), [2, 0, 4])
    np.testing.assert_array_equal(schedule(SchedulerConfig("fixed", 0), c), [4, 4, 4])
    np.testing.assert_array_equal(schedule(SchedulerConfig("fixed", 2), c), [2, 2, 2])
    assert SchedulerConfig("fixed", 9).max_len(4) == 4 and SchedulerConfig("threshold").max_len(4) == 4
    np.testing.assert_allclose(survival(c)[0], [0.9, 0.72, 0.144, 0.1296], atol=1e-6)


def test_top_p_is_measured_on_the_renormalised_top_k_set():
    """top-k 2 renormalises (0.5, 0.3) to (0.625, 0.375); top-p 0.6 is reached by the first token
    alone. (Measured on the unfiltered distribution, 0.5 < 0.6 would keep both.)"""
    out = probs([1.0, 1.0], [0.6, 0.6], [2, 0])
    np.testing.assert_allclose(out[0], [1, 0, 0, 0], atol=1e-6)
    np.testing.assert_allclose(out[1], [0.625, 0.375, 0, 0], atol=1e-6)  # top-p alone: {0, 1}


def test_a_rows_distribution_does_not_depend_on_its_batch_mates():
    """Bit for bit: an unfiltered row next to an unfiltered row, or next to rows that filter. Its
    long tail (float32 cumulative mass reaches 1 before the last tokens) must survive."""
    rng = np.random.default_rng(0)
    V = 32768
    peaked = rng.normal(0, 1, (1, V))
    peaked[0, 7] = 30.0  # its probability rounds to 1.0 in float32; the tail is ~1e-13 each
    logits = jnp.asarray(np.concatenate([peaked, rng.normal(0, 1, (3, V))]), jnp.float32)
    t = jnp.ones(4, jnp.float32)
    alone = target_probs(logits, t, jnp.ones(4), jnp.zeros(4, jnp.int32))
    mixed = target_probs(logits, t, jnp.asarray([1.0, 0.5, 1.0, 0.9]), jnp.asarray([0, 0, 5, 0]))
    assert np.array_equal(np.asarray(alone[0]), np.asarray(mixed[0]))
    assert np.count_nonzero(np.asarray(mixed[0])) == np.count_nonzero(np.asarray(alone[0])) > V - 10
    assert np.count_nonzero(np.asarray(mixed[2])) == 5


def test_greedy_batch_mates_change_no_rows_bits_and_greedy_rows_are_one_hot():
    """A batch computes only the distributions its rows need (a greedy batch skips the softmax,
    a sampling one the one-hot); every row's bits are the same in a greedy, a sampling and a
    mixed batch, eagerly and under jit."""
    import jax

    rng = np.random.default_rng(1)
    logits = jnp.asarray(rng.normal(0, 3, (4, 2, 512)), jnp.float32)
    logits = logits.at[1, 0, 5].set(logits[1, 0, 9]).at[1, 0, 9].set(50.0).at[1, 0, 5].set(50.0)
    ones, off = jnp.ones((4, 1), jnp.float32), jnp.zeros((4, 1), jnp.int32)
    for fn in (target_probs, jax.jit(target_probs)):
        hot = np.asarray(fn(logits, 0 * ones, ones, off))
        soft = np.asarray(fn(logits, ones, ones, off))
        mixed = np.asarray(fn(logits, jnp.asarray([[1.0], [0.0], [1.0], [0.0]]), ones, off))
        np.testing.assert_array_equal(mixed[[0, 2]], soft[[0, 2]])
        np.testing.assert_array_equal(mixed[[1, 3]], hot[[1, 3]])
        np.testing.assert_array_equal(hot.argmax(-1), np.asarray(logits).argmax(-1))
        assert hot[1, 0, 5] == 1.0  # a tie goes to the first maximum, as argmax
        np.testing.assert_array_equal(hot.sum(-1), 1.0)


def test_first_argmax_is_argmax():
    from dspark_jax.models.layers import first_argmax

    rng = np.random.default_rng(2)
    x = rng.integers(0, 4, (64, 33)).astype(np.float32)  # many ties
    x[0] = -np.inf
    x[1, 7] = np.inf
    np.testing.assert_array_equal(first_argmax(jnp.asarray(x)), x.argmax(-1))


def test_requests_validate_their_sampling_parameters():
    from dspark_jax.decoding.engine import Request
    from dspark_jax.errors import DSparkError

    for kwargs, message in [({"top_p": 0.0}, r"top_p 0.0 must be in \(0, 1\]"),
                            ({"top_p": 1.5}, r"top_p 1.5 must be in \(0, 1\]"),
                            ({"temperature": float("nan")}, "temperature nan must be a finite number"),
                            ({"temperature": -0.5}, "temperature -0.5 must be a finite number >= 0"),
                            ({"top_k": -1}, "top_k -1 must be an integer >= 0"),
                            ({"seed": -3}, r"seed -3 must be an integer in \[0, 2\^32\)")]:
        with pytest.raises(DSparkError, match=f"request r7: {message}"):
            Request(id="r7", prompt_ids=(1, 2), max_new_tokens=4, **kwargs)
    assert Request(id="x", prompt_ids=(1,), max_new_tokens=1).stream == \
        Request(id="x", prompt_ids=(2,), max_new_tokens=9).stream  # a stable hash of the id
    assert Request(id="x", prompt_ids=(1,), max_new_tokens=1, seed=5).stream == 5


def test_the_full_load_budget_counts_the_rounds_read_before_the_queue_ran_dry():
    from dspark_jax.decoding.metrics import Tally

    tally = Tally(gamma=3)
    tally.round("spec", 8, 4)  # 1 draft per request beyond the anchors
    tally.round("plain", 4, 4)
    tally.queue_empty()  # the drain: fewer live requests, longer proposals
    tally.round("spec", 8, 2)
    tally.queue_empty()  # only the first call counts
    tally.round("spec", 2, 1)
    summary = tally.summary()
    assert summary["full_load_mean_budget"] == pytest.approx((1 + 0) / 2)
    assert summary["mean_budget"] == pytest.approx((1 + 0 + 3 + 1) / 4)
    assert Tally(gamma=3).summary()["full_load_mean_budget"] is None  # the queue never ran dry


def test_conditional_acceptance_divides_by_the_rounds_that_reached_the_draft():
    """(ℓ, k) = (3, 3), (3, 1), (3, 0), (2, 2): draft 2 was reached (verified, draft 1 accepted) in
    three rounds and accepted in two; draft 3 reached in one and accepted in it."""
    from dspark_jax.decoding.metrics import Tally

    tally = Tally(gamma=3)
    for ell, k in [(3, 3), (3, 1), (3, 0), (2, 2)]:
        tally.slot(committed=k + 1, verified=ell, accepted=k)
    summary = tally.summary()
    np.testing.assert_allclose(summary["conditional_acceptance"], [3 / 4, 2 / 3, 1 / 1])
    assert summary["acceptance_rate"] == pytest.approx(6 / 11)
