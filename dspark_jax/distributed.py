"""Joining a multi-process (multi-host) job, and decisions all processes must take together."""

from __future__ import annotations

import json

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


def wait_for_all(name: str, timeout_s: int = 3600) -> None:
    """Returns when every process of the job has called it with `name` (the coordination service's
    barrier, not a device collective). Before the first collective after a long local phase, such
    as compiling every program: the processes finish it minutes apart on a busy machine, and a
    CPU (gloo) collective waits only 30 s for its peers when it first sets up."""
    if jax.process_count() == 1:
        return
    from orbax.checkpoint import multihost

    _barriers[name] = _barriers.get(name, 0) + 1  # a barrier's id must be new each time
    multihost.get_barrier_sync_fn()(key=f"dspark {name} {_barriers[name]}",
                                    timeout_ms=timeout_s * 1000)


_barriers: dict[str, int] = {}


def is_lead() -> bool:
    """Whether this process is the one that writes a job's files and prints its progress."""
    return jax.process_index() == 0


def from_lead(values) -> np.ndarray:
    """Process 0's `values` (an int32 array of a shape every process passes alike), in every
    process (a collective). For host decisions that must not differ between the processes of a
    job, such as ones that read the host's clock."""
    values = np.asarray(values, np.int32)
    if jax.process_count() == 1:
        return values
    return np.asarray(multihost_utils.broadcast_one_to_all(values))


def share_json(obj):
    """Process 0's JSON-serialisable `obj`, in every process (a collective; what the others pass
    is ignored)."""
    if jax.process_count() == 1:
        return obj
    data = json.dumps(obj).encode() if is_lead() else b""
    size = int(from_lead([len(data)])[0])
    buf = np.zeros(size, np.uint8)
    buf[:len(data)] = np.frombuffer(data, np.uint8)
    return json.loads(bytes(multihost_utils.broadcast_one_to_all(buf)))
