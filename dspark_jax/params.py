"""One description per parameter tensor, and everything derived from it.

A model's parameters are described once as a pytree of `ArrayInfo` (shape, dtype, logical axes,
initializer). Random init, shardings, abstract shapes for checkpoint restore and the checkpoint
converters all derive from that tree, so they cannot disagree.
"""

from __future__ import annotations

import dataclasses
import zlib
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from dspark_jax.sharding import named_sharding


@dataclasses.dataclass(frozen=True)
class ArrayInfo:
    """Shape, dtype, logical axes and initializer of one parameter."""

    shape: tuple[int, ...]
    dtype: Any
    axes: tuple[str | None, ...]
    init: str = "normal"  # normal | zeros | ones
    scale: float = 0.02  # stddev for `normal`

    def __post_init__(self):
        assert len(self.shape) == len(self.axes), (self.shape, self.axes)


def is_info(x) -> bool:
    return isinstance(x, ArrayInfo)


def path_name(path) -> str:
    """'layers/wq' for a pytree key path."""
    return "/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)


def map_infos(fn: Callable[[str, ArrayInfo], Any], spec) -> Any:
    """Maps fn(path_name, info) over a spec tree."""
    return jax.tree_util.tree_map_with_path(lambda p, i: fn(path_name(p), i), spec, is_leaf=is_info)


def shardings(spec, mesh: Mesh):
    """The NamedSharding of every parameter (checks divisibility, names the parameter)."""
    return map_infos(lambda name, i: named_sharding(mesh, i.axes, i.shape, what=name), spec)


def abstract(spec, mesh: Mesh | None = None):
    """jax.ShapeDtypeStruct tree (with shardings when a mesh is given), e.g. for orbax restore."""
    if mesh is None:
        return map_infos(lambda _, i: jax.ShapeDtypeStruct(i.shape, i.dtype), spec)
    shard = shardings(spec, mesh)
    return jax.tree.map(lambda i, s: jax.ShapeDtypeStruct(i.shape, i.dtype, sharding=s),
                        spec, shard, is_leaf=is_info)


def _init_one(name: str, info: ArrayInfo, key: jax.Array) -> jax.Array:
    if info.init == "zeros":
        return jnp.zeros(info.shape, info.dtype)
    if info.init == "ones":
        return jnp.ones(info.shape, info.dtype)
    assert info.init == "normal", info.init
    # Fold in a stable hash of the name so adding a parameter does not change the others.
    k = jax.random.fold_in(key, zlib.crc32(name.encode()) & 0x7FFFFFFF)
    return (info.scale * jax.random.normal(k, info.shape, jnp.float32)).astype(info.dtype)


def init_params(spec, key: jax.Array, mesh: Mesh | None = None):
    """Random parameters, created directly with their shardings (never a full copy per device)."""
    fn = lambda k: map_infos(lambda name, i: _init_one(name, i, k), spec)
    if mesh is None:
        return jax.jit(fn)(key)
    return jax.jit(fn, out_shardings=shardings(spec, mesh))(key)


def count_params(tree) -> int:
    return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(tree))
