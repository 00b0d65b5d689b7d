"""Parameter creation with logical axis names."""

from __future__ import annotations

from collections.abc import Sequence

import jax.numpy as jnp
from flax import nnx

DEFAULT_INIT = nnx.initializers.normal(stddev=0.02)


def _param(value, names) -> nnx.Param:
    # Eager sharding is off: models build the same with or without a mesh, and sharded init places
    # parameters through jit out_shardings derived from this metadata (jaxpar.train.state).
    return nnx.Param(value, out_sharding=tuple(names), eager_sharding=False)


def param(rngs: nnx.Rngs, shape: Sequence[int], names: Sequence[str | None], *, dtype, init=DEFAULT_INIT) -> nnx.Param:
    """An ``nnx.Param`` whose ``out_sharding`` metadata holds the logical names of its dimensions."""
    if len(shape) != len(names):
        raise ValueError(f"param: shape {tuple(shape)} and logical names {tuple(names)} differ in rank")
    return _param(init(rngs.params(), tuple(shape), jnp.dtype(dtype)), names)


def ones(shape: Sequence[int], names: Sequence[str | None], *, dtype) -> nnx.Param:
    return _param(jnp.ones(tuple(shape), jnp.dtype(dtype)), names)


def zeros(shape: Sequence[int], names: Sequence[str | None], *, dtype) -> nnx.Param:
    return _param(jnp.zeros(tuple(shape), jnp.dtype(dtype)), names)
