"""Shared by the adapter tests: a model whose adapters look trained."""

import numpy as np
from flax import nnx

from jaxpar.layers.lora import LoraParam


def with_random_b(model, seed: int = 1):
    """``model`` with every adapter's B drawn at random (a trained adapter, as far as logits go)."""
    rng = np.random.default_rng(seed)
    flat = [
        (p, v.replace(rng.normal(0, 0.05, v.get_value().shape).astype(np.float32)) if str(p[-1]).endswith("_b") else v)
        for p, v in nnx.to_flat_state(nnx.state(model, LoraParam))
    ]
    nnx.update(model, nnx.from_flat_state(flat))
    return model
