"""Hugging Face checkpoints in and out: ``model = from_hf(folder, mesh=...)``, ``to_hf(model, folder)``.

Import streams: every parameter is created with ``jax.make_array_from_callback``, whose callback reads
exactly the box of the HF tensors that one device's shard needs (``mapping.read_shard``), so no full
copy of the model is ever assembled on the host. A layer-stacked parameter with large shards is filled
one layer at a time into a donated device buffer. Host memory above the finished model is thus bounded
by one layer's shards of one parameter (or one whole unstacked parameter: the embedding, the LM head)
plus the pages of the safetensors files mapped while it is read; files are closed after each parameter.
``benchmarks/convert_memory.py`` measures it.

Export gathers one HF tensor at a time (one layer's, one expert's) from the devices and writes
safetensors files of at most ``max_shard_bytes``, into a temporary folder renamed into place at the end.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jax
import numpy as np
from flax import nnx

from jaxpar.checkpoint import abstract_like
from jaxpar.convert.families import FAMILIES, Family, check_fields, family_of, guess_family, sources
from jaxpar.convert.files import ConvertError, HFFolder, ShardWriter
from jaxpar.convert.mapping import read_shard, write_pieces
from jaxpar.convert.peft import adapter_config, load_adapter, save_adapter
from jaxpar.errors import JaxparError
from jaxpar.layers.lora import SPECS, LoraConfig, LoraParam, merged_state
from jaxpar.layers.quant import quantized_like
from jaxpar.models import build_model
from jaxpar.shardings import default_layout

__all__ = ["from_hf", "to_hf", "hf_config", "save_adapter", "ConvertError", "FAMILIES"]

# A layer-stacked parameter whose shard per device is larger than this is placed one layer at a time
# (smaller ones in one go: one compiled update per parameter costs more than it saves).
LAYERWISE_BYTES = 16 << 20


def hf_config(folder: str | os.PathLike, *, param_dtype: str = "float32", **overrides):
    """The jaxpar config of a Hugging Face folder (fields checked against the family's allow-list),
    with its family."""
    hf = HFFolder(folder)
    where = str(Path(folder) / "config.json")
    fam = family_of(hf.config, where)
    check_fields(hf.config, fam, where)
    try:
        cfg = fam.to_ours(hf.config)
    except KeyError as err:
        raise ConvertError(f"{where}: the field {err.args[0]!r} is missing ({fam.model_type} needs it)") from None
    except (TypeError, ValueError) as err:
        if isinstance(err, JaxparError):  # already names the field (e.g. model.num_kv_heads=0)
            raise
        raise ConvertError(f"{where}: a field has a value of the wrong type ({err})") from None
    return dataclasses.replace(cfg, param_dtype=param_dtype, **overrides), fam, hf


def _path(keys) -> tuple[str, ...]:
    return tuple(str(getattr(k, "key", k)) for k in keys)


def _plan(cfg, fam: Family, hf: HFFolder, state) -> dict:
    """Our flat state's paths -> Source, every HF tensor checked for presence and shape; HF tensors
    nobody reads are refused."""
    table = sources(cfg, fam)
    plan, used, available = {}, set(), hf.names()  # names() builds a set: once, not per tensor
    hf_sizes = {"v": cfg.vocab_size}
    for keys, var in nnx.to_flat_state(state):
        path = _path(keys)
        if isinstance(var, LoraParam):  # the adapters: fresh, or a PEFT folder's (from_hf)
            plan[path] = None
            continue
        if path not in table:
            if path[-1] == "router_bias":  # families without a selection bias: it stays zero
                plan[path] = None
                continue
            raise ConvertError(f"no Hugging Face source for parameter {'/'.join(path)} in family {fam.model_type}")
        src = table[path]
        shape = tuple(var.get_value().shape)
        for name in src.all_hf_names(shape):
            if name not in available:
                raise ConvertError(f"{hf.folder}: tensor {name} is missing (needed for {'/'.join(path)})")
            want = src.hf_shape(shape, hf_sizes)
            if hf.shape(name) != want:
                raise ConvertError(
                    f"{hf.where[name].name}: tensor {name} has shape {list(hf.shape(name))}, "
                    f"the config says {list(want)}"
                )
            used.add(name)
        plan[path] = src
    extra = sorted(available - used - _skipped(hf, cfg))
    if extra:
        raise ConvertError(
            f"{hf.where[extra[0]].name}: tensor {extra[0]} is not part of a {fam.model_type} model "
            f"this config describes ({len(extra)} such tensors)"
        )
    return plan


def _skipped(hf: HFFolder, cfg) -> set[str]:
    """Tensors that are not part of the model's function: rotary caches some exporters write, and
    DeepSeek's multi-token-prediction layers (numbered after the last decoder layer)."""
    mtp = tuple(f"model.layers.{cfg.num_layers + i}." for i in range(hf.config.get("num_nextn_predict_layers") or 0))
    return {n for n in hf.names() if n.endswith("rotary_emb.inv_freq") or (mtp and n.startswith(mtp))}


def from_hf(
    folder: str | os.PathLike,
    mesh=None,
    *,
    param_dtype: str = "float32",
    execution: Mapping[str, Any] | None = None,
    layout=None,
    adapter: str | os.PathLike | None = None,
    **overrides,
):
    """A jaxpar model from a Hugging Face folder, its parameters placed shard by shard on ``mesh`` (a
    mesh preset name or spec such as ``"fsdp=4,tensor=2"``; None: one device), or on ``layout`` (a
    ``jaxpar.layout.Layout``, e.g. a training run's: ``jaxpar train --init-from``). ``model(ids)`` with int32
    ids [B, T] returns float32 logits [B, T, V]. ``overrides`` set model config fields; the model runs as
    the family's HF implementation does (``Family.execution``) with the ``execution`` changes (e.g.
    ``{"remat": "none"}``). ``adapter``: a PEFT LoRA folder (``jaxpar.convert.peft``) whose adapters the
    model carries; or ``lora=LoraConfig(...)`` among ``overrides`` for fresh ones."""
    cfg, fam, hf = hf_config(folder, param_dtype=param_dtype, **overrides)
    stored, cfg = cfg.quantize, dataclasses.replace(cfg, quantize="none")  # read in float, then quantize
    if adapter is not None:
        cfg = dataclasses.replace(cfg, lora=adapter_config(adapter, cfg, family=fam.model_type))
    run = dataclasses.replace(fam.execution(hf.config), **dict(execution or {}))
    try:
        if layout is None:
            layout = default_layout(cfg, mesh or "dp", devices=None if mesh else jax.devices()[:1], execution=run)
        with layout.activate():
            abstract = nnx.eval_shape(lambda: build_model(cfg, execution=run, rngs=nnx.Rngs(0)))
            graphdef, state = nnx.split(abstract)
            shardings = nnx.get_named_sharding(state, layout.mesh)
        plan = _plan(cfg, fam, hf, state)
        by_path = {_path(k): v.get_value() for k, v in nnx.to_flat_state(shardings)}
        flat = nnx.to_flat_state(state)
        for keys, var in flat:
            path = _path(keys)
            value = var.get_value()
            var.set_value(
                _place(plan[path], tuple(value.shape), np.dtype(value.dtype), by_path[path], hf, {"v": cfg.vocab_size})
            )
            hf.close()  # unmap what this parameter read
        model = nnx.merge(graphdef, nnx.from_flat_state(flat))
        if adapter is not None:
            load_adapter(model, adapter, family=fam.model_type)
        elif cfg.lora.rank:
            _fresh_adapters(model, lambda: build_model(cfg, execution=run, rngs=nnx.Rngs(0)), layout)
    finally:
        hf.close()
    if stored != "none":
        model = quantized_model(model, stored, layout)
    model.layout = layout
    return model


def quantized_model(model, kind: str, layout):
    """``model`` with its projections stored as ``kind`` (``model.quantize``: ``jaxpar.layers.codes``),
    placed on ``layout``."""
    cfg = dataclasses.replace(model.cfg, quantize=kind)
    with layout.activate():
        abstract = nnx.eval_shape(lambda: build_model(cfg, execution=model.execution, rngs=nnx.Rngs(0)))
        graphdef, target = nnx.split(abstract)
        target = abstract_like(target, nnx.get_named_sharding(target, layout.mesh))
    return nnx.merge(graphdef, quantized_like(target, nnx.state(model), SPECS, kind))


def _fresh_adapters(model, build, layout) -> None:
    """Initializes ``model``'s adapters as ``build`` does, compiling only their part of it (the base
    weights it would make are unused outputs, which XLA drops)."""
    with layout.activate():
        shardings = nnx.get_named_sharding(nnx.state(model, LoraParam), layout.mesh)
        nnx.update(model, jax.jit(lambda: nnx.state(build(), LoraParam), out_shardings=shardings)())


def _place(src, shape, dtype, sharding, hf: HFFolder, hf_sizes) -> jax.Array:
    """The parameter, placed shard by shard; a layer-stacked one layer at a time into a donated
    buffer (so the host holds one layer's shards, not the whole stack)."""
    spec = tuple(sharding.spec) + (None,) * (len(shape) - len(sharding.spec))
    shard_bytes = np.prod(sharding.shard_shape(shape)) * np.dtype(dtype).itemsize
    if src is not None and src.ours[0] == "L" and spec[0] is None and shard_bytes > LAYERWISE_BYTES:
        layer = jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec(*spec[1:]))
        put = jax.jit(
            lambda x, piece, l: jax.lax.dynamic_update_index_in_dim(x, piece, l, 0),
            donate_argnums=0,
            out_shardings=sharding,
        )
        x = jax.jit(lambda: jax.numpy.zeros(shape, dtype), out_shardings=sharding)()
        for l in range(shape[0]):
            piece = _from_reads(
                lambda index, l=l: read_shard(src, shape, (slice(l, l + 1), *index), hf.read, hf_sizes, dtype)[0],
                shape[1:],
                layer,
            )
            x = put(x, piece, l)
        return x
    if src is None:
        return _from_reads(
            lambda index: np.zeros([len(range(*s.indices(n))) for s, n in zip(index, shape)], dtype), shape, sharding
        )
    return _from_reads(lambda index: read_shard(src, shape, index, hf.read, hf_sizes, dtype), shape, sharding)


def _from_reads(read, shape, sharding) -> jax.Array:
    """``jax.make_array_from_callback`` reading each distinct shard once (replicas share it)."""
    cache: dict = {}

    def shard(index):
        key = tuple((s.start, s.stop) for s in index)
        if key not in cache:
            cache[key] = read(index)
        return cache[key]

    return jax.make_array_from_callback(shape, sharding, shard)


def to_hf(
    model,
    folder: str | os.PathLike,
    *,
    family: str | None = None,
    max_shard_bytes: int = 2 << 30,
    dtype: str | None = None,
) -> Path:
    """Write ``model`` as a Hugging Face folder (config.json, safetensors, index when sharded) that
    ``transformers`` loads. ``family``: a model_type of ``FAMILIES`` (default: inferred from the config);
    ``dtype``: the tensors' dtype (default: the parameters'). ``folder`` must not exist. A model with LoRA
    adapters is written merged: each adapted weight with its adapter folded in (``merged_state``); a
    quantized model's weights are written dequantized."""
    cfg = model.cfg
    state = merged_state(model) if cfg.lora.rank or cfg.quantize != "none" else nnx.state(model)
    cfg = dataclasses.replace(cfg, lora=LoraConfig(), quantize="none")
    fam = FAMILIES[family] if family else guess_family(cfg)
    config = fam.to_hf(cfg, model.execution)
    table = sources(cfg, fam)
    writer = ShardWriter(folder, max_shard_bytes=max_shard_bytes)
    try:
        for keys, var in nnx.to_flat_state(state):
            path = _path(keys)
            array = var.get_value()
            if path not in table:
                if path[-1] == "router_bias" and not np.any(np.asarray(array)):
                    continue  # all-zero selection bias: no HF tensor needed
                raise ConvertError(f"{'/'.join(path)}: {fam.model_type} has no tensor for it")
            for name, x in write_pieces(
                table[path], lambda at, a=array: np.asarray(a[at]), array.shape, {"v": cfg.vocab_size}
            ):
                writer.add(name, x.astype(jax.numpy.dtype(dtype or x.dtype)))
        config["torch_dtype"] = str(jax.numpy.dtype(dtype or cfg.param_dtype))
        return writer.commit(config)
    except BaseException:
        writer.abort()
        raise
