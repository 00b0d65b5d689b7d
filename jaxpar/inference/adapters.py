"""Serving many LoRA adapters over one base model: one batch, each row its own adapter.

    adapters = [read_peft("sql", "adapters/sql", model), read_peft("chat", "adapters/chat", model)]
    engine = Engine(model, adapters=adapters)
    engine.submit(Request("a", prompt, 32, adapter=engine.adapters["sql"]))

``with_bank`` rebuilds the base model with a *bank* per targeted projection (``jaxpar.layers.lora``,
``LoraConfig.bank``): slot 0 holds zeros (the base model itself), slot i + 1 adapter i. Adapters may
differ in rank, alpha and targets: the bank has the largest rank (a smaller adapter's extra rank columns
are zeros, which add nothing), the union of the targets (an adapter without a target reads zeros there),
and each adapter's own ``alpha / rank`` folded into its ``B`` (so the bank's scale is 1). Every row
of a step takes its own slot (``lora.select``, ``lora.delta``), so a batch of mixed adapters costs one
program, the one a batch of one adapter runs.

A base model that carries adapters of its own (a LoRA run) is served merged (``merged_state``), and a
quantized (QLoRA) base dequantized: the bank is the only adapter the served model has.
"""

from __future__ import annotations

import dataclasses
import os

import jax
import numpy as np
from flax import nnx

from jaxpar.convert.peft import adapter_config, read_adapter
from jaxpar.errors import ConfigError
from jaxpar.layers.lora import EXPERT_TARGETS, TARGETS, LoraConfig, LoraParam, merged_state
from jaxpar.model_api import LanguageModel
from jaxpar.models import build_model


@dataclasses.dataclass(frozen=True)
class Adapter:
    """One adapter, read to the host: its name (what a request's ``model`` says), its ``LoraConfig``,
    and its arrays by their path in a model built with that config (stacked form)."""

    name: str
    lora: LoraConfig
    arrays: dict[tuple[str, ...], np.ndarray]


def _abstract(model: LanguageModel, lora: LoraConfig) -> LanguageModel:
    cfg = dataclasses.replace(model.cfg, lora=lora)
    return nnx.eval_shape(lambda: build_model(cfg, execution=model.execution, rngs=nnx.Rngs(0)))


def read_peft(name: str, folder: str | os.PathLike, model: LanguageModel) -> Adapter:
    """The PEFT adapter folder ``folder`` for ``model``'s architecture, read to the host as ``name``."""
    lora = adapter_config(folder, model.cfg)
    return Adapter(name, lora, read_adapter(_abstract(model, lora), folder))


def _base(model: LanguageModel) -> LanguageModel:
    """``model`` without adapters of its own: merged into the weights (dequantized when QLoRA)."""
    if not model.cfg.lora.rank:
        return model
    plain = _abstract(model, LoraConfig())
    return nnx.merge(nnx.graphdef(plain), merged_state(model))


def _fill(var, adapters: list[Adapter], path: tuple[str, ...], is_b: bool) -> np.ndarray:
    """One bank array: zeros in slot 0, adapter i's array (B scaled by its alpha / rank) in slot i + 1,
    its rank in the leading columns of the bank's rank axis."""
    value, names = var.get_value(), var.get_metadata()["out_sharding"]
    bank = np.zeros(value.shape, np.float32)
    at, rank_axis = names.index(None), names.index("lora_rank")  # the bank axis is the unnamed one
    for i, adapter in enumerate(adapters):
        if path not in adapter.arrays:  # not one of this adapter's targets
            continue
        array = adapter.arrays[path].astype(np.float32) * (adapter.lora.scale if is_b else 1.0)
        box = [slice(None)] * value.ndim
        box[at], box[rank_axis] = i + 1, slice(0, adapter.lora.rank)
        bank[tuple(box)] = array
    return bank.astype(value.dtype)


def with_bank(model: LanguageModel, adapters: list[Adapter]) -> LanguageModel:
    """``model`` (base weights, shared) with a bank of ``adapters`` in slots 1… (module doc)."""
    names = [a.name for a in adapters]
    if not adapters or len(set(names)) != len(names):
        raise ConfigError(f"adapters: {names}: give at least one, each with a name of its own")
    experts = [a.name for a in adapters if set(EXPERT_TARGETS) & set(a.lora.names)]
    if experts:
        raise ConfigError(f"adapters: {experts[0]} adapts the routed experts, which a bank does not serve")
    base = _base(model)
    targets = [t for t in TARGETS if any(t in a.lora.names for a in adapters)]
    rank = max(a.lora.rank for a in adapters)
    lora = LoraConfig(rank=rank, alpha=float(rank), targets=",".join(targets), bank=len(adapters) + 1)
    graphdef, state = nnx.split(_abstract(base, lora))
    plain = dict(nnx.to_flat_state(nnx.state(base)))
    flat = []
    for keys, var in nnx.to_flat_state(state):
        path = tuple(str(getattr(k, "key", k)) for k in keys)
        if isinstance(var, LoraParam):
            var = var.replace(jax.numpy.asarray(_fill(var, adapters, path, is_b=path[-1].endswith("_lora_b"))))
        else:
            var = var.replace(plain[keys].get_value())
        flat.append((keys, var))
    return nnx.merge(graphdef, nnx.from_flat_state(flat))
