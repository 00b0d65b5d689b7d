"""Stacks of identical layers: made once with ``nnx.vmap`` (every parameter gains a leading layer axis),
run with ``nnx.scan`` (``scan_blocks``, which also skips a pipeline's padding rows), and split into one
module per layer for inference (``split_stack``)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx
from flax.nnx import spmd

from jaxpar.execution import Remat


def stacked(n: int, make, rngs: nnx.Rngs, axis: str = "layers"):
    """``n`` blocks made by ``make(rngs)``, created once with ``nnx.vmap``: every parameter gains a
    leading stacked axis (logical name ``axis``), and ``nnx.scan`` runs them."""

    @nnx.split_rngs(splits=n)
    @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: axis})
    def make_blocks(rngs):
        return make(rngs)

    return make_blocks(rngs)


def scan_blocks(
    blocks, x, positions, index, remat: Remat, *, per_layer_outputs: bool = False, active=None, segments=None
):
    """Runs stacked ``blocks`` over x (``segments``: packed documents, see ``DenseLM.forward``). A block
    returns x, or with ``per_layer_outputs`` (x, outputs),
    and the outputs come back stacked over the layers. ``active`` (a pipeline's padded chunk: ``(rows
    [n] bool, skip)``): a row that is off passes x through with zero outputs, and zero gradients for its
    weights; ``skip`` runs it as a branch (no work), otherwise it is computed and dropped (for programs
    where a branch that differs between devices must not hold a collective)."""

    def body(x, block, positions, index, segments):
        return block(x, positions, index, segments=segments)

    if remat != Remat.NONE:
        body = nnx.remat(body, policy=remat.policy(), prevent_cse=False)
    out_axes = (nnx.Carry, 0) if per_layer_outputs else nnx.Carry
    if active is None:
        scan = nnx.scan(body, in_axes=(nnx.Carry, 0, None, None, None), out_axes=out_axes)
        return scan(x, blocks, positions, index, segments)
    rows, skip = active

    def masked(x, block, on, positions, index, segments):
        off = lambda block, x: _passed_through(nnx.eval_shape(body, x, block, positions, index, segments), x)
        if skip:
            return nnx.cond(on, lambda block, x: body(x, block, positions, index, segments), off, block, x)
        out = body(x, block, positions, index, segments)
        return jax.tree.map(lambda a, b: jnp.where(on, a, b), out, off(block, x))

    scan = nnx.scan(masked, in_axes=(nnx.Carry, 0, 0, None, None, None), out_axes=out_axes)
    return scan(x, blocks, rows, positions, index, segments)


def _passed_through(shapes, x):
    """What an inactive layer returns, shaped as ``shapes`` (x, or (x, outputs)): x and zero outputs."""
    if isinstance(shapes, tuple):
        return x, jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes[1])
    return x


def stack_axis(blocks) -> str:
    """The logical name of a stack's leading axis (``layers``, ``prefix_layers``), read from its parameters."""
    first = jax.tree.leaves(nnx.state(blocks), is_leaf=lambda x: isinstance(x, nnx.Variable))[0]
    return first.get_metadata()["out_sharding"][0]


def _row(x, i: int):
    """Row i of a stacked array (an abstract one: its shape without the leading axis)."""
    return jax.ShapeDtypeStruct(x.shape[1:], x.dtype) if isinstance(x, jax.ShapeDtypeStruct) else x[i]


def split_stack(blocks) -> list[nnx.Module]:
    """A stack made by ``stacked`` as one module per layer: layer i holds row i of every variable, whose
    logical names lose the stack's leading axis name. Eager, each row is an array of its own (a copy);
    traced, a slice of the stacked array (``jaxpar.inference.unstack`` splits a model once, eagerly)."""
    graphdef, state = nnx.split(blocks)
    axis, layers = stack_axis(blocks), []
    for i in range(jax.tree.leaves(state)[0].shape[0]):
        layer = nnx.merge(graphdef, jax.tree.map(functools.partial(_row, i=i), state))
        spmd.remove_axis(nnx.state(layer), 0, {nnx.PARTITION_NAME: axis})
        layers.append(layer)
    return layers
