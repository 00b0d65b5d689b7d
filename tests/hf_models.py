"""Tiny random Hugging Face models (tests/hf_build.py) and their reference logits, with the logit noise
of the float32 model against itself in float64 (tests/noise.py)."""

from __future__ import annotations

import numpy as np
from hf_build import COMMON, CONFIGS, build, save
from noise import FLOOR, MULTIPLE

__all__ = ["COMMON", "CONFIGS", "IDS", "build", "logit_bound", "logits", "own_noise", "save"]


def logits(model, ids: np.ndarray) -> np.ndarray:
    import torch

    with torch.no_grad():
        return model(torch.as_tensor(ids, dtype=torch.long)).logits.float().numpy()


def own_noise(model, ids: np.ndarray) -> float:
    """The float32 model's own logit noise on ``ids``: max |Δ| from the same model computed in float64
    (tests/noise.py)."""
    import copy

    import torch

    exact = copy.deepcopy(model).to(torch.float64)
    if exact._can_set_experts_implementation():  # the grouped matmul kernel has no float64
        exact.set_experts_implementation("eager")
    with torch.no_grad():
        want = exact(torch.as_tensor(ids, dtype=torch.long)).logits.numpy()
    return float(np.max(np.abs(logits(model, ids) - want)))


def logit_bound(noise: float) -> float:
    """The logit tolerance against a Hugging Face model whose own noise is ``noise``."""
    return max(MULTIPLE * noise, FLOOR["logit"])


IDS = np.random.default_rng(0).integers(0, 250, (2, 12)).astype(np.int32)
