"""Causal self-attention with GQA/MQA, optional QKV bias (Qwen2), QK-norm (Qwen3), sliding window (Mistral).

Legend: B batch, T positions, D width, N query heads, K key/value heads (N % K == 0), H head_dim.
Weights: q [D, N, H], k and v [D, K, H], o [N, H, D]. K/V heads are never repeated in memory:
``jax.nn.dot_product_attention`` groups the N query heads over the K key/value heads itself.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from jaxpar.config import check_choices
from jaxpar.execution import AttentionImpl
from jaxpar.layers.common import param, zeros
from jaxpar.layers.kvcache import (
    DECODE,
    KVCache,
    Step,
    filled,
    gqa_decode,
    keys_layout,
    map_arrays,
    slot_axis,
    values_layout,
)
from jaxpar.layers.lora import SPECS, LoraConfig, add_adapter, delta, project
from jaxpar.layers.norms import RMSNorm
from jaxpar.layers.quant import quantize_weights, weight
from jaxpar.layers.rope import RopeScaling, YarnScaling, apply_rope, rope_frequencies
from jaxpar.parallel.attention import ContextParallel, context_attention
from jaxpar.rules import constrain


@dataclasses.dataclass(frozen=True)
class AttentionConfig:
    embed_dim: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 10_000.0
    rope_scaling: RopeScaling | YarnScaling | None = None  # YaRN: MLA only
    qkv_bias: bool = False
    qk_norm: bool = False
    norm_eps: float = 1e-5
    sliding_window: int | None = None  # a token sees itself and the (window - 1) tokens before it
    implementation: AttentionImpl | None = None
    context_parallel: ContextParallel = ContextParallel.NONE  # attention over a split sequence
    lora: LoraConfig | None = None  # adapters on q, k, v, o (``jaxpar.layers.lora``)
    quantize: str = "none"  # q, k, v, o stored quantized (``jaxpar.layers.quant``): QLoRA's base, or for serving

    def __post_init__(self):
        check_choices(self, "execution")  # its choices are execution settings


PROJECT, OUTPUT = SPECS["q"], SPECS["o"]  # q, k, v; o


def output_projection(out: jax.Array, o: jax.Array, *, flat: bool) -> jax.Array:
    """out [B, T, N, H] through o [N, H, D] -> [B, T, D]. ``flat`` (generation): one product over N·H
    (o as [N·H, D], a free reshape), which keeps XLA from transposing the weight to the attention
    output's layout in every step (measured on XLA:CPU: a copy of o per layer per decode step)."""
    if not flat:
        return jnp.einsum("btnh,nhd->btd", out, o)
    b, t, n, h = out.shape
    return jnp.einsum("btf,fd->btd", out.reshape(b, t, n * h), o.reshape(n * h, o.shape[-1]))


class Attention(nnx.Module):
    def __init__(self, cfg: AttentionConfig, *, dtype, param_dtype, rngs: nnx.Rngs):
        d, n, k, h = cfg.embed_dim, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.cfg, self.dtype = cfg, dtype
        self.q = param(rngs, (d, n, h), ("embed", "heads", "head_dim"), dtype=param_dtype)
        self.k = param(rngs, (d, k, h), ("embed", "kv_heads", "head_dim"), dtype=param_dtype)
        self.v = param(rngs, (d, k, h), ("embed", "kv_heads", "head_dim"), dtype=param_dtype)
        self.o = param(rngs, (n, h, d), ("heads", "head_dim", "embed"), dtype=param_dtype)
        if cfg.qkv_bias:
            self.q_bias = zeros((n, h), ("heads", "head_dim"), dtype=param_dtype)
            self.k_bias = zeros((k, h), ("kv_heads", "head_dim"), dtype=param_dtype)
            self.v_bias = zeros((k, h), ("kv_heads", "head_dim"), dtype=param_dtype)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(h, eps=cfg.norm_eps, name="head_dim", param_dtype=param_dtype)
            self.k_norm = RMSNorm(h, eps=cfg.norm_eps, name="head_dim", param_dtype=param_dtype)
        for name in ("q", "k", "v"):
            add_adapter(self, name, PROJECT, cfg.lora, rngs)
        add_adapter(self, "o", OUTPUT, cfg.lora, rngs)
        quantize_weights(self, {"q": PROJECT, "k": PROJECT, "v": PROJECT, "o": OUTPUT}, cfg.quantize)

    @property
    def inv_freq(self) -> np.ndarray:
        """RoPE frequencies [H/2], from the config at trace time. Kept out of the module state on
        purpose: as state they become a per-layer input of the scanned loop, and XLA recomputes sin/cos
        per element inside it (measured: ~8% of the tiny model's step) instead of folding constants."""
        cfg = self.cfg
        return rope_frequencies(cfg.head_dim, theta=cfg.rope_theta, scaling=cfg.rope_scaling)

    def _project(self, x, name: str, heads_axis: str):
        y = project(self, name, PROJECT, x, weight(self, name, PROJECT, self.dtype))
        if self.cfg.qkv_bias:
            y = y + getattr(self, f"{name}_bias")[...].astype(self.dtype)
        if self.cfg.qk_norm and name != "v":
            y = getattr(self, f"{name}_norm")(y)
        return constrain(y, ("batch", "inner_length", heads_axis, None))

    def __call__(
        self,
        x: jax.Array,
        positions: jax.Array,
        index: jax.Array | None = None,
        *,
        cache: KVCache | None = None,
        step: Step | None = None,
        segments: jax.Array | None = None,
    ):
        """x [B, T, D]; positions [B, T] for RoPE; index [B, T]: each stored token's place in the
        original sequence (differs from the storage order under zig-zag context parallelism);
        segments [B, T] or None: each token's document (packed rows attend within a document).
        With a ``cache`` (generation, see ``jaxpar.layers.kvcache``) returns (y, the updated cache)."""
        x = constrain(x, ("batch", "inner_length", "act_embed"))  # x: [B, T, D]
        q = apply_rope(self._project(x, "q", "act_heads"), positions, self.inv_freq)  # [B, T, N, H]
        k = apply_rope(self._project(x, "k", "act_kv_heads"), positions, self.inv_freq)  # [B, T, K, H]
        v = self._project(x, "v", "act_kv_heads")  # [B, T, K, H]
        q, k, v = (checkpoint_name(a, f"attn_{n}") for a, n in ((q, "q"), (k, "k"), (v, "v")))  # remat=attn keeps them
        index = positions if index is None else index
        window = self.cfg.sliding_window
        if cache is not None and step.mode == DECODE:
            out, cache = gqa_decode(q, k, v, cache, positions, window=window)
        else:
            out = context_attention(
                q,
                k,
                v,
                index,
                strategy=self.cfg.context_parallel,
                window=window,
                implementation=self.cfg.implementation,
                segments=segments,
            )
            if cache is not None:  # prefill
                slots = cache.v.shape[slot_axis(KVCache.NAMES[1])]
                heads = ("batch", "inner_length", "act_kv_heads", None)
                k, v = (filled(constrain(a, heads), step.lengths, slots) for a in (k, v))  # [B, S, K, H]
                cache = map_arrays(KVCache(keys_layout(k), values_layout(v)), constrain)
        out = checkpoint_name(constrain(out, ("batch", "inner_length", "act_heads", None)), "attn_ctx")  # [B, T, N, H]
        o = weight(self, "o", OUTPUT, self.dtype)
        y = output_projection(out, o, flat=cache is not None)
        extra = delta(self, "o", OUTPUT, out)
        y = constrain(y if extra is None else y + extra, ("batch", "length", "act_embed"))
        return y if cache is None else (y, cache)
