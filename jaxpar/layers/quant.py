"""QLoRA's frozen base (Dettmers et al. 2023): a projection's weight stored quantized and dequantized inside
the step, where the matmul reads it (``model.lora.quantize``).

* ``int8``: symmetric, one scale per output channel (the max |w| over the dimensions the projection
  contracts, ÷ 127): ``w ≈ q · scale``, ``q`` int8.
* ``nf4``: 4-bit NormalFloat codes, two to a byte, in groups of ``GROUP`` along one dimension of the
  weight (the last contracted one that ``GROUP`` divides, else the first other), one absmax scale per
  group: ``w ≈ NF4[code] · absmax``. The 16 code values are the
  quantiles of a standard normal, as the QLoRA paper builds them (``nf4_values``): 8 for the positive
  side, 7 for the negative, and an exact zero, scaled to [-1, 1].

Rounding to the nearest code leaves each value within half a code step of its own (a step of the
group's scale for int8; the gap between the two codes around it for nf4). The quantized arrays are
``Quantized`` variables, not ``nnx.Param``: they never train and the optimizer holds nothing of them.
Which weights (``quantize_weights`` in each layer): GQA's q, k, v, o; MLA's q_a, q_b (or q), kv_a, kv_b,
o; every SwiGLU's gate_up and down; and the routed experts' gate_up and down, each expert's matrix
quantized as a dense MLP's is (the expert dimension, like a stack's layer dimension, is a batch
dimension: scales and groups never span experts).

They keep the weight's logical names (packed nf4 halves its grouped dimension, and its scales split it
into groups, sharded alike: the layout check asks that the groups divide the mesh axes; an int8 scale is
replicated along the dimensions it reduces), so they shard as the weight did.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxpar.errors import ConfigError

KINDS = ("none", "int8", "nf4")
GROUP = 64  # nf4: values per absmax scale


class Quantized(nnx.Variable):
    """A frozen base weight's quantized data or its scales (never trained)."""


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


def _contracted(spec: str) -> tuple[int, ...]:
    """The axes of W that ``einsum(spec, x, W)`` contracts."""
    x, w = spec.split("->")[0].split(",")
    y = spec.split("->")[1]
    return tuple(i for i, c in enumerate(w) if c in x and c not in y)


def check_kind(kind: str, rank: int) -> None:
    if kind not in KINDS:
        raise ConfigError(f"model.lora.quantize={kind!r}: one of {', '.join(KINDS)}")
    if kind != "none" and not rank:
        raise ConfigError(f"model.lora.quantize={kind}: a quantized base trains adapters (set model.lora.rank)")


def quantize(w: jax.Array, spec: str, kind: str) -> tuple[jax.Array, jax.Array]:
    """(data, scale) of weight ``w`` used as ``einsum(spec, x, w)``."""
    axes = _contracted(spec)
    w = w.astype(jnp.float32)
    if kind == "int8":
        scale = jnp.max(jnp.abs(w), axis=axes, keepdims=True) / 127.0
        scale = jnp.where(scale > 0, scale, 1.0)
        return jnp.clip(jnp.round(w / scale), -127, 127).astype(jnp.int8), scale
    a = group_axis(w.shape, spec)
    grouped = _groups(w, a)  # [..., n / GROUP, GROUP, ...]
    absmax = jnp.max(jnp.abs(grouped), axis=a + 1, keepdims=True)
    absmax = jnp.where(absmax > 0, absmax, 1.0)
    values = nf4_values()
    midpoints = jnp.asarray((values[1:] + values[:-1]) / 2)  # the nearest code: how many midpoints lie below
    codes = jnp.searchsorted(midpoints, grouped / absmax).astype(jnp.uint8)
    codes = codes.reshape(w.shape)
    pairs = codes.reshape(*w.shape[:a], w.shape[a] // 2, 2, *w.shape[a + 1 :])
    packed = jnp.take(pairs, 0, axis=a + 1) | (jnp.take(pairs, 1, axis=a + 1) << 4)
    return packed, jnp.squeeze(absmax, axis=a + 1)


def group_axis(shape, spec: str) -> int:
    """The dimension nf4 groups a weight of ``shape`` used as ``einsum(spec, x, W)`` along: the last
    contracted one ``GROUP`` divides (o: head_dim before heads), else the first other one it divides."""
    contracted = _contracted(spec)
    for a in (*reversed(contracted), *(i for i in range(len(shape)) if i not in contracted)):
        if shape[a] % GROUP == 0:
            return a
    raise ConfigError(f"model.lora.quantize=nf4: no dimension of a {list(shape)} weight is a multiple of {GROUP}")


def _groups(w, a: int):
    n = w.shape[a]
    return w.reshape(*w.shape[:a], n // GROUP, GROUP, *w.shape[a + 1 :])


def dequantize(data: jax.Array, scale: jax.Array, spec: str, kind: str, dtype) -> jax.Array:
    """The weight ``quantize`` stored, in ``dtype``."""
    if kind == "int8":
        return (data.astype(jnp.float32) * scale).astype(dtype)
    a = next(i for i, (d, c) in enumerate(zip(data.shape, scale.shape)) if d != c)  # halved vs ÷ GROUP
    low, high = data & 0xF, data >> 4
    codes = jnp.stack([low, high], axis=a + 1)
    codes = codes.reshape(*data.shape[:a], 2 * data.shape[a], *data.shape[a + 1 :])
    values = jnp.asarray(nf4_values())[codes.astype(jnp.int32)]
    grouped = _groups(values, a) * jnp.expand_dims(scale, a + 1)
    return grouped.reshape(values.shape).astype(dtype)


def quantize_weights(module: nnx.Module, specs: dict[str, str], kind: str) -> None:
    """Replaces each of ``module``'s weights named in ``specs`` (name -> its einsum) by ``{name}_data`` and
    ``{name}_scale`` (``Quantized``); ``module.quant`` records the kind."""
    if kind == "none":
        return
    for name, spec in specs.items():
        weight = getattr(module, name, None)
        if not isinstance(weight, nnx.Param):
            continue
        names = tuple(weight.get_metadata()["out_sharding"])
        data, scale = _stacked(quantize, weight[...], spec, kind)
        scale_names = tuple(n if c > 1 else None for n, c in zip(names, scale.shape))
        delattr(module, name)
        setattr(module, f"{name}_data", Quantized(data, out_sharding=names, eager_sharding=False))
        setattr(module, f"{name}_scale", Quantized(scale, out_sharding=scale_names, eager_sharding=False))
    module.quant = kind


def _stacked(fn, w, spec, *args):
    """``fn`` over ``w``'s leading (layer) dimensions, those beyond the einsum's operand."""
    lead = w.ndim - len(spec.split(",")[1].split("->")[0])
    for _ in range(lead):
        fn = jax.vmap(fn, in_axes=(0, None, *([None] * len(args))))
    return fn(w, spec, *args)


def quantized_like(target: nnx.State, source: nnx.State, specs: dict[str, str], kind: str) -> nnx.State:
    """``source`` (a model's float weights, e.g. a checkpoint's) with each weight that ``target`` (a
    model built with ``quantize``) holds quantized replaced by its data and scales, placed as
    ``target``'s (e.g. ``jaxpar train --init-from`` a base for a QLoRA run)."""
    wanted = dict(nnx.to_flat_state(target))
    flat = dict(nnx.to_flat_state(source))
    for path, var in list(wanted.items()):
        if not (isinstance(var, Quantized) and str(path[-1]).endswith("_data")):
            continue
        name = str(path[-1]).removesuffix("_data")
        weight_path = (*path[:-1], name)
        data, scale = _stacked(quantize, flat.pop(weight_path).get_value(), specs[name], kind)
        for suffix, value in (("_data", data), ("_scale", scale)):
            at = (*path[:-1], name + suffix)
            flat[at] = wanted[at].replace(jax.device_put(value, wanted[at].get_value().sharding))
    return nnx.from_flat_state(list(flat.items()))


def dequantize_weights(module: nnx.Module, specs: dict[str, str]) -> None:
    """``quantize_weights`` undone in place: each quantized weight back as an ``nnx.Param`` (float32) of
    its dequantized values (a merged export, a model without the quantized storage)."""
    kind = getattr(module, "quant", "none")
    if kind == "none":
        return
    for name, spec in specs.items():
        if not hasattr(module, f"{name}_data"):
            continue
        data = getattr(module, f"{name}_data")
        names = tuple(data.get_metadata()["out_sharding"])
        value = weight(module, name, spec, jnp.float32)
        delattr(module, f"{name}_data")
        delattr(module, f"{name}_scale")
        setattr(module, name, nnx.Param(value, out_sharding=names, eager_sharding=False))
    module.quant = "none"


def weight(module: nnx.Module, name: str, spec: str, dtype) -> jax.Array:
    """``module``'s weight ``name`` in ``dtype``: dequantized when stored quantized."""
    kind = getattr(module, "quant", "none")
    if kind == "none" or not hasattr(module, f"{name}_data"):
        return getattr(module, name)[...].astype(dtype)
    data, scale = getattr(module, f"{name}_data")[...], getattr(module, f"{name}_scale")[...]
    fn = functools.partial(dequantize, kind=kind, dtype=dtype)
    lead = data.ndim - len(spec.split(",")[1].split("->")[0])
    for _ in range(lead):
        fn = jax.vmap(fn, in_axes=(0, 0, None))
    return fn(data, scale, spec)


def step_bound(w: np.ndarray, spec: str, kind: str) -> np.ndarray:
    """Half a quantization step around each value of ``w`` (one weight, no layer dimension): what
    rounding to the nearest code may cost it at most."""
    axes = _contracted(spec)
    if kind == "int8":
        return 0.5 * np.max(np.abs(w), axis=axes, keepdims=True) / 127.0 * np.ones_like(w)
    a = group_axis(w.shape, spec)
    grouped = _groups(w, a)
    absmax = np.max(np.abs(grouped), axis=a + 1, keepdims=True)
    values = nf4_values().astype(np.float64)
    at = np.clip(np.searchsorted(values, grouped / absmax), 1, len(values) - 1)  # the codes around it
    gap = values[at] - values[at - 1]
    return (0.5 * gap * absmax).reshape(w.shape)
