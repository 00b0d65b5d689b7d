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
    cp      context parallelism: sequence=-1; activations split along positions, attention by the
            kernel ``execution.context_parallel`` chooses (ring or ulysses; GSPMD gathers K/V with none)
    fsdp_cp fsdp=2 × sequence=-1
    tp_cp   sequence=-1 × tensor=2; between blocks positions are split over sequence × tensor
    pp      pipeline parallelism: stage=-1; the stacked ``layers`` split over ``stage``, run by a schedule
            (``pipeline.schedule``); pp_fsdp, pp_tp, pp_3d add fsdp=-1, tensor=-1, fsdp=2 × tensor=-1
            inside each stage (stage=2)
"""

from __future__ import annotations

import dataclasses

from jaxpar.config import Choice
from jaxpar.errors import suggest
from jaxpar.mesh import AXES, MeshConfig
from jaxpar.rules import LOGICAL_AXES, LayoutError, Rules


@dataclasses.dataclass(frozen=True)
class MeshPreset:
    name: str
    mesh: MeshConfig
    rules: Rules
    doc: str


_REPLICATED = dict.fromkeys(LOGICAL_AXES)  # every logical axis, none sharded

# Tensor parallelism, in training and generation alike: heads, MLP columns and the vocabulary split.
_TENSOR = ("vocab", "heads", "kv_heads", "mlp", "act_heads", "act_kv_heads", "act_mlp", "act_vocab")


class Phase(Choice):
    """What a rules table is for: training, or one phase of generation (``jaxpar.inference.layouts``)."""

    TRAIN = "train"
    PREFILL = "prefill"  # prompts: positions may be split over ``sequence``
    DECODE = "decode"  # one token per row: positions never split


def compose_rules(name: str, axes, /, *, phase: Phase | str = Phase.TRAIN) -> Rules:
    """The one rules table for a mesh that shards over ``axes`` (a set of mesh axis names), in training
    or in a phase of generation. Both: ``data``/``fsdp`` (and ``expert``, expert-major: see
    parallel/moe.py) split the batch; ``expert`` holds whole experts (expert parallelism) and, outside MoE
    layers, splits the batch like a data axis (so its devices never repeat work); ``tensor`` is Megatron
    TP over heads, MLP columns and the vocabulary.

    Training (``_train_rules``): ``fsdp`` also splits the weights' ``embed``; tensor parallelism has
    sequence-parallel activations between blocks; ``sequence`` is context parallelism (every activation
    split along its positions, inside attention by the kernel: ring or Ulysses); ``stage`` splits the
    stacked layers. Generation (``_generation_rules``): moving weights is the worst thing decoding can do,
    so ``fsdp`` is one more batch axis; the KV cache is split like the batch, over ``tensor`` by its
    heads and over ``sequence`` by its slots; prefill splits positions over ``sequence``, decode never."""
    phase = Phase.parse(phase, field="phase")
    rules = dict(_REPLICATED)
    batch = tuple(a for a in ("expert", "data", "fsdp") if a in axes)
    if batch:
        rules["batch"] = batch
    if "expert" in axes:
        rules["experts"] = rules["act_experts"] = "expert"
    if "tensor" in axes:
        rules.update(dict.fromkeys(_TENSOR, "tensor"))
    if phase == Phase.TRAIN:
        return Rules.from_mapping(name, _train_rules(rules, axes))
    return Rules.from_mapping(f"{name}:{phase}", _generation_rules(rules, axes, batch, phase))


def _train_rules(rules: dict, axes) -> dict:
    if "fsdp" in axes:
        rules["embed"] = "fsdp"
    if "tensor" in axes:  # sequence parallelism: the residual stream split along positions between blocks
        rules["length"] = "tensor"
    if "stage" in axes:  # pipeline: each stage holds its layers
        rules["layers"] = "stage"
    if "sequence" in axes:
        rules["inner_length"] = "sequence"
        rules["length"] = ("sequence", "tensor") if "tensor" in axes else "sequence"
    return rules


def _generation_rules(rules: dict, axes, batch: tuple[str, ...], phase: Phase) -> dict:
    rules["cache_batch"] = batch
    if "tensor" in axes:
        rules["cache_kv_heads"] = "tensor"
    if "sequence" in axes:
        rules["cache_length"] = "sequence"
        if phase == Phase.PREFILL:
            rules["length"] = rules["inner_length"] = "sequence"
    return rules


def _preset(name: str, mesh: str, doc: str) -> MeshPreset:
    config = MeshConfig.parse(mesh)
    return MeshPreset(name, config, compose_rules(name, _sharded_axes(config)), doc)


def _sharded_axes(config: MeshConfig) -> set[str]:
    """Axes with a size other than 1 (-1 counts: it will be filled from the device count)."""
    return {a for a in AXES if getattr(config, a) * config.dcn_sizes()[a] != 1}


PRESETS: dict[str, MeshPreset] = {
    p.name: p
    for p in (
        _preset("dp", "data=-1", "data parallel"),
        _preset("fsdp", "fsdp=-1", "fully sharded data parallel (ZeRO-3)"),
        _preset("tp", "tensor=-1", "Megatron tensor parallel with sequence-parallel activations"),
        _preset("fsdp_tp", "fsdp=-1,tensor=2", "FSDP × tensor parallel"),
        _preset("hsdp", "data=2,fsdp=-1", "replicated FSDP groups"),
        _preset("3d", "data=2,fsdp=2,tensor=-1", "data × FSDP × tensor"),
        _preset("cp", "sequence=-1", "context parallel: the sequence split over every device"),
        _preset("fsdp_cp", "fsdp=2,sequence=-1", "FSDP × context parallel"),
        _preset("tp_cp", "sequence=-1,tensor=2", "context parallel × tensor parallel"),
        _preset("pp", "stage=-1", "pipeline parallel: the layers split into stages"),
        _preset("pp_fsdp", "stage=2,fsdp=-1", "pipeline × FSDP inside each stage"),
        _preset("pp_tp", "stage=2,tensor=-1", "pipeline × tensor parallel inside each stage"),
        _preset("pp_3d", "stage=2,fsdp=2,tensor=-1", "pipeline × FSDP × tensor parallel"),
    )
}


def get_mesh_preset(name: str, /, *, flag: str = "--mesh") -> MeshPreset:
    """The preset ``name``; an unknown name raises ``LayoutError`` naming ``flag`` and the closest preset."""
    try:
        return PRESETS[name]
    except KeyError:
        raise LayoutError(
            f"{flag}: unknown mesh preset {name!r}{suggest(name, PRESETS)}; presets are "
            f"{', '.join(PRESETS)}, or give axis sizes like 'data=2,fsdp=-1,tensor=2'"
        ) from None


def resolve_mesh_arg(value: str, /, *, flag: str = "--mesh") -> MeshPreset:
    """A preset name, or an axis spec (``data=2,sequence=2,tensor=2``) with the rules composed for the
    axes it shards."""
    if "=" not in value:
        return get_mesh_preset(value, flag=flag)
    config = MeshConfig.parse(value)
    return MeshPreset(value, config, compose_rules(value, _sharded_axes(config)), "axis spec")
