"""The attention core under context parallelism: where a model's attention meets the ``sequence`` axis.

Models call ``context_attention`` with logical intent only (a strategy name); this module reads the
current layout (``jaxpar.rules.active_layout``) to find which mesh axis the positions inside attention
(``inner_length``) are split over, and runs the matching kernel under ``jax.shard_map``:

    none      ``jax.nn.dot_product_attention`` on whatever GSPMD gives it (with a split sequence, XLA
              gathers the full K/V on every device: simple, O(L) memory), or with
              ``attention_impl=splash`` the Pallas kernel of ``jaxpar.parallel.flash``
    ring      ``jaxpar.parallel.ring``: K/V blocks travel the ring, O(L/n) memory, zig-zag balanced
    ulysses   ``jaxpar.parallel.ulysses``: all-to-all from sequence-split to head-split and back

Token order: with a ring under the zig-zag order the model stores the sequence so that the contiguous
split over n devices gives device i the chunks i and 2n−1−i (``storage_order``). The model permutes
ids and positions once on entry and undoes it on the logits; masks inside the kernels use each token's
original index, so every strategy computes exactly plain causal attention.
"""

from __future__ import annotations

import math

import jax
import numpy as np
from jax.sharding import PartitionSpec

from jaxpar.execution import AttentionImpl, ContextParallel, TokenOrder  # noqa: F401  (TokenOrder: re-exported)
from jaxpar.parallel.common import zigzag_order
from jaxpar.parallel.flash import splash_attention
from jaxpar.parallel.ring import ring_attention
from jaxpar.parallel.ulysses import ulysses_attention, ulysses_check
from jaxpar.rules import LayoutError, Rules, active_layout


def sequence_axis(rules: Rules, mesh_shape, /) -> str | None:
    """The mesh axis that splits positions inside attention, or None when they are not split."""
    axes = [a for a in rules["inner_length"] if mesh_shape[a] > 1]
    if len(axes) > 1:
        raise LayoutError(
            f"rules {rules.name!r}: inner_length is split over {axes}; context parallel "
            "attention supports one mesh axis"
        )
    return axes[0] if axes else None


def check_context_parallel(
    strategy: str, order: str, /, *, seq: int, num_heads: int, num_kv_heads: int, rules: Rules, mesh_shape
) -> None:
    """Refuses, before anything compiles, a strategy the layout cannot run; names field and axis."""
    strategy = ContextParallel.parse(strategy, field="execution.context_parallel")
    order = TokenOrder.parse(order, field="execution.cp_order")
    axis = sequence_axis(rules, mesh_shape)
    if axis is None or strategy == "none":
        return
    n = mesh_shape[axis]
    if strategy == "ring" and order == "zigzag" and seq % (2 * n):
        raise LayoutError(
            f"seq={seq} is not divisible by 2 × {axis}={n} = {2 * n}: the zig-zag order gives "
            f"each device two chunks of seq / {2 * n} (or set execution.cp_order=contiguous)"
        )
    if strategy == "ulysses":
        heads_ways = math.prod(mesh_shape[a] for a in rules["act_heads"])
        kv_ways = math.prod(mesh_shape[a] for a in rules["act_kv_heads"])
        local_kv = num_kv_heads // kv_ways
        if heads_ways > 1 and not rules["act_kv_heads"]:  # replicated: each device keeps its group's one
            local_kv = 1  # (context_attention's _own_kv_head)
        ulysses_check(num_heads // heads_ways, local_kv, n, replicate_kv=False)


def storage_order(length: int, strategy: str, order: str, /) -> np.ndarray | None:
    """How the model stores a sequence of ``length`` tokens under the current layout: position p holds
    token ``order[p]``; None means the natural order."""
    layout = active_layout()
    if layout is None or strategy != "ring" or order != "zigzag":
        return None
    mesh, rules = layout
    axis = sequence_axis(rules, mesh.shape)
    return None if axis is None else zigzag_order(length, mesh.shape[axis])


def context_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    index: jax.Array,
    /,
    *,
    strategy: str,
    window: int | None = None,
    implementation: str | None = None,
    segments: jax.Array | None = None,
) -> jax.Array:
    """Causal attention: q [B, T, N, H], k/v [B, T, K, H], index int [B, T] (each stored token's place
    in the original sequence), segments int [B, T] or None (packed documents: a token sees only its
    own document's tokens; every path takes them). Returns [B, T, N, H]."""
    layout = active_layout(q, k, v)
    axis = None if layout is None or strategy == "none" else sequence_axis(layout[1], layout[0].shape)
    if axis is None and str(implementation) == AttentionImpl.SPLASH:
        return splash_attention(q, k, v, causal=True, window=window, segments=segments)
    if axis is None:
        local = None if window is None else (window - 1, 0)
        return jax.nn.dot_product_attention(
            q,
            k,
            v,
            mask=None if segments is None else segments[:, None, :, None] == segments[:, None, None, :],
            is_causal=True,
            local_window_size=local,
            implementation=None if implementation is None else str(implementation),
        )
    mesh, rules = layout
    # Axes already manual around this call (the batch axes where gradients are reduced once a step) are
    # this device's part already: the kernel's specs leave them out.
    manual = set(jax.sharding.get_abstract_mesh().manual_axes)
    batch, heads, kv_heads = (
        tuple(a for a in rules[name] if a not in manual) or None for name in ("batch", "act_heads", "act_kv_heads")
    )
    q_spec = PartitionSpec(batch, axis, heads, None)
    kv_spec = PartitionSpec(batch, axis, kv_heads, None)
    index_spec = PartitionSpec(batch, axis)
    kernel, impl = _kernel(strategy), None if implementation is None else str(implementation)

    def body(q, k, v, index, segments):  # q: [B/b, T/n, N/h, H]; k, v: [B/b, T/n, K/h or K, H]
        if heads and not kv_heads:  # kv heads replicated over the head axes: keep this group's one
            k, v = (_own_kv_head(x, heads, mesh.shape, q.shape[2]) for x in (k, v))
        more = {} if kernel is not ulysses_attention else {"implementation": impl}
        return kernel(q, k, v, index, index, segments, segments, axis_name=axis, causal=True, window=window, **more)

    # A Pallas kernel's outputs carry no varying-axes type (``vma``): shard_map's check is off around it.
    return jax.shard_map(
        body,
        mesh=mesh,
        in_specs=(q_spec, kv_spec, kv_spec, index_spec, index_spec),
        out_specs=q_spec,
        check_vma=impl != AttentionImpl.SPLASH,
    )(q, k, v, index, segments)


def _own_kv_head(x: jax.Array, head_axes, mesh_shape, local_heads: int) -> jax.Array:
    """The kv head that this device's query heads share, when K is replicated over the head axes
    (fewer kv heads than head shards): device r holds query heads r·N/t.. and so kv head r·(N/t) // G."""
    ways = math.prod(mesh_shape[a] for a in head_axes)
    group = local_heads * ways // x.shape[2]  # query heads per kv head (G)
    r = jax.lax.axis_index(head_axes)
    return jax.lax.dynamic_slice_in_dim(x, r * local_heads // group, 1, axis=2)


def _kernel(strategy: str):
    strategy = ContextParallel.parse(strategy, field="execution.context_parallel")
    if strategy == ContextParallel.RING:
        return ring_attention
    return ulysses_attention  # (none never gets here)
