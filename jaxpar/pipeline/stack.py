"""How the pipelined stack's layers are split over the stages and stored for the executor.

The model keeps its stack as [L, ...] in layer order (checkpoints, conversion, generation). The executor
wants stage s's chunks side by side on stage s: model chunks s, s + p, ... (interleaved) in its rows,
and, when the layers do not split evenly (``pipeline.first_stage_layers`` / ``last_stage_layers``, as
Megatron splits them: the first and last stage hold fewer layers, to make room for the embedding and the
LM head), every chunk padded to the same ``rows``. A training state under such a pipeline holds the stack
in **storage order**: [p · v · rows, ...], stage-major, padding rows zero. It is converted once, when
the state is created or restored, and back when it is saved or evaluated; no step moves a weight
between stages. Padding rows are skipped by the chunk's layer loop (``active``) and get zero gradients,
so the optimizer never moves them.

Row ``r`` of the storage = stage ``r // (v · rows)``, its local chunk ``(r // rows) % v``, layer ``r %
rows`` of that chunk (model chunk ``local · p + stage``).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxpar.errors import ConfigError
from jaxpar.rules import Dim


@dataclasses.dataclass(frozen=True)
class StackSplit:
    """``layers`` stack layers over ``stages`` × ``virtual`` chunks; ``first``/``last``: the layers of the
    first and last stage (None: an even share). The rest split evenly over the stages between them, and
    every stage's layers evenly over its v chunks."""

    layers: int
    stages: int
    virtual: int = 1
    first: int | None = None
    last: int | None = None

    def __post_init__(self):
        self.stage_layers  # noqa: B018  (refuses a split that does not exist, naming the field)

    @functools.cached_property
    def stage_layers(self) -> tuple[int, ...]:
        """Layers on each stage."""
        p, ends = self.stages, [n for n in (self.first, self.last) if n is not None]
        for field, n in (("first_stage_layers", self.first), ("last_stage_layers", self.last)):
            if n is not None and n < 1:
                raise ConfigError(f"pipeline.{field}={n}: a stage holds at least one layer")
        if ends and p < len(ends) + 1:
            raise ConfigError(f"pipeline.first_stage_layers / last_stage_layers need mesh stage ≥ {len(ends) + 1}")
        rest, middle = self.layers - sum(ends), p - len(ends)
        if rest < middle or rest % middle:
            given = " - ".join(f"{n}" for n in ends)
            raise ConfigError(
                f"model.num_layers={self.layers} (the pipelined stack) - {given} = {rest} layers do not split "
                f"evenly over the other {middle} stages: set pipeline.first_stage_layers / last_stage_layers "
                "so that they do"
            )
        share = rest // middle
        counts = [share] * p
        counts[0] = share if self.first is None else self.first
        counts[-1] = share if self.last is None else self.last
        for s, n in enumerate(counts):
            if n % self.virtual:
                field = {0: "first_stage_layers", p - 1: "last_stage_layers"}.get(s, "num_layers")
                raise ConfigError(
                    f"stage {s} holds {n} layers, not divisible by pipeline.virtual_stages={self.virtual} "
                    f"(each of its chunks holds the same number; see pipeline.{field})"
                )
        return tuple(counts)

    @property
    def even(self) -> bool:
        return len(set(self.stage_layers)) == 1

    @property
    def rows(self) -> int:
        """Storage rows per chunk: the largest chunk's layers."""
        return max(self.stage_layers) // self.virtual

    @property
    def chunk_layers(self) -> tuple[int, ...]:
        """Layers of each model chunk c (on stage c mod p)."""
        return tuple(self.stage_layers[c % self.stages] // self.virtual for c in range(self.stages * self.virtual))

    @functools.cached_property
    def order(self) -> np.ndarray:
        """[p · v · rows]: the model layer at each storage row, -1 for padding."""
        p, v, k = self.stages, self.virtual, self.rows
        starts = np.cumsum((0,) + self.chunk_layers)
        order = np.full(p * v * k, -1)
        for s in range(p):
            for j in range(v):
                c = j * p + s
                n = self.chunk_layers[c]
                base = (s * v + j) * k
                order[base : base + n] = np.arange(starts[c], starts[c] + n)
        return order

    @property
    def active(self) -> np.ndarray:
        """[p · v · rows] bool: the storage rows that hold a layer."""
        return self.order >= 0

    def layout_dims(self) -> dict:
        """What the layout check measures of the stack under this split: its storage rows, which must
        divide ``stage`` (the model's own layer count need not)."""
        return {"layers": Dim(self.order.size, "the pipeline's storage rows of the stack")}

    @property
    def identity(self) -> bool:
        """Storage order is the model's order (v = 1, an even split): nothing to convert."""
        return len(self.order) == self.layers and bool(np.all(self.order == np.arange(self.layers)))

    # -------------------------------------------------------------------------------- conversions
    def to_storage(self, a: jax.Array) -> jax.Array:
        """[L, ...] in layer order -> [p · v · rows, ...] in storage order (padding zero)."""
        taken = jnp.take(a, np.maximum(self.order, 0), axis=0)
        mask = self.active.reshape((-1,) + (1,) * (a.ndim - 1))
        return jnp.where(mask, taken, jnp.zeros((), a.dtype))

    def to_model(self, a: jax.Array) -> jax.Array:
        """[p · v · rows, ...] in storage order -> [L, ...] in layer order."""
        rows = np.argsort(np.where(self.active, self.order, self.layers + np.arange(len(self.order))))
        return jnp.take(a, rows[: self.layers], axis=0)

    def stack_leaves(self, tree, stack: str, convert):
        """``tree`` (a state, its shapes or its shardings, or a part of one) with ``convert`` applied to
        every leaf under attribute ``stack`` (the parameters, the optimizer's moments of them and the
        stack's non-trained state) that has a layer axis."""

        def one(path, x):
            names = [getattr(k, "key", getattr(k, "name", None)) for k in path]
            return convert(x) if stack in names and getattr(x, "ndim", 1) >= 1 else x

        return jax.tree_util.tree_map_with_path(one, tree)

    def stored(self, tree, stack: str):
        return tree if self.identity else self.stack_leaves(tree, stack, self.to_storage)

    def unstored(self, tree, stack: str):
        return tree if self.identity else self.stack_leaves(tree, stack, self.to_model)


def balanced_ends(layers: int, stages: int, virtual: int = 1) -> tuple[int, int | None] | None:
    """Megatron's uneven split of ``layers`` that do not divide into ``stages`` × ``virtual`` chunks: the
    (first, last) stage's layers (``StackSplit``'s; over two stages the last is None, the rest), every
    stage between them holding the same whole chunks. Of the splits that exist, the one whose largest
    stage holds the fewest layers; then the one with the lighter ends (they also run the embedding, and
    the head and the loss); then the ends as equal as chunks allow, the first the larger. None where no
    split gives every stage a chunk."""
    best = None
    for middle in range(virtual, layers + 1, virtual):
        rest = layers - (stages - 2) * middle if stages > 2 else layers
        for last in range(virtual, rest // 2 + 1, virtual):
            first = rest - last
            if first % virtual or (stages > 2 and first == last == middle):
                continue
            key = (max(first, middle if stages > 2 else 0), -middle, first - last)
            if best is None or key < best[0]:
                best = key, (first, last if stages > 2 else None)
        if stages == 2:
            break
    return None if best is None else best[1]


def stack_name_and_layers(model) -> tuple[str, int]:
    """The pipelined stack's attribute name and its layer count, read from ``model``'s parameters."""
    stack = getattr(model, model.pipeline_stack)
    return model.pipeline_stack, jax.tree.leaves(nnx.state(stack, nnx.Param))[0].shape[0]
