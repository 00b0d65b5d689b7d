"""Batch axes made manual for a step: parameters gathered over them once, gradients reduced once.

Under XLA's automatic partitioning a gradient comes out of each backward already reduced over the axes
the batch is split on. With those axes manual (``shard_map``; the others stay automatic) each device
gathers its parameters over them (``gathered``), runs its own rows as many times as the step needs, adds
the gradients unreduced, and reduces each once (``reduced``): a reduce-scatter over the axes that split
it, then a sum over the others on the scattered part. ``GradReduce`` names the choice
(``jaxpar.train.accumulate``, ``jaxpar.pipeline.executor``).
"""

from __future__ import annotations

from collections.abc import Iterable

import jax
from jax.sharding import PartitionSpec as P

from jaxpar.config import Choice
from jaxpar.rules import axes_of


class GradReduce(Choice):
    """When accumulated gradients are reduced over the batch axes: after every slice, or once a step."""

    SLICE = "slice"
    STEP = "step"


def batch_axes(mesh, rules) -> tuple[str, ...]:
    """The mesh axes (of size > 1) the ``batch`` rule splits the batch over."""
    return tuple(a for a in rules["batch"] if mesh.shape[a] > 1)


def manual_spec(names, rules, manual: Iterable[str]) -> P:
    """A parameter's spec (logical ``names`` through ``rules``) over the ``manual`` axes alone."""
    manual = set(manual)
    return P(*[tuple(a for a in (rules[n] if n else ()) if a in manual) or None for n in names])


def gathered(x: jax.Array, spec: P, over: Iterable[str]) -> jax.Array:
    """``x`` (this device's part under ``spec``) whole over the axes ``over``."""
    over = set(over)
    for dim, entry in enumerate(spec):
        for axis in axes_of(entry):
            if axis in over:
                x = jax.lax.all_gather(x, axis, axis=dim, tiled=True)
    return x


def reduced(g: jax.Array, spec: P, axes: tuple[str, ...]) -> jax.Array:
    """A gradient summed over the batch ``axes``: scattered over those that split its parameter (``spec``),
    then summed over the others on the scattered part (1/n of the bytes)."""
    split = [a for entry in spec for a in axes_of(entry) if a in axes]
    for dim, entry in enumerate(spec):
        for axis in axes_of(entry):
            if axis in axes:
                g = jax.lax.psum_scatter(g, axis, scatter_dimension=dim, tiled=True)
    rest = tuple(a for a in axes if a not in split)
    return jax.lax.psum(g, rest) if rest else g
