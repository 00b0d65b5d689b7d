"""Weights stored quantized and dequantized inside the step, where the matmul reads them: QLoRA's frozen
base (Dettmers et al. 2023; ``model.lora.quantize``: int8 or nf4) and a model quantized for serving
(``model.quantize``: int8, int4 or fp8). The number formats are ``jaxpar.layers.codes``'.

The quantized arrays are ``Quantized`` variables, not ``nnx.Param``: they never train and the optimizer
holds nothing of them. Which weights (``quantize_weights`` in each layer): GQA's q, k, v, o; MLA's q_a,
q_b (or q), kv_a, kv_b, o; every SwiGLU's gate_up and down; and the routed experts' gate_up and down,
each expert's matrix quantized as a dense MLP's is (the expert dimension, like a stack's layer
dimension, is a batch dimension: scales and groups never span experts). The embedding, the norms, the
router and the LM head keep the parameter dtype.

They keep the weight's logical names (a packed 4-bit format halves its grouped dimension, and scales
split dimensions into their groups or blocks, sharded alike: the layout check asks that those divide
the mesh axes, ``DenseConfig.logical_dims``; a scale dimension of 1 is replicated), so they shard as
the weight did.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from jaxpar.errors import ConfigError
from jaxpar.layers.codes import GROUP, dequantize, group_axis, nf4_values, quantize, step_bound, stored_shapes  # noqa: F401  (re-exported)

KINDS = ("none", "int8", "nf4")  # QLoRA's base (model.lora.quantize); a model's own: config.WeightFormat


class Quantized(nnx.Variable):
    """A stored weight's quantized data or its scales (never trained)."""


def check_kind(kind: str, rank: int) -> None:
    if kind not in KINDS:
        raise ConfigError(f"model.lora.quantize={kind!r}: one of {', '.join(KINDS)}")
    if kind != "none" and not rank:
        raise ConfigError(f"model.lora.quantize={kind}: a quantized base trains adapters (set model.lora.rank)")


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
