"""Group Relative Policy Optimization (Shao et al. 2024): the objective of one update, and the batch a
rollout batch becomes.

A rollout batch holds ``prompts`` prompts, each answered ``group_size`` times by the engine, sampling
(``jaxpar.rl.rollout``). Each completion's reward (a Python function) is compared with its group's:
the advantage is ``(r - mean) / (std + 1e-4)`` over the group (std with n − 1, as TRL has it), the same
for every token of the completion. A row is the prompt and the completion; the completion's tokens
train (``mask``), with the log-prob the engine sampled each one with (``old_logps``) and the advantage.

The loss, per trained token t, with ``ratio = π(t) / π_old(t)`` (the model's raw distribution: the
sampling temperature shapes which tokens are drawn, not the ratio):

    -min(ratio · A, clip(ratio, 1 - ε, 1 + ε) · A)  +  β · (π_ref / π - log(π_ref / π) - 1)

the KL term (Schulman's k3 estimator) only with ``kl`` β > 0. It is the mean over the batch's trained
tokens (``token_weights``: the global count, whatever slices or shards the batch is cut into).
"""

from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp
import numpy as np

from jaxpar.errors import ConfigError
from jaxpar.model_api import LanguageModel
from jaxpar.train.loss import Batch, LossParts
from jaxpar.train.preference import token_logps

ADVANTAGE_EPS = 1e-4  # added to a group's reward std (a group of equal rewards: advantages 0)


@dataclasses.dataclass(frozen=True)
class GRPOConfig:
    prompts: int = 4  # prompts per rollout batch
    group_size: int = 8  # completions per prompt
    max_new_tokens: int = 16
    temperature: float = 1.0  # the engine's sampling (top-k, top-p and min-p off)
    updates: int = 1  # optimizer steps on each rollout batch (μ)
    clip: float = 0.2  # ε of the clipped ratio
    kl: float = 0.0  # β of the KL to the reference (0: none, and no reference forward)

    def __post_init__(self):
        for name in ("prompts", "group_size", "max_new_tokens", "updates"):
            if getattr(self, name) < 1:
                raise ConfigError(f"grpo.{name}={getattr(self, name)}: must be ≥ 1")
        if self.group_size < 2:
            raise ConfigError(f"grpo.group_size={self.group_size}: a group needs ≥ 2 completions to compare")
        if not (self.temperature > 0 and math.isfinite(self.temperature)):
            raise ConfigError(f"grpo.temperature={self.temperature}: must be a positive number")
        if not 0 < self.clip < 1:
            raise ConfigError(f"grpo.clip={self.clip}: must be in (0, 1)")
        if not (self.kl >= 0 and math.isfinite(self.kl)):
            raise ConfigError(f"grpo.kl={self.kl}: must be ≥ 0")


def group_advantages(rewards: np.ndarray) -> np.ndarray:
    """[prompts, group] rewards -> advantages: each reward against its group's mean and std."""
    rewards = np.asarray(rewards, np.float64)
    std = rewards.std(axis=1, ddof=1, keepdims=True)
    return ((rewards - rewards.mean(axis=1, keepdims=True)) / (std + ADVANTAGE_EPS)).astype(np.float32)


def rollout_batch(rows: list[tuple[list[int], list[int], list[float], float]], seq: int) -> dict[str, np.ndarray]:
    """The batch [len(rows), seq] of (prompt ids, completion ids, their sampled log-probs, advantage)
    rows: inputs/targets shifted by one, ``mask`` on the completion's targets, ``old_logps`` and
    ``advantages`` beside them; the rest padding (token 0, nothing trained)."""
    out = {k: np.zeros((len(rows), seq), np.int32) for k in ("inputs", "targets", "mask")}
    out |= {k: np.zeros((len(rows), seq), np.float32) for k in ("old_logps", "advantages")}
    for i, (prompt, completion, logps, advantage) in enumerate(rows):
        tokens = list(prompt) + list(completion)
        if len(tokens) - 1 > seq:
            raise ConfigError(f"a rollout of {len(tokens)} tokens does not fit a row of seq + 1 = {seq + 1}")
        n, first = len(tokens) - 1, len(prompt) - 1  # target first + j is completion token j
        out["inputs"][i, :n], out["targets"][i, :n] = tokens[:-1], tokens[1:]
        out["mask"][i, first:n] = 1
        out["old_logps"][i, first:n] = logps[: len(completion)]
        out["advantages"][i, first:n] = advantage
    return out


def policy_loss(model: LanguageModel, batch: Batch, /, *, cfg: GRPOConfig, z_loss: float = 0.0):
    """(objective, LossParts) of a rollout batch (module docstring); ``extra``: the clipped share of the
    trained tokens, the mean ratio and, with a reference (``batch["reference"]``), the mean KL."""
    del z_loss
    logps, out = token_logps(model, batch)
    stored = (lambda a: a) if out.order is None else (lambda a: a[:, out.order])
    weights, advantages = stored(batch["weights"]), stored(batch["advantages"])
    ratio = jnp.exp(logps - stored(batch["old_logps"]))
    clipped = jnp.clip(ratio, 1.0 - cfg.clip, 1.0 + cfg.clip)
    per_token = -jnp.minimum(ratio * advantages, clipped * advantages)
    mean = lambda x: jnp.mean(weights * x)  # noqa: E731  (over the global batch's trained tokens)
    extra = {
        "clipped": mean((ratio * advantages > clipped * advantages).astype(jnp.float32)),
        "ratio": mean(ratio),
    }
    if cfg.kl:
        delta = stored(batch["reference"]) - logps
        kl = jnp.exp(delta) - delta - 1.0
        per_token = per_token + cfg.kl * kl
        extra["kl"] = mean(kl)
    loss = mean(per_token)
    return loss + out.aux_loss, LossParts(loss, jnp.zeros((), jnp.float32), out.moe, extra)
