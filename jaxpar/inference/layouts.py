"""Decode layouts: the rule tables generation runs under, checked by the same layout check as training.

A generation mesh has the training axes; what changes is what they are for. Decoding reads every weight
and the whole KV cache once per token, so moving weights (FSDP) is the worst thing it can do and the
cache is the thing to split:

    decode_tp   tensor=-1: weights as in tensor-parallel training (heads, kv heads, mlp, vocab over
                ``tensor``), nothing on ``fsdp``; the cache's kv heads over ``tensor``, its batch over
                ``data``. TP buys latency: every device reads 1/t of the weights per token.
    decode_dp   data=-1: weights replicated, batch and cache split. DP buys throughput.
    decode_ep   expert=-1 (MoE): whole experts over ``expert`` (dropless routing, ragged exchange); the
                attention batch and the cache over data × expert.
    prefill_cp  sequence=-1: long prompts. Prefill runs ring attention over ``sequence`` and leaves the
                cache split along its slots; decode attends over each device's slots and combines the
                partial softmaxes (``jaxpar.parallel.decode``): the cache never moves.

Any mesh spec (``data=2,tensor=4``) composes its tables the same way; ``fsdp`` splits the batch like
``data`` (its weight job is off) and ``stage`` is refused. There are two tables per mesh, one per phase:
prefill splits positions (``length``, ``inner_length``) over ``sequence``; decode, one token per row,
never splits them.

Fewer kv heads than ``tensor`` (GQA, MQA; MLA caches one latent per token: one "kv head"): the weights'
kv heads are replicated as in training, but the cache must not be, or it costs t/K times the memory.
The check moves the ``tensor`` ways from the cache's heads to its batch (attention runs data-parallel
over them: two all-to-alls of one token's q and output per layer), or, when the batch does not divide,
to its slots (the partial-softmax combine). Per-device cache bytes = total / devices, never more.
"""

from __future__ import annotations

import dataclasses
import math

import jax
from flax import nnx

from jaxpar.errors import LayoutError, suggest
from jaxpar.execution import ContextParallel, ExecutionConfig, Remat, TokenOrder
from jaxpar.layout import Layout, check_model_layout
from jaxpar.mesh import AXES, MeshConfig, build_mesh
from jaxpar.meshes import PRESETS as TRAINING
from jaxpar.meshes import Phase, compose_rules
from jaxpar.parallel.flash import check_kernel
from jaxpar.rules import Dim, Rules

PRESETS: dict[str, str] = {
    "decode_tp": "tensor=-1",
    "decode_dp": "data=-1",
    "decode_ep": "expert=-1",
    "prefill_cp": "sequence=-1",
}


def mesh_config(value: str, /, *, flag: str = "--mesh") -> tuple[str, MeshConfig]:
    """(name, MeshConfig) of a decode preset, a training preset's mesh, or an axis spec."""
    if "=" in value:
        return value, MeshConfig.parse(value)
    if value in PRESETS:
        return value, MeshConfig.parse(PRESETS[value])
    if value in TRAINING:
        return value, TRAINING[value].mesh
    raise LayoutError(
        f"{flag}: unknown layout {value!r}{suggest(value, list(PRESETS) + list(TRAINING))}; decode "
        f"layouts are {', '.join(PRESETS)}, or give axis sizes like 'data=2,tensor=4'"
    )


@dataclasses.dataclass(frozen=True)
class InferenceLayout:
    """A mesh and its two checked tables: ``prefill`` and ``decode`` (they differ in positions only)."""

    mesh: jax.sharding.Mesh
    prefill: Rules
    decode: Rules

    def phase(self, name: str) -> Layout:
        return Layout(self.mesh, getattr(self, name))

    def sharding(self, names) -> jax.sharding.NamedSharding:
        return jax.sharding.NamedSharding(self.mesh, self.decode.spec(names))


def build_inference_mesh(value: str, /, *, devices=None, flag: str = "--mesh") -> tuple[str, jax.sharding.Mesh]:
    name, config = mesh_config(value, flag=flag)
    n = len(jax.devices() if devices is None else devices)
    if config.resolve(n).stage > 1:
        raise LayoutError(
            f"{flag} {value}: stage={config.resolve(n).stage}, but generation does not pipeline; "
            f"use a decode layout ({', '.join(PRESETS)}) or an axis spec without stage"
        )
    return name, build_mesh(config, devices=devices)


def cache_dims(cfg, batch: int, slots: int) -> dict[str, Dim]:
    """What the cache's logical axes govern: batch, slots (a sliding window keeps at most the window),
    and kv heads (an MLA cache holds one latent per token: one)."""
    heads = (
        Dim(1, "MLA's latent cache (one per token)") if cfg.uses_mla else Dim(cfg.num_kv_heads, "model.num_kv_heads")
    )
    s = min(slots, cfg.sliding_window or slots)
    return dict(
        batch=Dim(batch, "batch (prompts)"),
        cache_batch=Dim(batch, "batch (prompts)"),
        cache_length=Dim(s, "cache length (prompt + max new tokens, bucketed)"),
        cache_kv_heads=heads,
    )


def place_cache(dims: dict[str, Dim], rules: Rules, shape) -> dict[str, tuple[str, ...]]:
    """The cache rules that keep it unreplicated: with fewer kv heads than their mesh axes, those ways
    go to the cache's batch, or else to its slots. Refuses when neither divides."""
    heads = dims["cache_kv_heads"]
    spare = rules["cache_kv_heads"]
    ways = math.prod(shape[a] for a in spare)
    if heads.size % ways == 0:
        return {}
    where = "×".join(f"{a}={shape[a]}" for a in spare)
    if ways % heads.size:
        raise LayoutError(
            f"{heads.field}={heads.size} (logical axis 'cache_kv_heads') neither divides nor is "
            f"divided by mesh axes {where} = {ways}"
        )
    for axis in ("cache_batch", "cache_length"):
        have = math.prod(shape[a] for a in rules[axis])
        if dims[axis].size % (have * ways) == 0:
            return {"cache_kv_heads": (), axis: rules[axis] + spare}
    raise LayoutError(
        f"{heads.field}={heads.size} is fewer than {where}: the cache would be replicated {ways // heads.size}×. "
        f"Neither {dims['cache_batch'].field}={dims['cache_batch'].size} nor the {dims['cache_length'].field}="
        f"{dims['cache_length'].size} divides the {ways} ways (times their own split); change the batch or the "
        f"tensor size"
    )


def generation_execution(execution: ExecutionConfig | None = None, /, *, sequence_split: bool = False):
    """``execution`` (default ``ExecutionConfig()``) with what generation needs: no remat, natural token
    order, dropless MoE routing, and ring attention for prefill when positions are split
    (``sequence_split``) and ``execution`` names no context-parallel kernel."""
    execution = ExecutionConfig() if execution is None else execution
    changes = dict(remat=Remat.NONE, cp_order=TokenOrder.CONTIGUOUS, capacity_factor=None)
    if sequence_split and execution.context_parallel == ContextParallel.NONE:
        changes["context_parallel"] = ContextParallel.RING
    return dataclasses.replace(execution, **changes)


def check_inference_layout(
    cfg, mesh, name: str, *, batch: int, prompt: int, slots: int, execution: ExecutionConfig | None = None
) -> InferenceLayout:
    """Both phase tables for ``cfg`` on ``mesh``, checked for ``batch`` prompts padded to ``prompt``
    positions and a cache of ``slots``, run as ``execution`` says (default: ``generation_execution``'s for
    this mesh); raises ``LayoutError`` naming field, axis and numbers."""
    if execution is None:
        execution = generation_execution(sequence_split=mesh.shape["sequence"] > 1)
    check_kernel(execution.attention_impl, mesh.devices.flat[0].platform, execution.context_parallel)
    shape = dict(mesh.shape)
    axes = {a for a in AXES if shape[a] > 1}
    cache = cache_dims(cfg, batch, slots)
    tables = []
    for phase, seq in ((Phase.PREFILL, prompt), (Phase.DECODE, 1)):
        rules = compose_rules(name, axes, phase=phase)
        rules = rules.replace(**place_cache(cache, rules, shape))
        tables.append(
            check_model_layout(
                cfg, execution, rules, shape, batch=cache["batch"], seq=Dim(seq, "prompt bucket"), extra_dims=cache
            )
        )
    return InferenceLayout(mesh, *tables)


def weight_layout(cfg, mesh, name: str) -> Layout:
    """Where the weights live for generation on ``mesh`` (independent of batch and cache)."""
    return check_inference_layout(
        cfg,
        mesh,
        name,
        batch=_ways(mesh, ("expert", "data", "fsdp", "tensor", "sequence")),
        prompt=_ways(mesh, ("sequence",)) * 2,
        slots=_ways(mesh, ("sequence", "tensor")) * 2,
    ).phase("decode")


def _ways(mesh, axes) -> int:
    return math.prod(mesh.shape[a] for a in axes)


def placed_state(model, layout: Layout):
    """A copy of ``model``'s state with every parameter on ``layout`` (one ``jax.device_put``); the
    model itself is left where it is."""
    with layout.activate():
        state = nnx.state(model)
        shardings = nnx.get_named_sharding(state, layout.mesh)
    return jax.device_put(state, shardings)


def reshard(model, layout: Layout):
    """``model`` with every parameter moved to ``layout`` (e.g. from a training layout to a decode
    layout); the model object is updated in place and returned."""
    nnx.update(model, placed_state(model, layout))
    return model
