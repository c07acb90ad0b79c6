"""Joining a multi-process (multi-host) job, and decisions all processes must take together."""

from __future__ import annotations

import jax
import numpy as np
from jax.experimental import multihost_utils


def initialize(coordinator: str | None = None, num_processes: int | None = None,
               process_id: int | None = None, *, timeout_s: int = 300) -> None:
    """jax.distributed.initialize before any device is touched.

    Without arguments jax detects the cluster (TPU pods, SLURM, ...). On CPU the collectives go
    through gloo. The coordinator binds only its own address, not every interface.
    """
    if jax.config.jax_platforms in (None, "", "cpu") or "cpu" in str(jax.config.jax_platforms):
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    kwargs = {"initialization_timeout": timeout_s}
    if coordinator is not None:
        kwargs["coordinator_bind_address"] = coordinator
    jax.distributed.initialize(coordinator, num_processes, process_id, **kwargs)


def any_process(flag: bool) -> bool:
    """True in every process if `flag` is true in any (a collective: all processes must call it)."""
    if jax.process_count() == 1:
        return bool(flag)
    return bool(np.any(multihost_utils.process_allgather(np.asarray([flag], np.int32))))
