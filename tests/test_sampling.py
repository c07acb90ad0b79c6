"""Sampling filters and schedulers, by hand."""

import jax.numpy as jnp
import numpy as np

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
