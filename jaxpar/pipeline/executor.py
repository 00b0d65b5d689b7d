"""The pipeline executor: any schedule table (``jaxpar.pipeline.schedules``) run inside the jitted step.

The step is one program on every device. ``shard_map`` makes ``stage`` manual, so each stage holds its
own rows of the model's pipelined stack (its stacked ``layers`` axis, split over ``stage`` by the
rules); everything else (embedding, final norm, LM head, a router's non-trained state) is replicated
over ``stage``. A ``lax.scan`` runs the table's ticks, so compile time does not grow with the number of
microbatches. After each tick's work every stage sends its forward output to the next stage and its
input gradient to the previous one (``ppermute``) and files what arrives in the buffer slot the table
names; only the pairs whose message is used at that tick send, so the bytes are exactly one activation
forward and one gradient back per microbatch and chunk boundary.

Two stage programs run the ticks:

- **Each stage its own action** (``jaxpar.pipeline.actions``), with ``grad_reduce=step``: the batch
  axes are manual too (``_reduced_once``: weights gathered once, gradients reduced once after the
  schedule), and what is still split inside a stage is ``tensor`` and ``sequence`` at most, whose
  collectives run among one stage's devices (``own_actions``). A forward tick runs the forward once and
  keeps its residuals, a backward tick the pullback from them; the embedding runs with chunk 0 only, the
  head and loss with the last chunk's forward only.
- **One section a tick** (``jaxpar.pipeline.stage``) for the rest (gradients reduced per section,
  expert parallelism, the ring over a split sequence, a dense prefix): every stage runs the same
  section, chosen by the tick alone (a forward, or one ``vjp`` of each stage's chunk from its own
  input, masked to each stage's action), so that the collectives XLA places inside a section for the
  automatic axes are reached by every stage. B and W recompute the chunk's forward, and the head runs,
  masked, in every vjp section.

Weight gradients accumulate in float32. Layers before the pipelined stack (DeepSeek's dense prefix) run
before the schedule with the embedding, each stage taking m/p of the microbatches (``_prologue``); model
chunk 0 starts from their output, and its input gradients flow back through them after the schedule
(one section a tick only).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxpar.errors import ConfigError
from jaxpar.model_api import LanguageModel
from jaxpar.parallel.manual import GradReduce, batch_axes, gathered, manual_spec, reduced
from jaxpar.pipeline.actions import own_action_body
from jaxpar.pipeline.ops import FsdpGather
from jaxpar.pipeline.stack import StackSplit
from jaxpar.pipeline.stage import AXIS, here, send_patterns, stage_body  # noqa: F401  (send_patterns: re-exported)
from jaxpar.pipeline.timing import executor_bubble_fraction, tick_sections  # noqa: F401  (re-exported)
from jaxpar.rules import active_layout, without_axes


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PipelineResult:
    cross_entropy: jax.Array  # mean over microbatches
    z_loss: jax.Array
    moe: object  # statistics stacked over the stack's layers, mean over microbatches (or None)
    grads: nnx.State  # mean over microbatches, in the parameters' dtypes


def check_stack(
    model_cfg, stages: int, virtual: int, microbatches: int | None = None, first=None, last=None
) -> StackSplit:
    """The split of the model's pipelined stack over stages × virtual stages (``first``/``last``: the
    first and last stage's layers, ``pipeline.first_stage_layers`` / ``last_stage_layers``; None: equal
    chunks). Refuses, naming the fields, a stack that does not split so, or (with a dense prefix)
    microbatches that do not split over the stages."""
    prefix = model_cfg.first_dense_layers
    layers = model_cfg.num_layers - prefix
    if first is None and last is None and layers % (stages * virtual):
        field = "model.num_layers - first_dense_layers" if prefix else "model.num_layers"
        raise ConfigError(
            f"{field}={layers} is not divisible by mesh stage={stages} × "
            f"pipeline.virtual_stages={virtual} = {stages * virtual}: every model chunk needs the "
            "same number of layers (or set pipeline.first_stage_layers / last_stage_layers)"
        )
    split = StackSplit(layers, stages, virtual, first, last)
    if prefix and microbatches is not None and microbatches % stages:
        raise ConfigError(
            f"model.first_dense_layers={prefix}: the dense prefix runs before the schedule with the "
            f"microbatches split over the stages, so pipeline.microbatches={microbatches} must be "
            f"divisible by mesh stage={stages}"
        )
    return split


def pipeline_grads(
    model: LanguageModel,
    ids: dict,
    targets: dict,
    table,
    /,
    *,
    mesh,
    losses: Callable,
    fsdp_gather: FsdpGather = FsdpGather.SECTION,
    grad_reduce: GradReduce = GradReduce.SLICE,
    split: StackSplit | None = None,
    trained=nnx.Param,
) -> PipelineResult:
    """Loss parts and gradients of ``model`` over microbatches ``ids``/``targets`` [m, b, T], by
    ``table``; the same as accumulating over the m microbatches on one device. ``ids``: a dict of ``ids``
    (and, for packed rows, ``positions`` and ``segments``); ``targets``: a dict of ``targets`` (and, for a
    masked loss, ``weights``: ``train.loss.token_weights``); each [m, b, T].

    ``losses(head, x, targets, weights=None) -> (cross_entropy, z_loss)``: of the logits ``head(x)``
    (float32 scalars, means over the microbatch; ``train.loss.head_losses``).
    ``mesh``: the layout's mesh, with ``stage`` = ``table.stages``. ``fsdp_gather``: ``step`` gathers
    the weights over ``fsdp`` once, before the schedule (``FsdpGather``). ``grad_reduce``: ``step``
    makes the batch axes manual too, so the weight gradients stay unreduced over them through the whole
    schedule and are reduced once after it (``_reduced_once``; the weights are then gathered once).
    ``split``: how the stack's layers are split over the chunks (``jaxpar.pipeline.stack``; default an even
    split): ``model``'s stack is in its storage order, and so are the stack's gradients and statistics.
    ``trained``: the variables that get gradients (a filter; the LoRA adapters alone, with a model that has
    them: ``jaxpar.layers.lora.trainable``); the others (a frozen base) ride along with the stage's state."""
    p, v, m = table.stages, table.virtual_stages, table.microbatches
    in_stack = nnx.PathContains(model.pipeline_stack)
    graphdef, sp, op, sr, orest = nnx.split(model, nnx.All(trained, in_stack), trained, in_stack, ...)
    rows = jax.tree.leaves(sp)[0].shape[0]
    split = StackSplit(rows, p, v) if split is None else split
    if (split.stages, split.virtual, split.order.size) != (p, v, rows):
        raise ConfigError(
            f"the state's pipelined stack has {rows} rows; the table's split ({p} stages × {v} chunks × "
            f"{split.rows} rows) stores {split.order.size}: create the state with the same split"
        )
    active = None if split.active.all() else split.active
    ids, targets = _stored(model, ids, targets)
    prefixed = model.prefix_stack is not None
    body = stage_body(graphdef, model.pipeline_stack, table, split.rows, losses, prefixed, active)
    specs = (P(AXIS), P(), P(AXIS), P(), P(), P())
    run = jax.shard_map(
        body,
        mesh=mesh,
        axis_names={AXIS},
        # Unchecked: every stage runs the model's own layer scan (nnx.scan) on its stage's weights, which
        # vary over `stage`, from inputs that do not (zero buffers, the replicated embedding), so the scan's
        # carry changes type and the checker refuses it; making it hold needs pcast inside model code,
        # which never names a mesh axis. The outputs are right by construction: psum where replicated.
        check_vma=False,
        in_specs=specs + (P(),) * prefixed,
        out_specs=(P(AXIS), P(), P(), P(), P(AXIS)) + (P(AXIS),) * prefixed,
    )
    if GradReduce.parse(grad_reduce, field="grad_reduce") == GradReduce.STEP and not prefixed:
        if own_actions(mesh, active_layout()[1], model.execution.context_parallel):
            body = own_action_body(graphdef, model.pipeline_stack, table, split.rows, losses, active)
        run = _reduced_once(body, mesh, sp, op)  # gathers the weights once itself
    elif FsdpGather.parse(fsdp_gather, field="pipeline.fsdp_gather") == FsdpGather.STEP:
        sp, op = _whole_over("fsdp", sp), _whole_over("fsdp", op)
    if prefixed:  # the embedding and the dense prefix, before the schedule
        start, prologue_vjp = jax.vjp(lambda o: _prologue(graphdef, sp, o, sr, orest, ids, mesh=mesh), op)
        dsp, dop, ce, z, stats, dstart = run(sp, op, sr, orest, ids, targets, start)
        dop = jax.tree.map(jnp.add, dop, prologue_vjp(dstart[0])[0])
    else:
        dsp, dop, ce, z, stats = run(sp, op, sr, orest, ids, targets)
    grads = nnx.merge_state(dsp, dop)
    grads = jax.tree.map(lambda g, w: g.astype(w.dtype), grads, nnx.merge_state(sp, op))  # seeded with 1/m
    stats = None if stats is None else jax.tree.map(lambda a: a / m, stats)
    return PipelineResult(ce / m, z / m, stats, grads)


def _stored(model, ids, targets) -> tuple[dict, dict]:
    """The microbatches (``pipeline_grads``' dicts) in the layout's storage order: under zig-zag, the
    tokens and targets permuted once, outside the stages."""
    stored = model.storage_order(ids["ids"].shape[-1])
    if stored is not None:
        ids, targets = jax.tree.map(lambda a: a[..., stored], (ids, targets))
    return ids, targets


def own_actions(mesh, rules, context_parallel: str = "none") -> bool:
    """True where each stage can run its own action (``jaxpar.pipeline.actions``): the batch axes are
    manual, and what is still split inside a stage is ``tensor`` and ``sequence`` at most, whose
    collectives run among the stage's own devices. Not under the ring over a split ``sequence``
    (``context_parallel``): its sends are a collective-permute, which every device of the program
    enters, so it cannot sit in a branch that differs between stages. Not with expert parallelism."""
    inside = {AXIS, "tensor", "sequence", *batch_axes(mesh, rules)}
    ring = str(context_parallel) == "ring" and mesh.shape.get("sequence", 1) > 1
    return not ring and all(n == 1 for axis, n in mesh.shape.items() if axis not in inside)


def _reduced_once(body, mesh, sp, op):
    """``body`` (the stage program) run with the batch axes manual beside ``stage``: each device gathers
    the weights over them once, runs the schedule on its own rows with the weight gradients unreduced
    (a partial sum over its rows), and reduces each gradient once at the end (``jaxpar.parallel.manual``);
    the losses are each device's mean over its rows, averaged."""
    _, rules = active_layout()
    axes = batch_axes(mesh, rules)
    manual = {AXIS, *axes}
    is_var = lambda x: isinstance(x, nnx.Variable)
    sp_specs, op_specs = (
        jax.tree.map(lambda v: manual_spec(v.out_sharding, rules, manual), t, is_leaf=is_var) for t in (sp, op)
    )
    devices = int(np.prod([mesh.shape[a] for a in axes]))
    whole = lambda specs, t: jax.tree.map(lambda s, v: v.replace(gathered(v[...], s, axes)), specs, t)
    summed = lambda specs, t: jax.tree.map(lambda s, g: g.replace(reduced(g[...], s, axes) / devices), specs, t)

    def local(sp, op, sr, orest, ids, targets):
        dsp, dop, ce, z, stats = body(whole(sp_specs, sp), whole(op_specs, op), sr, orest, ids, targets)
        ce, z = (jax.lax.psum(x, axes) / devices for x in (ce, z))
        return summed(sp_specs, dsp), summed(op_specs, dop), ce, z, stats

    rows = P(None, axes)
    return jax.shard_map(
        local,
        mesh=mesh,
        axis_names=manual,
        check_vma=False,  # as the stage program's (pipeline_grads); the reductions are written out here
        in_specs=(sp_specs, op_specs, P(AXIS), P(), rows, rows),
        out_specs=(sp_specs, op_specs, P(), P(), P(AXIS)),
    )


def _whole_over(axis: str, params):
    """``params`` (an ``nnx.State``) constrained to their layout's shardings with ``axis`` left out: each
    parameter gathered over ``axis`` here, once, and whole over it wherever it is used after."""
    mesh, rules = active_layout()

    def one(var):
        spec = without_axes(rules.spec(var.out_sharding), (axis,))
        return var.replace(jax.lax.with_sharding_constraint(var[...], NamedSharding(mesh, spec)))

    return jax.tree.map(one, params, is_leaf=lambda x: isinstance(x, nnx.Variable))


def _prologue(graphdef, sp, op, sr, orest, ids, *, mesh):
    """What enters model chunk 0 for every microbatch, ids [m, b, T] -> [m, b, T, D]: the embedding and
    the layers before the pipelined stack. Each stage runs m/p of the microbatches (the stage axis is a
    batch axis here); the result is gathered for stage 0."""

    def local(sp, op, sr, orest, ids):
        def one(tokens):
            model = nnx.merge(graphdef, *here((sp, op, sr, orest)))
            ids_i, positions, index, _ = model.inputs(tokens["ids"], tokens.get("positions"), stored=True)
            return model.prefix(model.embed(ids_i), positions, index, tokens.get("segments"))

        return jax.lax.map(one, ids)

    return jax.shard_map(
        local,
        mesh=mesh,
        axis_names={AXIS},
        in_specs=(P(AXIS), P(), P(AXIS), P(), P(AXIS)),
        out_specs=P(AXIS),
        # Unchecked: the replicated weights (embedding, dense prefix) are cast to the compute dtype inside,
        # and with vma checking JAX reduces their cotangents over `stage` inside the map, after that cast:
        # in bf16, which XLA:CPU aborts on ("Invalid binary instruction opcode copy") and which would sum
        # gradients in bf16. Unchecked, the reduction happens where they enter, in the parameter dtype.
        check_vma=False,
    )(sp, op, sr, orest, ids)
