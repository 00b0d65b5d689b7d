"""Attention of new tokens over a KV cache whose slots may be split over mesh axes (``cache_length``).

Legend: B batch, T new tokens (1 when decoding), S cache slots (S/n per device when split n ways),
K kv heads, G query heads per kv head, N query heads, H head width, R an MLA latent width.

Decoding reads the whole cache once per token. When a long prompt was prefilled with ring attention over
``sequence``, its cache stays split along its slots: device r holds slots [r·S/n, (r+1)·S/n). Gathering it
back would move the whole cache every step, so instead every device attends over its own slots and the
devices combine their partial softmaxes, flash-attention style:

    m = pmax(max_s score)        l = psum(Σ_s e^(score − m))        o = psum(Σ_s e^(score − m)·v)        out = o / l

Three small collectives per layer (the [B, heads] maxima and sums and the [B, heads, H] numerators);
the cache never moves. With ``cache_length`` unsplit the same code runs without the collectives.

A new token is written into its slot first (position p lives in slot p mod S: a sliding-window cache of
S = window slots is a ring), only by the device that owns the slot; slots another device owns, and
positions beyond the cache, are dropped by the scatter (``mode="drop"``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp

from jaxpar.rules import active_layout


def slot_positions(positions: jax.Array, offset, local_slots: int, slots: int) -> jax.Array:
    """The position each of this device's slots holds as seen by each query: positions [B, T] ->
    [B, T, S_local]; negative = empty. Slot s holds the newest position ≤ p that is ≡ s (mod S)."""
    s = offset + jnp.arange(local_slots, dtype=positions.dtype)
    p = positions[..., None]
    return p - jnp.mod(p - s, slots)


def visible(positions: jax.Array, offset, local_slots: int, slots: int, window: int | None) -> jax.Array:
    """Which slots each query attends to: bool [B, T, S_local] (causal, within the window)."""
    held = slot_positions(positions, offset, local_slots, slots)
    ok = held >= 0
    return ok if window is None else ok & (positions[..., None] - held < window)


def write(cache: jax.Array, new: jax.Array, positions: jax.Array, offset, slots: int) -> jax.Array:
    """cache [B, S_local, ...] with new [B, T, ...] written at the slots of positions [B, T] that this
    device owns (the others are dropped). One scatter per row under ``vmap``: the row is a batching
    dimension of the scatter, so a cache split by rows (``cache_batch``) writes where it lies (indexing
    the rows explicitly made the partitioner all-gather every row's new keys and values to every device)."""
    local = jnp.mod(positions, slots) - offset
    local = jnp.where((local >= 0) & (local < cache.shape[1]), local, cache.shape[1])  # out of range: dropped
    return jax.vmap(lambda c, n, i: c.at[i].set(n, mode="drop"))(cache, new.astype(cache.dtype), local)


def softmax_combine(scores: jax.Array, valid: jax.Array, values: jax.Array, spec: str, axis) -> jax.Array:
    """softmax(scores) · values over the slot axis (last of ``scores``), combined over ``axis`` when the
    slots are split. scores float32 [..., S_local]; valid broadcasts against them; ``spec`` the einsum of
    the weights with ``values`` giving [..., V] (the scores' leading axes, then the value width)."""
    scores = jnp.where(valid, scores, -jnp.inf)
    m = jax.lax.stop_gradient(jnp.max(scores, axis=-1, keepdims=True))  # a shift: no gradient flows
    if axis:
        m = jax.lax.pmax(m, axis)
    weights = jnp.exp(scores - m)  # empty slots: exp(-inf) = 0
    total = jnp.sum(weights, axis=-1)
    out = jnp.einsum(spec, weights.astype(values.dtype), values, preferred_element_type=jnp.float32)
    if axis:
        total, out = jax.lax.psum(total, axis), jax.lax.psum(out, axis)
    return (out / total[..., None]).astype(values.dtype)


def run_over_slots(body: Callable, args: Sequence[jax.Array], names: Sequence[tuple], out_names: Sequence[tuple]):
    """``body(*args, offset=, axis=)`` with the cache split as the layout splits ``cache_length``: under
    ``shard_map`` (each device its own slots; ``offset`` its first slot, ``axis`` the mesh axes to combine
    over) when split, else directly (offset 0, no axis). ``names`` / ``out_names``: logical names of the
    arguments' and results' dimensions (``cache_*`` names place them)."""
    layout = active_layout(*args)
    split = () if layout is None else tuple(a for a in layout[1]["cache_length"] if layout[0].shape[a] > 1)
    if not split:
        return body(*args, offset=0, axis=None)
    mesh, rules = layout

    def local(*local_args):
        slots = next(a.shape[1] for a, n in zip(local_args, names) if len(n) > 1 and n[1] == "cache_length")
        return body(*local_args, offset=jax.lax.axis_index(split) * slots, axis=split)

    specs = tuple(rules.spec(n) for n in names)
    out_specs = tuple(rules.spec(n) for n in out_names)
    return jax.shard_map(local, mesh=mesh, in_specs=specs, out_specs=out_specs)(*args)
