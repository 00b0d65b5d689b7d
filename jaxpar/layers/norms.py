"""RMSNorm, computed in float32 whatever the compute dtype."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxpar.layers.common import ones


class RMSNorm(nnx.Module):
    """y = x / sqrt(mean(x²) + eps) * scale, over the last dimension (named ``name`` on the scale)."""

    def __init__(self, dim: int, *, eps: float, name: str = "norm", param_dtype="float32"):
        self.eps = eps
        self.scale = ones((dim,), (name,), dtype=param_dtype)

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        y = x32 * jax.lax.rsqrt(jnp.mean(jnp.square(x32), axis=-1, keepdims=True) + self.eps)
        return (y * self.scale[...].astype(jnp.float32)).astype(x.dtype)
