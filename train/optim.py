"""Optimizer: AdamW with global-norm clipping and no weight decay on vectors (norm scales, biases)."""
from __future__ import annotations

import dataclasses

import jax
import optax
from flax import nnx


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
    learning_rate: float = 3e-4
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.1
    clip_norm: float | None = 1.0


def decay_mask(model: nnx.Module):
    """Weight decay on weight matrices and embeddings (parameters with an ``embed`` dimension); none on
    norm scales and biases. Decided by logical names, so a stacked ``[layers, D]`` norm is not a matrix.
    A static tree of bools shaped like ``nnx.state(model, nnx.Param)``."""
    return jax.tree.map(lambda v: "embed" in (v.get_metadata().get("out_sharding") or ()),
                        nnx.state(model, nnx.Param), is_leaf=lambda x: isinstance(x, nnx.Variable))


def make_optimizer(cfg: OptimizerConfig, model: nnx.Module, /) -> optax.GradientTransformation:
    adamw = optax.adamw(cfg.learning_rate, b1=cfg.b1, b2=cfg.b2, eps=cfg.eps, weight_decay=cfg.weight_decay,
                        mask=decay_mask(model))
    return adamw if cfg.clip_norm is None else optax.chain(optax.clip_by_global_norm(cfg.clip_norm), adamw)
