"""Layout presets: axis sizes plus the one rules table that goes with them.

Every table names all logical axes (see ``jaxpar.rules``); there are no fallbacks. A ``-1`` size is
filled from the device count, so each preset works on any device count its fixed axes divide.

    dp      plain data parallelism: weights replicated, batch split, one gradient all-reduce per step
    fsdp    ZeRO-3: weights, gradients and optimizer state sharded on ``embed``; batch split the same way
    tp      Megatron tensor parallelism: attention heads and MLP columns split (column-parallel in,
            row-parallel out); between blocks the residual stream is split along ``length``
            (sequence parallelism), so each all-reduce becomes an all-gather + reduce-scatter pair
    fsdp_tp FSDP across nodes, TP within one (tensor=2)
    hsdp    hybrid sharded data parallel: replicas (data=2) of FSDP groups (fsdp=-1)
    3d      data=2 × fsdp=2 × tensor=-1
"""
from __future__ import annotations

import dataclasses

from jaxpar.mesh import MeshConfig, suggest
from jaxpar.rules import LayoutError, Rules


@dataclasses.dataclass(frozen=True)
class MeshPreset:
    name: str
    mesh: MeshConfig
    rules: Rules
    doc: str


_REPLICATED = dict.fromkeys(
    ("vocab", "embed", "heads", "kv_heads", "head_dim", "mlp", "layers", "norm",
     "batch", "length", "inner_length", "act_embed", "act_heads", "act_kv_heads", "act_mlp", "act_vocab"))

# Tensor parallelism: heads/mlp/vocab split; the residual stream split along length between blocks.
_TENSOR = dict(vocab="tensor", heads="tensor", kv_heads="tensor", mlp="tensor", length="tensor",
               act_heads="tensor", act_kv_heads="tensor", act_mlp="tensor", act_vocab="tensor")


def _preset(name: str, mesh: str, doc: str, **rules) -> MeshPreset:
    return MeshPreset(name, MeshConfig.parse(mesh), Rules.from_mapping(name, {**_REPLICATED, **rules}), doc)


PRESETS: dict[str, MeshPreset] = {p.name: p for p in (
    _preset("dp", "data=-1", "data parallel", batch="data"),
    _preset("fsdp", "fsdp=-1", "fully sharded data parallel (ZeRO-3)", batch="fsdp", embed="fsdp"),
    _preset("tp", "tensor=-1", "Megatron tensor parallel with sequence-parallel activations", **_TENSOR),
    _preset("fsdp_tp", "fsdp=-1,tensor=2", "FSDP × tensor parallel", batch="fsdp", embed="fsdp", **_TENSOR),
    _preset("hsdp", "data=2,fsdp=-1", "replicated FSDP groups", batch=("data", "fsdp"), embed="fsdp"),
    _preset("3d", "data=2,fsdp=2,tensor=-1", "data × FSDP × tensor", batch=("data", "fsdp"), embed="fsdp",
            **_TENSOR),
)}


def get_mesh_preset(name: str, /) -> MeshPreset:
    try:
        return PRESETS[name]
    except KeyError:
        raise LayoutError(f"--mesh: unknown mesh preset {name!r}{suggest(name, PRESETS)}; presets are {', '.join(PRESETS)}, "
                          "or give axis sizes like 'data=2,fsdp=-1,tensor=2'") from None


def resolve_mesh_arg(value: str, /) -> MeshPreset:
    """A preset name, or an axis spec; a spec gets the rules of the preset sharding the same axes."""
    if "=" not in value:
        return get_mesh_preset(value)
    config = MeshConfig.parse(value)
    shape = {a: getattr(config, a) * config.dcn_sizes()[a] for a in ("data", "fsdp", "tensor")}
    sharded = tuple(a for a in ("data", "fsdp", "tensor") if shape[a] != 1)
    by_axes = {("data",): "dp", ("fsdp",): "fsdp", ("tensor",): "tp", ("fsdp", "tensor"): "fsdp_tp",
               ("data", "fsdp"): "hsdp", ("data", "fsdp", "tensor"): "3d", (): "dp",
               ("data", "tensor"): "3d"}
    base = PRESETS[by_axes[sharded]]
    return MeshPreset(f"{base.name}[{value}]", config, base.rules, base.doc)
