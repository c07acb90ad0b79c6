"""The device mesh and the one table from logical axis names to mesh axes.

Every array in the project describes its dimensions with logical names (`vocab`, `embed`, `heads`,
...). `LOGICAL_AXIS_RULES` is the only place that says how those names map onto the mesh axes
`data`, `fsdp`, `tensor`. A logical name missing from the table, a mesh axis used twice in one array,
or a dimension that the mesh does not divide is an error, never a silent replication.
"""

from __future__ import annotations

import math
from typing import Mapping, Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from dspark_jax.config import MeshConfig
from dspark_jax.errors import ConfigError

MESH_AXES = ("data", "fsdp", "tensor")

# Logical axis -> mesh axis (or tuple of axes, or None for replicated).
LOGICAL_AXIS_RULES: Mapping[str, str | tuple[str, ...] | None] = {
    "batch": ("data", "fsdp"),  # sequences / requests
    "seq": None,
    "vocab": "tensor",
    "embed": "fsdp",
    "heads": "tensor",
    "kv_heads": "tensor",
    "head_dim": None,
    "mlp": "tensor",
    "layers": None,
    "norm": None,  # 1-D norm weights: tiny, replicated
    "taps": None,  # concatenated tapped features [m*d]
    "rank": None,  # Markov head rank
    "cache_seq": None,
}


def constrain(x: jax.Array, sharding: NamedSharding | None) -> jax.Array:
    """`x` laid out by `sharding` inside a jitted function (unchanged when None). For activations
    whose layout propagation would take from a weight: an embedding lookup leaves its rows sharded
    like the table's model dimension (over `fsdp`) rather than by batch."""
    return x if sharding is None else jax.lax.with_sharding_constraint(x, sharding)


def make_mesh(cfg: MeshConfig, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A (data, fsdp, tensor) mesh over `devices` (default: all devices of all processes)."""
    devices = list(jax.devices() if devices is None else devices)
    sizes = [cfg.data, cfg.fsdp, cfg.tensor]
    known = math.prod(s for s in sizes if s != -1)
    if -1 in sizes:
        if len(devices) % known:
            raise ConfigError(f"mesh: {len(devices)} devices are not divisible by the fixed axes "
                              f"{dict(zip(MESH_AXES, sizes))}")
        sizes[sizes.index(-1)] = len(devices) // known
    if -1 not in sizes and math.prod(sizes) < len(devices):
        devices = devices[: math.prod(sizes)]  # a fully specified mesh may use fewer devices
    if math.prod(sizes) != len(devices):
        raise ConfigError(f"mesh: axes {dict(zip(MESH_AXES, sizes))} need {math.prod(sizes)} devices, "
                          f"but {len(devices)} are available")
    return Mesh(np.asarray(devices).reshape(sizes), MESH_AXES)


def logical_to_spec(axes: Sequence[str | None], rules=LOGICAL_AXIS_RULES) -> PartitionSpec:
    """PartitionSpec for logical `axes`; a mesh axis may shard at most one dimension."""
    spec, used = [], {}
    for name in axes:
        if name is None:
            spec.append(None)
            continue
        if name not in rules:
            raise ConfigError(f"logical axis {name!r} has no sharding rule; known: {sorted(rules)}")
        mesh_axes = rules[name]
        for m in (mesh_axes,) if isinstance(mesh_axes, str) else (mesh_axes or ()):
            if m in used:
                raise ConfigError(f"sharding rules map both {used[m]!r} and {name!r} of axes "
                                  f"{tuple(axes)} onto mesh axis {m!r}")
            used[m] = name
        spec.append(mesh_axes)
    return PartitionSpec(*spec)


def named_sharding(mesh: Mesh, axes: Sequence[str | None], shape: Sequence[int] | None = None,
                   what: str = "array") -> NamedSharding:
    """NamedSharding for logical `axes`; with `shape`, checks every sharded dimension divides."""
    spec = logical_to_spec(axes)
    if shape is not None:
        for dim, (size, part) in enumerate(zip(shape, spec)):
            if part is None:
                continue
            parts = (part,) if isinstance(part, str) else part
            n = math.prod(mesh.shape[p] for p in parts)
            if size % n:
                raise ConfigError(f"{what}: dimension {dim} ({axes[dim]}, size {size}) is not "
                                  f"divisible by mesh axes {parts} of total size {n}")
    return NamedSharding(mesh, spec)


def describe_mesh(mesh: Mesh) -> str:
    """One line naming the platform, device count and axis sizes, for run logs."""
    d = mesh.devices.flat[0]
    return (f"mesh {dict(mesh.shape)} over {mesh.devices.size} {d.platform} devices "
            f"({jax.process_count()} processes)")
