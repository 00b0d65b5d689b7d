"""Optimizer: AdamW with a learning-rate schedule, global-norm clipping, and no weight decay on vectors.

Schedules (``OptimizerConfig.schedule``), over the run's total steps S with warmup W:
    constant  linear warmup 0 → lr over W steps, then lr
    cosine    linear warmup, then cosine decay to ``min_lr_ratio · lr`` at step S
    wsd       warmup-stable-decay: warmup, lr held, then a linear decay to ``min_lr_ratio · lr`` over the
              last ``decay_fraction · S`` steps (lets a run be extended from a stable-phase checkpoint)

The transformation's structure is the same for every setting (clip + AdamW with a schedule), so a
checkpoint's optimizer state loads whatever the schedule or clipping of the resumed run.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import optax
from flax import nnx

from jaxpar.config import Choice, check_choices
from jaxpar.errors import ConfigError
from jaxpar.layers.lora import trainable


class Schedule(Choice):
    CONSTANT = "constant"
    COSINE = "cosine"
    WSD = "wsd"


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
    learning_rate: float = 3e-4
    schedule: Schedule = Schedule.CONSTANT
    warmup_steps: int = 0
    min_lr_ratio: float = 0.1  # cosine / wsd end at this fraction of learning_rate
    decay_fraction: float = 0.2  # wsd: share of the run spent decaying
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.1
    clip_norm: float | None = 1.0  # global-norm clipping; None = off

    def __post_init__(self):
        check_choices(self, "optimizer")

    def validate(self) -> OptimizerConfig:
        checks = {
            "learning_rate": self.learning_rate > 0,
            "warmup_steps": self.warmup_steps >= 0,
            "min_lr_ratio": 0 <= self.min_lr_ratio <= 1,
            "decay_fraction": 0 < self.decay_fraction <= 1,
            "clip_norm": self.clip_norm is None or self.clip_norm > 0,
            "eps": self.eps > 0,
            "b1": 0 <= self.b1 < 1,
            "b2": 0 <= self.b2 < 1,
            "weight_decay": self.weight_decay >= 0,
        }
        bad = [k for k, ok in checks.items() if not ok]
        if bad:
            raise ConfigError(f"optimizer.{bad[0]}={getattr(self, bad[0])} is out of range")
        return self


def make_schedule(cfg: OptimizerConfig, total_steps: int | None, /) -> optax.Schedule:
    """Learning rate as a function of the optimizer step (0-based)."""
    peak, end, warm = cfg.learning_rate, cfg.learning_rate * cfg.min_lr_ratio, cfg.warmup_steps
    if cfg.schedule != "constant" and total_steps is None:
        raise ValueError(f"schedule {cfg.schedule!r} needs the run's total steps")
    if cfg.schedule == "cosine":
        return optax.warmup_cosine_decay_schedule(0.0, peak, warm, max(total_steps, warm + 1), end)
    warmup = optax.linear_schedule(0.0, peak, warm) if warm else optax.constant_schedule(peak)
    if cfg.schedule == "constant":
        return optax.join_schedules([warmup, optax.constant_schedule(peak)], [warm])
    decay_steps = max(1, math.ceil(cfg.decay_fraction * total_steps))
    stable_end = max(warm, total_steps - decay_steps)
    return optax.join_schedules(
        [warmup, optax.constant_schedule(peak), optax.linear_schedule(peak, end, decay_steps)], [warm, stable_end]
    )


def decay_mask(model: nnx.Module):
    """Weight decay on weight matrices and embeddings (parameters with an ``embed`` dimension); none on
    norm scales and biases. Decided by logical names, so a stacked ``[layers, D]`` norm is not a matrix.
    A static tree of bools shaped like ``nnx.state(model, trainable(model))``: a LoRA adapter's A and B
    (``lora_rank`` with an ``embed`` side, or the other) decay as the matrices they stand for."""
    return jax.tree.map(
        lambda v: bool({"embed", "lora_rank"} & set(v.get_metadata().get("out_sharding") or ())),
        nnx.state(model, trainable(model)),
        is_leaf=lambda x: isinstance(x, nnx.Variable),
    )


def make_optimizer(
    cfg: OptimizerConfig, model: nnx.Module, /, *, total_steps: int | None = None
) -> optax.GradientTransformation:
    clip = optax.clip_by_global_norm(cfg.clip_norm if cfg.clip_norm is not None else math.inf)
    adamw = optax.adamw(
        make_schedule(cfg, total_steps),
        b1=cfg.b1,
        b2=cfg.b2,
        eps=cfg.eps,
        weight_decay=cfg.weight_decay,
        mask=decay_mask(model),
    )
    return optax.chain(clip, adamw)
