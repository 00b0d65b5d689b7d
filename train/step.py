"""Sharded initialisation and the jitted train step.

State is ``nnx.state((model, optimizer))``: parameters plus optimizer moments, each carrying the logical
names of its dimensions. Shardings come from those names through the layout's rules; the state is created
directly in its shards by ``jit(out_shardings=...)`` (never whole on one device) and donated to every step.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from jaxpar.layout import Layout
from jaxpar.rules import constrain

Batch = dict[str, jax.Array]          # {'inputs': int32 [B, T], 'targets': int32 [B, T]}


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StepMetrics:
    loss: jax.Array          # mean next-token cross-entropy (float32), without the z-loss term
    grad_norm: jax.Array     # global norm of the gradient of the whole objective, before clipping
    z_loss: jax.Array        # the z-loss term that was added to the objective (0 when off)
    moe: Any = None          # MoE models: jaxpar.layers.MoEStats stacked over the MoE layers [L, ...]


@dataclasses.dataclass(frozen=True)
class TrainState:
    """What a training run holds: the graph (static), the state arrays and their shardings."""
    graphdef: Any
    state: Any
    shardings: Any


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LossParts:
    cross_entropy: jax.Array
    z_loss: jax.Array
    moe: Any = None          # MoE statistics of the forward pass (None for dense models)


def next_token_loss(model: nnx.Module, batch: Batch, /, *, z_loss: float = 0.0) -> tuple[jax.Array, LossParts]:
    """Objective = mean float32 cross-entropy of the model's logits against ``targets`` plus
    ``z_loss · mean(log Z²)`` (PaLM's z-loss: keeps the softmax normaliser near 1, so logits don't drift
    in low precision) plus the model's own weighted auxiliary losses (MoE balancing and router z-loss).
    Returns ``(objective, LossParts)``."""
    out = model.forward(batch["inputs"])                  # logits in the layout's storage order
    targets = batch["targets"] if out.order is None else batch["targets"][:, out.order]
    log_z = jax.nn.logsumexp(out.logits, axis=-1)
    target_logit = jnp.take_along_axis(out.logits, targets[..., None], axis=-1)[..., 0]
    ce = jnp.mean(log_z - target_logit)
    z = z_loss * jnp.mean(jnp.square(log_z)) if z_loss else jnp.zeros((), jnp.float32)
    return ce + z + out.aux_loss, LossParts(ce, z, out.moe)


@dataclasses.dataclass(frozen=True)
class InitProgram:
    """The sharded initialisation, not yet run: ``create()`` returns the state arrays; ``abstract`` is
    that state's shapes and dtypes (``nnx.eval_shape``), e.g. to check a checkpoint against."""
    graphdef: Any
    shardings: Any
    create: Callable[[], Any]
    abstract: Any


def init_program(make_model: Callable[[nnx.Rngs], nnx.Module],
                 make_tx: Callable[[nnx.Module], optax.GradientTransformation],
                 layout: Layout, /, *, seed: int = 0) -> InitProgram:
    """``InitProgram``: ``create()`` is jitted with ``out_shardings`` from the
    parameters' logical names, so XLA computes each shard on its own device (partitionable RNG) and no
    device ever holds the whole model. Nothing is allocated until ``create()`` is called.

    ``make_tx(model)`` builds the optimizer (it may read parameter metadata, e.g. for a decay mask).
    """
    def create():
        model = make_model(nnx.Rngs(params=seed))
        return model, nnx.Optimizer(model, make_tx(model), wrt=nnx.Param)

    with layout.activate():
        graphdef, abstract = nnx.split(nnx.eval_shape(create))
        shardings = nnx.get_named_sharding(abstract, layout.mesh)
    return InitProgram(graphdef, shardings, jax.jit(lambda: nnx.state(create()), out_shardings=shardings), abstract)


def init_train_state(make_model: Callable[[nnx.Rngs], nnx.Module],
                     make_tx: Callable[[nnx.Module], optax.GradientTransformation],
                     layout: Layout, /, *, seed: int = 0) -> TrainState:
    """Model and optimizer state, born sharded on ``layout`` (see ``init_program``)."""
    program = init_program(make_model, make_tx, layout, seed=seed)
    with layout.activate():
        return TrainState(program.graphdef, program.create(), program.shardings)


def batch_sharding(layout: Layout):
    return {k: layout.sharding(("batch", "length")) for k in ("inputs", "targets")}


def _split_microbatches(batch: Batch, k: int) -> Batch:
    """[B, T] -> [k, B/k, T], microbatch i = rows i, i+k, i+2k, ... so each one is spread over every
    device that holds a share of the batch (a contiguous split would put microbatch 0 on the first few)."""
    return jax.tree.map(lambda x: x.reshape(x.shape[0] // k, k, *x.shape[1:]).swapaxes(0, 1), batch)


def _accumulated_grads(model, batch: Batch, loss_fn, microbatches: int):
    """Mean loss parts and mean gradient over ``microbatches`` equal slices of ``batch``, scanned so
    only one microbatch's activations are alive at a time. Gradients accumulate in float32."""
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)     # rest: non-trained state (router bias)
    rest, rest_def = jax.tree.flatten(rest)     # plain arrays: the Variables are rebuilt inside the
                                                # differentiated function, at its trace level
    def loss_of(params, rest, micro):
        return loss_fn(nnx.merge(graphdef, params, jax.tree.unflatten(rest_def, rest)), micro)

    grad_fn = jax.value_and_grad(loss_of, has_aux=True)
    if microbatches == 1:
        (_, parts), grads = grad_fn(params, rest, batch)
        return parts, grads

    def body(acc, micro):
        micro = {k: constrain(v, ("batch", "length")) for k, v in micro.items()}
        (_, parts), grads = grad_fn(params, rest, micro)
        return jax.tree.map(lambda a, x: a + x.astype(jnp.float32), acc, (grads, parts)), None

    micro = _split_microbatches(batch, microbatches)
    (_, parts_shape), grads_shape = jax.eval_shape(grad_fn, params, rest, jax.tree.map(lambda x: x[0], micro))
    zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), (grads_shape, parts_shape))
    (grads, parts), _ = jax.lax.scan(body, zeros, micro)
    grads = jax.tree.map(lambda g, p: (g / microbatches).astype(p.dtype), grads, params)
    return jax.tree.map(lambda x: x / microbatches, parts), grads


def make_train_step(ts: TrainState, layout: Layout, /, *, loss_fn=next_token_loss, microbatches: int = 1,
                    z_loss: float = 0.0, skip_nonfinite: bool = False):
    """``step(state, batch) -> (state, StepMetrics)``, jitted with explicit shardings, state donated.

    ``microbatches=k`` accumulates the gradient over k slices of the batch before one optimizer update:
    the same update as the whole batch at once (up to float rounding), with 1/k of the activations.
    ``skip_nonfinite``: a step whose loss or gradient norm is not finite returns the state unchanged
    (parameters, moments and the optimizer's step count), so the schedule does not advance either.
    """
    graphdef = ts.graphdef
    objective = functools.partial(loss_fn, z_loss=z_loss)

    def apply(state, grads, parts):
        model, opt = nnx.merge(graphdef, state)
        opt.update(model, grads)
        if parts.moe is not None:                     # DeepSeek's auxiliary-loss-free balancing (off at rate 0)
            model.update_router_bias(parts.moe.expert_load)
        return nnx.state((model, opt))

    def step(state, batch):
        with layout.activate_trace():
            model, _ = nnx.merge(graphdef, state)
            parts, grads = _accumulated_grads(model, batch, objective, microbatches)
            metrics = StepMetrics(loss=parts.cross_entropy, grad_norm=optax.tree.norm(grads), z_loss=parts.z_loss,
                                  moe=parts.moe)
            if not skip_nonfinite:
                return apply(state, grads, parts), metrics
            finite = jnp.isfinite(metrics.loss) & jnp.isfinite(metrics.grad_norm)
            return jax.lax.cond(finite, apply, lambda s, g, p: s, state, grads, parts), metrics

    return jax.jit(step, in_shardings=(ts.shardings, batch_sharding(layout)),
                   out_shardings=(ts.shardings, layout.sharding(())), donate_argnums=0)


def make_eval_step(ts: TrainState, layout: Layout, /, *, loss_fn=next_token_loss):
    """``evaluate(state, batch) -> cross-entropy`` (float32 scalar); the state is not donated."""
    graphdef = ts.graphdef

    def evaluate(state, batch):
        with layout.activate_trace():
            model, _ = nnx.merge(graphdef, state)
            return loss_fn(model, batch)[1].cross_entropy

    return jax.jit(evaluate, in_shardings=(ts.shardings, batch_sharding(layout)), out_shardings=layout.sharding(()))


def make_grad_fn(ts: TrainState, layout: Layout, /, *, loss_fn=next_token_loss):
    """``grads(state, batch) -> (loss, grads)`` with gradients in their parameters' shardings."""
    graphdef = ts.graphdef

    def grads(state, batch):
        with layout.activate_trace():
            model, _ = nnx.merge(graphdef, state)
            parts, g = _accumulated_grads(model, batch, loss_fn, 1)
            return parts.cross_entropy, g

    return jax.jit(grads, in_shardings=(ts.shardings, batch_sharding(layout)))
