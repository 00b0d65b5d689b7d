"""Rotary position embedding, half-split layout (as Hugging Face Llama/Qwen/Mistral store q and k), with
Llama 3.1 frequency scaling (``RopeScaling``) and YaRN (``YarnScaling``, used by MLA).

Dimension legend: B batch, T positions, N heads, H head_dim.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """Llama 3.1 frequency scaling: long wavelengths slowed by ``factor``, short ones kept, a smooth
    ramp between ``original_max_position / low_freq_factor`` and ``... / high_freq_factor``."""

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192


@dataclasses.dataclass(frozen=True)
class YarnScaling:
    """HF ``rope_scaling = {"type": "yarn", ...}``; the defaults are DeepSeek-V3's published config."""

    factor: float = 40.0
    original_max_position: int = 4096
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 1.0
    attention_factor: float | None = None  # overrides the mscale ratio on cos/sin when given
    truncate: bool = True  # floor/ceil the correction range (HF default)


def yarn_frequencies(dim: int, *, theta: float, scaling: YarnScaling) -> np.ndarray:
    """YaRN inverse frequencies [dim/2], float64: each frequency is kept (fast dims, many turns within the
    original context) or divided by ``factor`` (slow dims), linearly blended over the correction range."""
    plain = 1.0 / theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim)

    def dim_of(turns):  # the (fractional) dim index whose wave turns `turns` times in the original context
        return dim * math.log(scaling.original_max_position / (turns * 2 * math.pi)) / (2 * math.log(theta))

    lo, hi = dim_of(scaling.beta_fast), dim_of(scaling.beta_slow)
    if scaling.truncate:
        lo, hi = math.floor(lo), math.ceil(hi)
    lo, hi = max(lo, 0), min(hi, dim - 1)
    hi = hi + 0.001 if lo == hi else hi
    interpolated = np.clip((np.arange(dim // 2) - lo) / (hi - lo), 0.0, 1.0)  # 0: keep, 1: divide by factor
    return plain * (1 - interpolated) + plain / scaling.factor * interpolated


def rope_frequencies(head_dim: int, *, theta: float, scaling: RopeScaling | None = None) -> np.ndarray:
    """Inverse frequencies [H/2] in float64 numpy (constants folded into the program)."""
    inv = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    if scaling is None:
        return inv
    wavelen = 2 * math.pi / inv
    low_wavelen = scaling.original_max_position / scaling.low_freq_factor  # longer than this: scaled
    high_wavelen = scaling.original_max_position / scaling.high_freq_factor  # shorter than this: kept
    ramp = (scaling.original_max_position / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    blended = (1 - ramp) * inv / scaling.factor + ramp * inv
    return np.where(wavelen < high_wavelen, inv, np.where(wavelen > low_wavelen, inv / scaling.factor, blended))


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: np.ndarray) -> jax.Array:
    """Rotate x [B, T, N, H] by angles positions [B, T] × inv_freq [H/2]; computed in float32."""
    angles = positions.astype(jnp.float32)[:, :, None, None] * jnp.asarray(inv_freq, jnp.float32)  # [B,T,1,H/2]
    cos, sin = jnp.cos(angles), jnp.sin(angles)
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)
