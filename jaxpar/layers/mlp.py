"""SwiGLU feed-forward: down(silu(x·gate) * (x·up)).

Legend: B batch, T positions, D width, F mlp width, G = 2 (gate and up).
Gate and up live in one weight ``gate_up [D, 2, F]``: under tensor parallelism the backward pass then
reduces one input gradient per MLP instead of two (Megatron's fused column-parallel projection).
"""

from __future__ import annotations

import jax
from flax import nnx

from jaxpar.layers.common import param
from jaxpar.layers.lora import SPECS, LoraConfig, add_adapter, project
from jaxpar.layers.quant import quantize_weights, weight
from jaxpar.rules import constrain

GATE_UP, DOWN = SPECS["gate_up"], SPECS["down"]


class SwiGLU(nnx.Module):
    def __init__(
        self,
        dim: int,
        hidden: int,
        *,
        dtype,
        param_dtype,
        rngs: nnx.Rngs,
        lora: LoraConfig | None = None,
        quantize: str = "none",
    ):
        """``quantize``: the weights' stored format (``jaxpar.layers.quant``: QLoRA's base, or for serving)."""
        self.dtype = dtype
        self.gate_up = param(rngs, (dim, 2, hidden), ("embed", None, "mlp"), dtype=param_dtype)  # column-parallel
        self.down = param(rngs, (hidden, dim), ("mlp", "embed"), dtype=param_dtype)  # row-parallel
        add_adapter(self, "gate_up", GATE_UP, lora, rngs)  # (jaxpar.layers.lora)
        add_adapter(self, "down", DOWN, lora, rngs)
        quantize_weights(self, {"gate_up": GATE_UP, "down": DOWN}, quantize)

    def __call__(self, x: jax.Array) -> jax.Array:
        x = constrain(x, ("batch", "inner_length", "act_embed"))  # x: [B, T, D]
        h = project(self, "gate_up", GATE_UP, x, weight(self, "gate_up", GATE_UP, self.dtype))
        h = constrain(h, ("batch", "inner_length", None, "act_mlp"))  # h: [B, T, 2, F]
        h = constrain(jax.nn.silu(h[:, :, 0]) * h[:, :, 1], ("batch", "inner_length", "act_mlp"))  # [B, T, F]
        y = project(self, "down", DOWN, h, weight(self, "down", DOWN, self.dtype))
        return constrain(y, ("batch", "length", "act_embed"))
