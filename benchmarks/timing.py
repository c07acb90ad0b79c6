"""Timing shared by the benchmark scripts."""

import time

import jax
import numpy as np


def median_time(fn, repeats: int) -> float:
    """Median seconds of `fn()` (device work included) over `repeats` calls, after one warm-up call
    that absorbs compilation."""
    jax.block_until_ready(fn())
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t)
    return float(np.median(times))
