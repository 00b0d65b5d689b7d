"""SwiGLU feed-forward: down(silu(x·gate) * (x·up)). Legend: B batch, T positions, D width, F mlp width."""
from __future__ import annotations

import jax
from flax import nnx
import jax.numpy as jnp

from jaxpar.layers.common import param
from jaxpar.rules import constrain


class SwiGLU(nnx.Module):
    def __init__(self, dim: int, hidden: int, *, dtype, param_dtype, rngs: nnx.Rngs):
        self.dtype = dtype
        self.gate = param(rngs, (dim, hidden), ("embed", "mlp"), dtype=param_dtype)   # column-parallel
        self.up = param(rngs, (dim, hidden), ("embed", "mlp"), dtype=param_dtype)     # column-parallel
        self.down = param(rngs, (hidden, dim), ("mlp", "embed"), dtype=param_dtype)   # row-parallel

    def __call__(self, x: jax.Array) -> jax.Array:
        x = constrain(x, ("batch", "inner_length", "act_embed"))                     # x: [B, T, D]
        w = lambda v: v[...].astype(self.dtype)
        h = jax.nn.silu(jnp.einsum("btd,df->btf", x, w(self.gate))) * jnp.einsum("btd,df->btf", x, w(self.up))
        h = constrain(h, ("batch", "inner_length", "act_mlp"))                       # h: [B, T, F]
        return constrain(jnp.einsum("btf,fd->btd", h, w(self.down)), ("batch", "length", "act_embed"))
