"""Gradient accumulation with the gradients reduced once per step (``grad_reduce=step``).

Accumulating under XLA's automatic partitioning, every slice's gradient comes out of its backward already
reduced over the batch axes: a reduce-scatter over ``fsdp`` and an all-reduce over ``data`` per parameter
per slice, k times a step. Here the batch axes (the mesh axes the ``batch`` rule splits over) are manual
(``shard_map``; the model's other axes stay automatic): each device gathers its parameters over ``fsdp``
once, runs every slice of its own rows, and adds the slices' gradients as they come, a partial sum over
its rows, never reduced. After the last slice each gradient is reduced once: a reduce-scatter over the
``fsdp`` dims it is split on, an all-reduce over the batch axes it is not. The loss is each device's mean
over its rows, so the step's objective is the mean of the devices' (the same rows in every one), and its
gradient their sum over the devices and slices, divided by both counts.

The price: each device holds its parameters whole over ``fsdp`` and a float32 gradient sum of that size
for the step (Megatron's data-parallel gradient buffer). What it runs on: dense models, on layouts whose
batch axes split nothing but the batch inside the model (``sequence`` and ``tensor`` stay automatic;
context attention's kernel leaves the manual batch axes out of its own ``shard_map``). A mixture of
experts balances its load, and drops tokens, over the whole batch, so it is refused, as is ``expert``,
naming the setting.
"""

from __future__ import annotations

from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec as P

from jaxpar.errors import ConfigError
from jaxpar.layers.lora import trainable
from jaxpar.layout import Layout
from jaxpar.parallel.manual import GradReduce, batch_axes, gathered, manual_spec, reduced  # noqa: F401  (re-exported)
from jaxpar.rules import constrain


def slice_sums(grad_fn, params, rest, micro):
    """(Σ gradients, Σ loss parts) over the slices of ``micro`` (its leading axis), float32, scanned so
    only one slice's activations are alive at a time; ``grad_fn(params, rest, slice)`` is
    ``value_and_grad`` of the loss with its parts."""

    def body(acc, m):
        m = {k: constrain(v, ("batch", "length")) for k, v in m.items()}
        (_, parts), grads = grad_fn(params, rest, m)
        return jax.tree.map(lambda a, x: a + x.astype(jnp.float32), acc, (grads, parts)), None

    (_, parts_shape), grads_shape = jax.eval_shape(grad_fn, params, rest, jax.tree.map(lambda x: x[0], micro))
    zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), (grads_shape, parts_shape))
    return jax.lax.scan(body, zeros, micro)[0]


def check_reduce_once(cfg, shape: Mapping[str, int]) -> None:
    """Refuses, naming ``grad_reduce``, a model or a mesh (``shape``: its axis sizes) the once-a-step
    reduction does not run (module docstring)."""
    if cfg.moe is not None or shape.get("expert", 1) > 1:
        why = "a mixture of experts" if cfg.moe is not None else f"expert={shape['expert']}"
        raise ConfigError(
            f"grad_reduce=step with {why}: the once-a-step reduction runs dense models whose layout splits "
            "only stage, data, fsdp, sequence and tensor; use grad_reduce=slice"
        )


def reduced_once(model, batch, loss_fn, grad_accum: int, layout: Layout, slices):
    """(mean loss parts, mean gradient) of ``model`` over ``batch`` in ``grad_accum`` slices per device
    (``slices(batch, k)``: [k, rows/k, ...]), the gradients reduced once (module docstring)."""
    axes = batch_axes(layout.mesh, layout.rules)
    graphdef, params, rest = nnx.split(model, trainable(model), ...)
    variables = jax.tree.leaves(params, is_leaf=lambda x: isinstance(x, nnx.Variable))
    specs = [manual_spec(v.out_sharding, layout.rules, axes) for v in variables]
    leaves, treedef = jax.tree.flatten(params)
    rest_leaves, rest_def = jax.tree.flatten(rest)
    devices = int(np.prod([layout.mesh.shape[a] for a in axes]))

    def loss_of(leaves, rest_leaves, micro):
        state = jax.tree.unflatten(treedef, leaves), jax.tree.unflatten(rest_def, rest_leaves)
        return loss_fn(nnx.merge(graphdef, *state), micro)

    grad_fn = jax.value_and_grad(loss_of, has_aux=True)

    def local(leaves, rest_leaves, batch):
        whole = [gathered(x, s, axes) for x, s in zip(leaves, specs)]  # once a step
        grads, parts = slice_sums(grad_fn, whole, rest_leaves, slices(batch, grad_accum))
        count = grad_accum * devices
        grads = [reduced(g, s, axes) / count for g, s in zip(grads, specs)]
        return grads, jax.tree.map(lambda x: jax.lax.psum(x, axes) / count, parts)

    run = jax.shard_map(
        local,
        mesh=layout.mesh,
        axis_names=set(axes),
        in_specs=(specs, P(), P(axes)),
        out_specs=(specs, P()),
        # Unchecked: the weights are gathered (varying over the batch axes) inside, and each device's loss
        # varies with its rows; the reductions at the end are written out by hand, not left to the checker.
        check_vma=False,
    )
    grads, parts = run(leaves, rest_leaves, batch)
    grads = [g.astype(x.dtype) for g, x in zip(grads, leaves)]
    return parts, jax.tree.unflatten(treedef, grads)
