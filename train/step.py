"""Sharded initialisation and the jitted train step.

State is ``nnx.state((model, optimizer))``: parameters plus optimizer moments, each carrying the logical
names of its dimensions. Shardings come from those names through the layout's rules; the state is created
directly in its shards by ``jit(out_shardings=...)`` (never whole on one device) and donated to every step.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import NamedSharding

from jaxpar.errors import ConfigError
from jaxpar.layers.lora import trainable
from jaxpar.layout import Layout
from jaxpar.pipeline.executor import pipeline_grads
from jaxpar.pipeline.stack import StackSplit
from jaxpar.rules import constrain, without_axes
from jaxpar.train.accumulate import GradReduce, batch_axes, check_reduce_once, reduced_once, slice_sums
from jaxpar.train.loss import Batch, LossParts, head_losses, next_token_loss, token_weights


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StepMetrics:
    loss: jax.Array  # mean next-token cross-entropy (float32), without the z-loss term
    grad_norm: jax.Array  # global norm of the gradient of the whole objective, before clipping
    z_loss: jax.Array  # the z-loss term that was added to the objective (0 when off)
    moe: Any = None  # MoE models: jaxpar.layers.MoEStats stacked over the MoE layers [L, ...]
    extra: Any = None  # the objective's own logged means ({name: scalar}), e.g. DPO's rewards


@dataclasses.dataclass(frozen=True)
class TrainState:
    """What a training run holds: the graph (static), the state arrays and their shardings. ``stack``:
    the pipeline's split of the pipelined stack when the state holds it in storage order
    (``jaxpar.pipeline.stack``), else None (layer order)."""

    graphdef: Any
    state: Any
    shardings: Any
    stack: StackSplit | None = None


@dataclasses.dataclass(frozen=True)
class InitProgram:
    """The sharded initialisation, not yet run: ``create()`` returns the state arrays; ``abstract`` is
    that state's shapes and dtypes (``nnx.eval_shape``), e.g. to check a checkpoint against. With a
    ``stack`` split that stores the pipelined stack in another order, ``create``, ``abstract`` and
    ``shardings`` are in storage order, and ``saved`` (``SavedForm``) converts to and from the layer order
    checkpoints hold."""

    graphdef: Any
    shardings: Any
    create: Callable[[], Any]
    abstract: Any
    stack: StackSplit | None = None
    saved: SavedForm | None = None

    @property
    def checkpoint_abstract(self):
        return self.abstract if self.saved is None else self.saved.abstract

    @property
    def checkpoint_shardings(self):
        return self.shardings if self.saved is None else self.saved.shardings


@dataclasses.dataclass(frozen=True)
class SavedForm:
    """The state in layer order (what checkpoints hold) beside a storage-ordered one: its ``abstract`` and
    ``shardings`` (the stack unsplit over ``stage`` where its layers do not divide it), and the jitted
    conversions ``stored(layer-order state)`` and ``unstored(storage-order state)``."""

    abstract: Any
    shardings: Any
    stored: Callable[[Any], Any]
    unstored: Callable[[Any], Any]


def init_program(
    make_model: Callable[[nnx.Rngs], nnx.Module],
    make_tx: Callable[[nnx.Module], optax.GradientTransformation],
    layout: Layout,
    /,
    *,
    seed: int = 0,
    stack: StackSplit | None = None,
) -> InitProgram:
    """``InitProgram``: ``create()`` is jitted with ``out_shardings`` from the
    parameters' logical names, so XLA computes each shard on its own device (partitionable RNG) and no
    device ever holds the whole model. Nothing is allocated until ``create()`` is called.

    ``make_tx(model)`` builds the optimizer (it may read parameter metadata, e.g. for a decay mask).
    ``stack``: the pipeline's split of the pipelined stack (``jaxpar.pipeline.stack``); the state is made
    in its storage order (the executor's: no step moves a weight between stages).
    """

    def create():
        model = make_model(nnx.Rngs(params=seed))
        return model, nnx.Optimizer(model, make_tx(model), wrt=trainable(model))  # adapters alone, with LoRA

    with layout.activate():
        abstract_model = nnx.eval_shape(create)
        graphdef, abstract = nnx.split(abstract_model)
        shardings = nnx.get_named_sharding(abstract, layout.mesh)
    make = jax.jit(lambda: nnx.state(create()), out_shardings=shardings)
    if stack is None or stack.identity:
        return InitProgram(graphdef, shardings, make, abstract, None if stack is None else stack)
    name = abstract_model[0].pipeline_stack
    stored = jax.eval_shape(lambda s: stack.stored(s, name), abstract)
    layer_order = stack.stack_leaves(shardings, name, lambda s: _unsplit_over_stage(s, stack.layers))
    to_storage = jax.jit(lambda s: stack.stored(s, name), out_shardings=shardings)
    to_layers = jax.jit(lambda s: stack.unstored(s, name), out_shardings=layer_order)
    saved = SavedForm(abstract, layer_order, to_storage, to_layers)
    create_stored = jax.jit(lambda: stack.stored(nnx.state(create()), name), out_shardings=shardings)
    return InitProgram(graphdef, shardings, create_stored, stored, stack, saved)


def _unsplit_over_stage(sharding, layers: int):
    """``sharding`` of a stack leaf, with ``stage`` dropped from its layer axis where ``layers`` does
    not divide it (an uneven split's layer-order form)."""
    if not isinstance(sharding, NamedSharding) or layers % sharding.mesh.shape["stage"] == 0:
        return sharding
    return NamedSharding(sharding.mesh, without_axes(sharding.spec, ("stage",)))


def init_train_state(
    make_model: Callable[[nnx.Rngs], nnx.Module],
    make_tx: Callable[[nnx.Module], optax.GradientTransformation],
    layout: Layout,
    /,
    *,
    seed: int = 0,
    stack: StackSplit | None = None,
) -> TrainState:
    """Model and optimizer state, born sharded on ``layout`` (see ``init_program``; ``stack``: the
    pipeline's split, for a pipelined layout whose executor stores the stack in another order)."""
    program = init_program(make_model, make_tx, layout, seed=seed, stack=stack)
    with layout.activate():
        return TrainState(program.graphdef, program.create(), program.shardings, program.stack)


def batch_sharding(layout: Layout, keys=("inputs", "targets")) -> dict:
    """The sharding of each array of a batch (``keys`` of ``BATCH_KEYS``): [batch, length]."""
    return {k: _rows(layout) for k in keys}


def _rows(layout: Layout):
    """Every array of a batch, [batch, length]: a jit takes it as a prefix of the batch, whatever keys
    the batch holds."""
    return layout.sharding(("batch", "length"))


def _split_slices(batch: Batch, k: int) -> Batch:
    """[B, T] -> [k, B/k, T], slice i = rows i, i+k, i+2k, ... so each one is spread over every
    device that holds a share of the batch (a contiguous split would put slice 0 on the first few)."""
    return jax.tree.map(lambda x: x.reshape(x.shape[0] // k, k, *x.shape[1:]).swapaxes(0, 1), batch)


def _accumulated_grads(model, batch: Batch, loss_fn, grad_accum: int, grad_reduce=GradReduce.SLICE, layout=None):
    """Mean loss parts and mean gradient over ``grad_accum`` equal slices of ``batch``, scanned so
    only one slice's activations are alive at a time. Gradients accumulate in float32. ``grad_reduce``
    step: reduced over the batch axes once, after the last slice (``jaxpar.train.accumulate``)."""
    once = GradReduce.parse(grad_reduce, field="grad_reduce") == GradReduce.STEP
    if grad_accum > 1 and once and batch_axes(layout.mesh, layout.rules):
        check_reduce_once(model.cfg, layout.mesh.shape)
        return reduced_once(model, batch, loss_fn, grad_accum, layout, _split_slices)
    graphdef, params, rest = nnx.split(model, trainable(model), ...)  # rest: the router bias, a LoRA base
    rest, rest_def = jax.tree.flatten(rest)  # plain arrays: the Variables are rebuilt inside the

    # differentiated function, at its trace level
    def loss_of(params, rest, micro):
        return loss_fn(nnx.merge(graphdef, params, jax.tree.unflatten(rest_def, rest)), micro)

    grad_fn = jax.value_and_grad(loss_of, has_aux=True)
    if grad_accum == 1:
        (_, parts), grads = grad_fn(params, rest, batch)
        return parts, grads

    grads, parts = slice_sums(grad_fn, params, rest, _split_slices(batch, grad_accum))
    grads = jax.tree.map(lambda g, p: (g / grad_accum).astype(p.dtype), grads, params)
    return jax.tree.map(lambda x: x / grad_accum, parts), grads


def _pipelined_grads(model, batch: Batch, table, layout: Layout, z_loss: float, fsdp_gather, grad_reduce, split):
    """``_accumulated_grads`` over the table's microbatches, by the pipeline executor (mesh ``stage`` > 1)."""
    if GradReduce.parse(grad_reduce, field="grad_reduce") == GradReduce.STEP:
        check_reduce_once(model.cfg, layout.mesh.shape)
    micro = _split_slices(batch, table.microbatches)
    micro = {k: constrain(v, (None, "batch", "length")) for k, v in micro.items()}
    tokens = {"ids": micro["inputs"]} | {k: micro[k] for k in ("positions", "segments") if k in micro}
    labels = {"targets": micro["targets"]} | ({"weights": micro["weights"]} if "weights" in micro else {})
    out = pipeline_grads(
        model,
        tokens,
        labels,
        table,
        mesh=layout.mesh,
        losses=functools.partial(head_losses, z_loss=z_loss, chunks=model.execution.loss_chunks),
        fsdp_gather=fsdp_gather,
        grad_reduce=grad_reduce,
        split=split,
        trained=trainable(model),
    )
    return LossParts(out.cross_entropy, out.z_loss, out.moe), out.grads


def _check_pipeline_given(ts: TrainState, layout: Layout, pipeline) -> None:
    """A mesh with ``stage`` > 1 trains through a schedule table, never by GSPMD alone (which would gather
    every stage's layers onto every device: correct, but no pipeline); a table whose executor stores the
    stack in another order than the layers' (interleaved, or an uneven split) needs a state made so."""
    stages = layout.mesh.shape["stage"]
    if (pipeline is None) != (stages == 1) or (pipeline is not None and pipeline.stages != stages):
        got = "none" if pipeline is None else f"a table for {pipeline.stages} stages"
        raise ConfigError(
            f"mesh stage={stages} with {got}: give the train step the schedule table for the mesh's "
            "stages (jaxpar.pipeline.build; the train loop builds it from pipeline.*)"
        )
    split = ts.stack
    if pipeline is not None and pipeline.virtual_stages > 1 and split is None:
        raise ConfigError(
            f"pipeline.virtual_stages={pipeline.virtual_stages}: the executor keeps each stage's chunks side "
            "by side; create the state with init_train_state(..., stack=jaxpar.pipeline.stack.StackSplit(...))"
        )
    if split is not None and (pipeline is None or (split.stages, split.virtual) != (stages, pipeline.virtual_stages)):
        want = "no pipeline" if pipeline is None else f"{stages} stages × {pipeline.virtual_stages} chunks"
        raise ConfigError(
            f"the state stores its stack for {split.stages} stages × {split.virtual} chunks, the step runs {want}"
        )


def _layer_order(ts: TrainState, name: str, tree=None, stats=None):
    """``tree`` (a state or gradients) and MoE ``stats`` in the model's layer order, from the storage
    order of ``ts.stack`` (``name``: the model's pipelined stack)."""
    if ts.stack is None or ts.stack.identity:
        return tree, stats
    stats = None if stats is None else jax.tree.map(ts.stack.to_model, stats)
    return (None if tree is None else ts.stack.unstored(tree, name)), stats


def make_train_step(
    ts: TrainState,
    layout: Layout,
    /,
    *,
    loss_fn=next_token_loss,
    grad_accum: int = 1,
    z_loss: float = 0.0,
    skip_nonfinite: bool = False,
    pipeline=None,
    fsdp_gather: str = "section",
    grad_reduce: str = "slice",
):
    """``step(state, batch) -> (state, StepMetrics)``, jitted with explicit shardings, state donated.

    ``grad_accum=k`` accumulates the gradient over k slices of the batch before one optimizer update:
    the same update as the whole batch at once (up to float rounding), with 1/k of the activations.
    ``pipeline``: a schedule table (``jaxpar.pipeline.build``) for a mesh with ``stage`` > 1: the gradient
    is the mean over its microbatches, computed by the pipeline executor (``loss_fn`` is then
    ``next_token_loss``'s objective, and ``grad_accum`` must be 1); ``fsdp_gather``: when it gathers the
    FSDP-sharded weights (``jaxpar.pipeline.FsdpGather``: every section, or once a step). ``grad_reduce``:
    when accumulated gradients are reduced over the batch axes (``jaxpar.train.accumulate.GradReduce``).
    ``skip_nonfinite``: a step whose loss or gradient norm is not finite returns the state unchanged
    (parameters, moments and the optimizer's step count), so the schedule does not advance either.
    """
    graphdef = ts.graphdef
    objective = functools.partial(loss_fn, z_loss=z_loss)
    _check_pipeline_given(ts, layout, pipeline)
    if pipeline is not None and (grad_accum != 1 or loss_fn is not next_token_loss):
        raise ConfigError(
            f"grad_accum={grad_accum} with a pipeline: its microbatches already accumulate the "
            "gradient (pipeline.microbatches), and it computes next_token_loss only"
        )

    def apply(state, grads, parts):
        model, opt = nnx.merge(graphdef, state)
        opt.update(model, grads)
        if parts.moe is not None:  # DeepSeek's auxiliary-loss-free balancing (off at rate 0)
            model.update_router_bias(parts.moe.expert_load)
        return nnx.state((model, opt))

    def step(state, batch):
        batch = token_weights(batch)
        with layout.activate_trace():
            model, _ = nnx.merge(graphdef, state)
            if pipeline is None:
                parts, grads = _accumulated_grads(model, batch, objective, grad_accum, grad_reduce, layout)
            else:
                run = (pipeline, layout, z_loss, fsdp_gather, grad_reduce, ts.stack)
                parts, grads = _pipelined_grads(model, batch, *run)
            # the metrics' statistics in layer order; the state's own order stays for the router bias
            moe = _layer_order(ts, model.pipeline_stack, stats=parts.moe)[1]
            metrics = StepMetrics(
                loss=parts.cross_entropy,
                grad_norm=optax.tree.norm(grads),
                z_loss=parts.z_loss,
                moe=moe,
                extra=parts.extra,
            )
            if not skip_nonfinite:
                return apply(state, grads, parts), metrics
            finite = jnp.isfinite(metrics.loss) & jnp.isfinite(metrics.grad_norm)
            return jax.lax.cond(finite, apply, lambda s, g, p: s, state, grads, parts), metrics

    return jax.jit(
        step,
        in_shardings=(ts.shardings, _rows(layout)),
        out_shardings=(ts.shardings, layout.sharding(())),
        donate_argnums=0,
    )


def make_eval_step(ts: TrainState, layout: Layout, /, *, loss_fn=next_token_loss):
    """``evaluate(state, batch) -> cross-entropy`` (float32 scalar); the state is not donated."""
    return make_model_fn(ts, layout, lambda model, batch: loss_fn(model, batch)[1].cross_entropy, layout.sharding(()))


def make_model_fn(ts: TrainState, layout: Layout, fn, out_shardings):
    """``run(state, batch) -> fn(model, batch)``, jitted on the layout, the model in layer order and the
    batch's masks turned into weights (``token_weights``); the state is not donated."""
    graphdef = ts.graphdef

    def run(state, batch):
        batch = token_weights(batch)
        with layout.activate_trace():
            model, _ = nnx.merge(graphdef, state)
            model, _ = nnx.merge(graphdef, _layer_order(ts, model.pipeline_stack, state)[0])
            return fn(model, batch)

    return jax.jit(run, in_shardings=(ts.shardings, _rows(layout)), out_shardings=out_shardings)


def make_grad_fn(
    ts: TrainState,
    layout: Layout,
    /,
    *,
    loss_fn=next_token_loss,
    grad_accum: int = 1,
    pipeline=None,
    fsdp_gather: str = "section",
    grad_reduce: str = "slice",
):
    """``grads(state, batch) -> (loss, grads)`` with gradients in the model's layer order, computed as
    the train step computes them (``grad_accum``, ``pipeline``: see ``make_train_step``)."""
    graphdef = ts.graphdef
    _check_pipeline_given(ts, layout, pipeline)

    def grads(state, batch):
        batch = token_weights(batch)
        with layout.activate_trace():
            model, _ = nnx.merge(graphdef, state)
            if pipeline is None:
                parts, g = _accumulated_grads(model, batch, loss_fn, grad_accum, grad_reduce, layout)
            else:
                parts, g = _pipelined_grads(model, batch, pipeline, layout, 0.0, fsdp_gather, grad_reduce, ts.stack)
            return parts.cross_entropy, _layer_order(ts, model.pipeline_stack, g)[0]

    return jax.jit(grads, in_shardings=(ts.shardings, _rows(layout)))
