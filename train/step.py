"""Sharded initialisation and the jitted train step.

State is ``nnx.state((model, optimizer))``: parameters plus optimizer moments, each carrying the logical
names of its dimensions. Shardings come from those names through the layout's rules; the state is created
directly in its shards by ``jit(out_shardings=...)`` (never whole on one device) and donated to every step.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from jaxpar.layout import Layout

Batch = dict[str, jax.Array]          # {'inputs': int32 [B, T], 'targets': int32 [B, T]}


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StepMetrics:
    loss: jax.Array
    grad_norm: jax.Array


@dataclasses.dataclass(frozen=True)
class TrainState:
    """What a training run holds: the graph (static), the state arrays and their shardings."""
    graphdef: Any
    state: Any
    shardings: Any


def next_token_loss(model: nnx.Module, batch: Batch) -> jax.Array:
    """Mean cross-entropy in float32 of ``model(inputs)`` against ``targets``."""
    logits = model(batch["inputs"]).astype(jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]).mean()


@dataclasses.dataclass(frozen=True)
class InitProgram:
    """The sharded initialisation, not yet run: ``create()`` returns the state arrays."""
    graphdef: Any
    shardings: Any
    create: Callable[[], Any]


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
    return InitProgram(graphdef, shardings, jax.jit(lambda: nnx.state(create()), out_shardings=shardings))


def init_train_state(make_model: Callable[[nnx.Rngs], nnx.Module],
                     make_tx: Callable[[nnx.Module], optax.GradientTransformation],
                     layout: Layout, /, *, seed: int = 0) -> TrainState:
    """Model and optimizer state, born sharded on ``layout`` (see ``init_program``)."""
    program = init_program(make_model, make_tx, layout, seed=seed)
    with layout.activate():
        return TrainState(program.graphdef, program.create(), program.shardings)


def batch_sharding(layout: Layout):
    return {k: layout.sharding(("batch", "length")) for k in ("inputs", "targets")}


def make_train_step(ts: TrainState, layout: Layout, /, *, loss_fn=next_token_loss):
    """``step(state, batch) -> (state, StepMetrics)``, jitted with explicit shardings, state donated."""
    graphdef = ts.graphdef

    def step(state, batch):
        with layout.activate_trace():
            model, opt = nnx.merge(graphdef, state)
            loss, grads = nnx.value_and_grad(loss_fn)(model, batch)
            opt.update(model, grads)
            return nnx.state((model, opt)), StepMetrics(loss=loss, grad_norm=optax.tree.norm(grads))

    replicated = layout.sharding(())
    return jax.jit(step, in_shardings=(ts.shardings, batch_sharding(layout)),
                   out_shardings=(ts.shardings, StepMetrics(replicated, replicated)), donate_argnums=0)


def make_grad_fn(ts: TrainState, layout: Layout, /, *, loss_fn=next_token_loss):
    """``grads(state, batch) -> (loss, grads)`` with gradients in their parameters' shardings."""
    graphdef = ts.graphdef

    def grads(state, batch):
        with layout.activate_trace():
            model, _ = nnx.merge(graphdef, state)
            return nnx.value_and_grad(loss_fn)(model, batch)

    return jax.jit(grads, in_shardings=(ts.shardings, batch_sharding(layout)))
