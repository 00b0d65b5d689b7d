"""The number formats a stored weight can take (``jaxpar.layers.quant`` stores and reads them): one weight
``w`` used as ``einsum(spec, x, w)`` becomes (data, scale), and comes back as data times its scale.

* ``int8``: symmetric, one scale per output channel (the max |w| over the dimensions the projection
  contracts, ÷ 127): ``w ≈ q · scale``, ``q`` int8.
* ``int4``: symmetric 4-bit codes, two to a byte, in groups of ``INT4_GROUP`` along the last contracted
  dimension (all of it where ``INT4_GROUP`` does not divide it), one scale per group (absmax ÷ 7):
  ``w ≈ (code − 8) · scale``, codes 1..15.
* ``nf4``: QLoRA's 4-bit NormalFloat codes, two to a byte, in groups of ``GROUP`` along one dimension of
  the weight (the last contracted one that ``GROUP`` divides, else the first other), one absmax scale
  per group: ``w ≈ NF4[code] · absmax``. The 16 code values are the quantiles of a standard normal, as
  the QLoRA paper builds them (``nf4_values``): 8 for the positive side, 7 for the negative, and an
  exact zero, scaled to [-1, 1].
* ``fp8``: float8 e4m3 in blocks of ``FP8_BLOCK`` along the last contracted dimension and the last
  output dimension (all of one where the block does not divide it; one block per index of any other
  dimension, e.g. per head), one scale per block (absmax ÷ 448, e4m3's largest finite value), the
  scaled values clamped to ±448 before rounding: ``w ≈ float(data) · scale``. With a head width of 128
  these are the 128 × 128 blocks of the published FP8 checkpoints. The e4m3 bits are stored in a uint8
  array and bit-cast where they are read: XLA:CPU converts a float8 array of the layer stack to float16
  whole before the layer loop (measured: the whole model upcast), a uint8 one a layer at a time.

Rounding to the nearest code leaves each value within half a step of its own (``step_bound``): the
scale for int8 and int4, the gap between the two codes around it for nf4, half of e4m3's spacing at the
scaled value for fp8. The packed 4-bit formats halve their grouped dimension; every scale keeps the
weight's dimensions, divided into its groups or blocks (1 where it reduces a dimension whole).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxpar.errors import ConfigError

GROUP = 64  # nf4: values per absmax scale
INT4_GROUP = 128  # int4: values per scale along the input dimension
FP8_BLOCK = 128  # fp8: block edge
FP8_MAX = 448.0  # the largest finite float8 e4m3fn
PACKED = ("int4", "nf4")  # two codes to a byte


@functools.cache
def nf4_values() -> np.ndarray:
    """The 16 NormalFloat-4 code values, ascending in [-1, 1] with an exact 0: normal quantiles at
    evenly spaced probabilities from 1 − δ to ½ (8 positive, 7 negative), δ = ½(1/32 + 1/30)."""
    from statistics import NormalDist

    delta = 0.5 * (1 / 32 + 1 / 30)
    ppf = NormalDist().inv_cdf
    positive = [ppf(p) for p in np.linspace(1 - delta, 0.5, 9)[:-1]]
    negative = [-ppf(p) for p in np.linspace(1 - delta, 0.5, 8)[:-1]]
    values = np.sort(np.array(positive + [0.0] + negative))
    return (values / np.abs(values).max()).astype(np.float32)


def contracted(spec: str) -> tuple[int, ...]:
    """The axes of W that ``einsum(spec, x, W)`` contracts."""
    x, w = spec.split("->")[0].split(",")
    y = spec.split("->")[1]
    return tuple(i for i, c in enumerate(w) if c in x and c not in y)


def group_axis(shape, spec: str) -> int:
    """The dimension nf4 groups a weight of ``shape`` used as ``einsum(spec, x, W)`` along: the last
    contracted one ``GROUP`` divides (o: head_dim before heads), else the first other one it divides."""
    axes = contracted(spec)
    for a in (*reversed(axes), *(i for i in range(len(shape)) if i not in axes)):
        if shape[a] % GROUP == 0:
            return a
    raise ConfigError(f"model.lora.quantize=nf4: no dimension of a {list(shape)} weight is a multiple of {GROUP}")


def grouping(shape, spec: str, kind: str) -> tuple[int, int]:
    """(axis, group size) of a packed 4-bit format."""
    if kind == "nf4":
        return group_axis(shape, spec), GROUP
    a = contracted(spec)[-1]
    if shape[a] % 2:
        raise ConfigError(f"int4: a {list(shape)} weight's input dimension ({shape[a]}) is odd; codes pack in pairs")
    return a, INT4_GROUP if shape[a] % INT4_GROUP == 0 else shape[a]


def fp8_blocks(shape, spec: str) -> tuple[int, ...]:
    """Each dimension's block: ``FP8_BLOCK`` (or all of it) along the last contracted and the last output
    dimension, 1 along the others."""
    axes = contracted(spec)
    blocks = [1] * len(shape)
    for a in (axes[-1], max(i for i in range(len(shape)) if i not in axes)):
        blocks[a] = FP8_BLOCK if shape[a] % FP8_BLOCK == 0 else shape[a]
    return tuple(blocks)


def stored_shapes(shape, spec: str, kind: str) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(data, scale) shapes of a weight of ``shape`` stored as ``kind``."""
    if kind == "int8":
        axes = contracted(spec)
        return tuple(shape), tuple(1 if i in axes else n for i, n in enumerate(shape))
    if kind == "fp8":
        return tuple(shape), tuple(n // b for n, b in zip(shape, fp8_blocks(shape, spec)))
    a, g = grouping(shape, spec, kind)
    data = tuple(n // 2 if i == a else n for i, n in enumerate(shape))
    return data, tuple(n // g if i == a else n for i, n in enumerate(shape))


def _groups(w, a: int, g: int):
    return w.reshape(*w.shape[:a], w.shape[a] // g, g, *w.shape[a + 1 :])


def _blocked(w, blocks):
    """``w`` with each dimension split into (blocks, block): [n0/b0, b0, n1/b1, b1, ...]."""
    return w.reshape([x for n, b in zip(w.shape, blocks) for x in (n // b, b)])


def quantize(w: jax.Array, spec: str, kind: str) -> tuple[jax.Array, jax.Array]:
    """(data, scale) of weight ``w`` used as ``einsum(spec, x, w)``."""
    w = w.astype(jnp.float32)
    if kind == "int8":
        scale = jnp.max(jnp.abs(w), axis=contracted(spec), keepdims=True) / 127.0
        scale = jnp.where(scale > 0, scale, 1.0)
        return jnp.clip(jnp.round(w / scale), -127, 127).astype(jnp.int8), scale
    if kind == "fp8":
        blocks = fp8_blocks(w.shape, spec)
        x = _blocked(w, blocks)
        odd = tuple(range(1, x.ndim, 2))
        scale = jnp.max(jnp.abs(x), axis=odd, keepdims=True) / FP8_MAX
        scale = jnp.where(scale > 0, scale, 1.0)
        data = jnp.clip(x / scale, -FP8_MAX, FP8_MAX).astype(jnp.float8_e4m3fn).reshape(w.shape)
        return jax.lax.bitcast_convert_type(data, jnp.uint8), scale.reshape([n // b for n, b in zip(w.shape, blocks)])
    a, g = grouping(w.shape, spec, kind)
    grouped = _groups(w, a, g)  # [..., n / g, g, ...]
    absmax = jnp.max(jnp.abs(grouped), axis=a + 1, keepdims=True)
    absmax = jnp.where(absmax > 0, absmax, 1.0)
    if kind == "nf4":
        values = nf4_values()
        midpoints = jnp.asarray((values[1:] + values[:-1]) / 2)  # the nearest code: how many midpoints lie below
        codes, scale = jnp.searchsorted(midpoints, grouped / absmax), absmax
    else:
        scale = absmax / 7.0
        codes = jnp.clip(jnp.round(grouped / scale), -7, 7) + 8
    codes = codes.astype(jnp.uint8).reshape(w.shape)
    pairs = codes.reshape(*w.shape[:a], w.shape[a] // 2, 2, *w.shape[a + 1 :])
    packed = jnp.take(pairs, 0, axis=a + 1) | (jnp.take(pairs, 1, axis=a + 1) << 4)
    return packed, jnp.squeeze(scale, axis=a + 1)


def dequantize(data: jax.Array, scale: jax.Array, spec: str, kind: str, dtype) -> jax.Array:
    """The weight ``quantize`` stored, in ``dtype``."""
    if kind == "int8":
        return (data.astype(jnp.float32) * scale).astype(dtype)
    if kind == "fp8":
        blocks = [d // s for d, s in zip(data.shape, scale.shape)]
        x = _blocked(jax.lax.bitcast_convert_type(data, jnp.float8_e4m3fn).astype(jnp.float32), blocks)
        factor = scale.reshape([y for n in scale.shape for y in (n, 1)])
        return (x * factor).reshape(data.shape).astype(dtype)
    a = next(i for i, (d, c) in enumerate(zip(data.shape, scale.shape)) if d != c)  # halved vs ÷ group
    g = 2 * data.shape[a] // scale.shape[a]
    codes = jnp.stack([data & 0xF, data >> 4], axis=a + 1)
    codes = codes.reshape(*data.shape[:a], 2 * data.shape[a], *data.shape[a + 1 :])
    if kind == "nf4":
        values = jnp.asarray(nf4_values())[codes.astype(jnp.int32)]
    else:
        values = codes.astype(jnp.float32) - 8.0
    return (_groups(values, a, g) * jnp.expand_dims(scale, a + 1)).reshape(values.shape).astype(dtype)


def step_bound(w: np.ndarray, spec: str, kind: str) -> np.ndarray:
    """Half a quantization step around each value of ``w`` (one weight, no layer dimension): what
    rounding to the nearest code may cost it at most."""
    if kind == "int8":
        return 0.5 * np.max(np.abs(w), axis=contracted(spec), keepdims=True) / 127.0 * np.ones_like(w)
    if kind == "fp8":
        blocks = fp8_blocks(w.shape, spec)
        x = w.reshape([y for n, b in zip(w.shape, blocks) for y in (n // b, b)])
        scale = np.max(np.abs(x), axis=tuple(range(1, x.ndim, 2)), keepdims=True) / FP8_MAX
        scaled = np.abs(x) / scale
        exponent = np.floor(np.log2(np.maximum(scaled, 2.0**-6)))  # e4m3: 3 mantissa bits, subnormals below 2^-6
        return (0.5 * 2.0 ** (exponent - 3) * scale).reshape(w.shape)
    a, g = grouping(w.shape, spec, kind)
    grouped = _groups(w, a, g)
    absmax = np.max(np.abs(grouped), axis=a + 1, keepdims=True)
    if kind == "int4":
        return (0.5 * absmax / 7.0 * np.ones_like(grouped)).reshape(w.shape)
    values = nf4_values().astype(np.float64)
    at = np.clip(np.searchsorted(values, grouped / absmax), 1, len(values) - 1)  # the codes around it
    gap = values[at] - values[at - 1]
    return (0.5 * gap * absmax).reshape(w.shape)
