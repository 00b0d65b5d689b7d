"""Token embedding, also usable as a tied LM head. Legend: B batch, T positions, D width, V vocab."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxpar.layers.common import param
from jaxpar.rules import constrain, partly_manual


class Embed(nnx.Module):
    def __init__(self, vocab: int, dim: int, *, dtype, param_dtype, rngs: nnx.Rngs):
        self.dtype = dtype
        self.embedding = param(rngs, (vocab, dim), ("vocab", "embed"), dtype=param_dtype)

    def __call__(self, ids: jax.Array) -> jax.Array:
        table = self.embedding[...]
        if partly_manual():  # inside the pipeline's shard_map XLA cannot split this gather over the
            table = constrain(table, ("vocab", None))  # weights' embed axis (fsdp): gather it first
        x = jnp.take(table, ids, axis=0).astype(self.dtype)  # [B, T, D]
        return constrain(x, ("batch", "length", "act_embed"))

    def attend(self, x: jax.Array) -> jax.Array:
        """Logits [B, T, V] against the embedding table (tied embeddings)."""
        logits = jnp.einsum("btd,vd->btv", x, self.embedding[...].astype(self.dtype))
        return constrain(logits, ("batch", "inner_length", "act_vocab"))
