"""``LanguageModel``: the one contract between a model family and everything that runs it.

The train step (``jaxpar.train.step``), the pipeline executor (``jaxpar.pipeline.executor``), generation
and serving (``jaxpar.inference``) and the layout lab (``jaxpar.analysis``) call a model through these
hooks and nothing else; every family of the zoo (``models/dense.py``, ``models/moe.py``) provides them,
and ``tests/test_model_api.py`` checks each family against this Protocol, signatures included.

Legend: B batch, T positions, D embed_dim, V vocabulary (padded, ``cfg.padded_vocab``; ``__call__``,
``prefill`` and ``decode`` cut it to ``cfg.vocab_size``). A *stack* is a group of layers created once
with a leading ``layers`` axis and run with a scan; a model names its stacks by attribute:
``pipeline_stack`` is the one a pipeline splits over ``stage``, ``prefix_stack`` (or None) the one that
runs before it (DeepSeek's first dense layers). Storage order: under a zig-zag ring the layout stores a
sequence permuted (position p holds token ``order[p]``); ``forward`` returns logits in that order, so a
loss permutes its targets once instead of the logits.

Generation runs a model whose stacks are unstacked (``jaxpar.inference.unstack``: each stack an
``nnx.List`` of per-layer blocks with arrays of their own). The generation hooks run the layers unrolled,
each with its own cache; on a stacked model they slice each layer out of the stack in every call.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol, runtime_checkable

import jax
import numpy as np

from jaxpar.execution import ExecutionConfig


@dataclasses.dataclass(frozen=True)
class ForwardOutput:
    """What ``forward`` returns (inside a traced function): logits in the layout's storage order,
    that order (position p holds token ``order[p]``; None = natural), the weighted auxiliary losses
    the objective adds (MoE balancing and router z-loss; 0 for dense models), and MoE statistics
    stacked over the MoE layers (None for dense models). From ``forward(..., head=False)``, ``logits``
    holds the last block's output instead."""

    logits: jax.Array
    order: np.ndarray | None
    aux_loss: jax.Array
    moe: object = None


@runtime_checkable
class LanguageModel(Protocol):
    """A decoder-only language model as train, the pipeline, inference and the layout lab call it."""

    cfg: Any  # the model config (``jaxpar.models``): what the model is, its run identity
    execution: ExecutionConfig  # how it runs: remat, compute dtype, attention kernel, MoE capacity, ...
    pipeline_stack: str  # the stack a pipeline splits over ``stage``, by attribute name
    prefix_stack: str | None  # the stack that runs before it (None: none), by attribute name

    # ------------------------------------------------------------------------------- training
    def __call__(self, ids: jax.Array, positions: jax.Array | None = None, segments: jax.Array | None = None):
        """ids [B, T] int32 -> float32 logits [B, T, vocab_size], in natural order."""
        ...

    def forward(
        self, ids: jax.Array, positions: jax.Array | None = None, segments: jax.Array | None = None, *, head=True
    ) -> ForwardOutput:
        """ids [B, T] -> logits over the padded vocabulary in storage order, with the auxiliary losses
        (``head=False``: the last block's output [B, T, D] in their place, for ``head`` applied later).
        Packed rows: ``segments`` [B, T] each token's document, ``positions`` restarting in each one."""
        ...

    def update_router_bias(self, expert_load: jax.Array) -> None:
        """After an optimizer step: balance the routers from their load [L, E] (a no-op without routers)."""
        ...

    # ---------------------------------------------------------- the parts a pipeline runs apart
    def storage_order(self, length: int) -> np.ndarray | None:
        """How the current layout stores a sequence of ``length`` tokens (None: the natural order)."""
        ...

    def inputs(self, ids: jax.Array, positions: jax.Array | None = None, *, stored: bool = False) -> tuple:
        """(ids, positions, index, order) of ids [B, T] in storage order (``stored``: they already are)."""
        ...

    def embed(self, ids: jax.Array) -> jax.Array:
        """The token embedding: ids [B, T] -> x [B, T, D] (an attribute of the model, a module)."""
        ...

    def prefix(self, x: jax.Array, positions: jax.Array, index: jax.Array, segments=None) -> jax.Array:
        """The layers before the pipelined stack over x [B, T, D] (the identity when there are none)."""
        ...

    def run_stack(
        self, blocks, x: jax.Array, positions: jax.Array, index: jax.Array, active=None, segments=None
    ) -> tuple:
        """``blocks`` (the pipelined stack or a chunk of its layers) over x: (x, aux loss, statistics).
        ``active``: None, or ``(rows, skip)`` for a chunk with padding rows: ``rows`` [n] bool says which
        rows hold a layer, the others pass x through (``skip``: as a branch that does no work)."""
        ...

    def head(self, x: jax.Array) -> jax.Array:
        """Final norm and LM head: x [B, T, D] -> float32 logits [B, T, V], padded entries masked."""
        ...

    # ----------------------------------------------------------------------------- generation
    def cache_stacks(self) -> tuple[str, ...]:
        """The stacks that keep a KV cache, by attribute name, in the order they run."""
        ...

    def empty_cache(self, batch: int, slots: int) -> dict:
        """A zero KV cache {stack: [each layer's cache]} for ``batch`` rows of ``slots``."""
        ...

    def empty_pages(self, num_pages: int, page_size: int) -> dict:
        """Zero page pools {stack: [each layer's paged cache]}; page 0 is the null page."""
        ...

    def prefill(self, ids: jax.Array, lengths: jax.Array, cache: dict) -> tuple[jax.Array, dict]:
        """Right-padded prompts [B, T] of ``lengths`` -> (logits [B, V] of each last token, cache)."""
        ...

    def decode(self, ids: jax.Array, positions: jax.Array, cache: dict) -> tuple[jax.Array, dict]:
        """New tokens [B, T] at ``positions`` -> (logits [B, T, V], the cache with them appended)."""
        ...
