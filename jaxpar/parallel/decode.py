"""Attention of new tokens over a KV cache whose slots may be split over mesh axes (``cache_length``).

Legend: B batch, T new tokens (1 when decoding), U the same T tokens as keys, S cache slots (S/n per
device when split n ways), K kv heads, G query heads per kv head, N query heads, H head width, R an MLA
latent width.

A call's queries attend over two blocks of keys: the cache as it was (the "old" block: each row's
positions before its first new token) and the call's own new tokens (causal among themselves). Only
then are the new tokens written into their slots (position p lives in slot p mod S: a sliding-window
cache of S = window slots is a ring), only by the device that owns the slot; slots another device owns,
and positions beyond the cache, are dropped by the scatter (``mode="drop"``). Reading the cache before
writing it is what lets XLA update the donated cache in place: the write is made to depend on the
attention's output (``after``), so every read of the old cache is done when the write begins. (Written
first and read after, XLA:CPU copied every layer's whole cache in every step at batch 1: it fused the
in-place update into two consumers.)

Decoding reads the whole cache once per token. When a long prompt was prefilled with ring attention over
``sequence``, its cache stays split along its slots: device r holds slots [r·S/n, (r+1)·S/n). Gathering it
back would move the whole cache every step, so instead every device attends over its own slots and the
devices combine their partial softmaxes, flash-attention style:

    m = pmax(max_s score)        l = psum(Σ_s e^(score − m))        o = psum(Σ_s e^(score − m)·v)        out = o / l

Three small collectives per layer (the [B, heads] maxima and sums and the [B, heads, H] numerators);
the cache never moves. The new tokens' block is counted by the first device only. With
``cache_length`` unsplit the same code runs without the collectives.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp

from jaxpar.rules import active_layout


def first_positions(positions: jax.Array) -> jax.Array:
    """Each row's first new position [B] (its cache holds the positions before it); 0 for a row of
    padding only (positions < 0)."""
    real = positions >= 0
    return jnp.where(real.any(axis=1), jnp.min(jnp.where(real, positions, jnp.iinfo(positions.dtype).max), axis=1), 0)


def old_visible(positions: jax.Array, offset, local_slots: int, slots: int, window: int | None) -> jax.Array:
    """Which of this device's slots of the cache as it was each query sees: bool [B, T, S_local]. Slot s
    holds the newest position before the row's first new token that is ≡ s (mod S); a query sees it when
    it is not after the query (a padding query may sit before the row's tokens) and within the window."""
    last = first_positions(positions)[:, None] - 1  # [B, 1]
    held = (last - jnp.mod(last - (offset + jnp.arange(local_slots, dtype=positions.dtype)), slots))[:, None, :]
    p = positions[..., None]
    ok = (held >= 0) & (held <= p)
    return ok if window is None else ok & (p - held < window)


def new_visible(positions: jax.Array, window: int | None, *, counted=True) -> jax.Array:
    """Which of the call's new tokens each query sees: bool [B, T, U] (causal, within the window, not
    padding). ``counted`` False (a device other than the first, when the slots are split) sees none."""
    p, u = positions[:, :, None], positions[:, None, :]
    ok = (u >= 0) & (u <= p) & counted
    return ok if window is None else ok & (p - u < window)


def after(x: jax.Array, done: jax.Array) -> jax.Array:
    """``x`` unchanged, but computed from ``done`` (values of the attention's output that broadcast
    against x: one per row, or per row and kv head, so the dependency stays on each device): a float
    ``0 · done`` (XLA keeps it: it is NaN for an infinite value), made an exact zero by a select."""
    zero = done.astype(jnp.float32) * 0
    return x + jnp.where(zero == 0, zero, 0).astype(x.dtype)


def write(cache: jax.Array, new: jax.Array, positions: jax.Array, offset, slots: int, *, axis: int = 1) -> jax.Array:
    """cache [B, ..., S_local, ...] (slots on ``axis``) with new [B, T, ...] written at the slots of
    positions [B, T] that this device owns (the others are dropped). One scatter per row under ``vmap``:
    the row is a batching dimension of the scatter, so a cache split by rows (``cache_batch``) writes where
    it lies (indexing the rows explicitly made the partitioner all-gather every row's new keys and values to
    every device). A cache with axes before its slots ([B, K, S, H]) takes new [B, T, K, H] as it comes."""
    local = jnp.mod(positions, slots) - offset
    local = jnp.where((local >= 0) & (local < cache.shape[axis]), local, cache.shape[axis])  # out of range: dropped
    new = jnp.moveaxis(new.astype(cache.dtype), 1, axis)  # [B, ..., T, ...]: a few values, not the cache
    lead = (slice(None),) * (axis - 1)
    return jax.vmap(lambda c, n, i: c.at[(*lead, i)].set(n, mode="drop"))(cache, new, local)


def softmax_combine(parts: Sequence[tuple], axis) -> jax.Array:
    """softmax over the union of several blocks of keys, times their values, combined over ``axis``
    when the slots are split. ``parts``: (scores float32 [..., S_i], valid (broadcasts against them),
    values, the einsum of the weights with the values giving [..., V]). A query that sees no key at all
    gets zeros (its weights are all 0), not NaN."""
    scores = [jnp.where(ok, sc, -jnp.inf) for sc, ok, _, _ in parts]
    m = jnp.max(jnp.stack([jnp.max(sc, axis=-1) for sc in scores]), axis=0)[..., None]
    m = jax.lax.stop_gradient(m)  # a shift: no gradient flows
    if axis:
        m = jax.lax.pmax(m, axis)
    m = jnp.where(jnp.isfinite(m), m, 0)
    total, out = 0.0, 0.0
    for sc, (_, _, values, spec) in zip(scores, parts):
        weights = jnp.exp(sc - m)  # unseen keys: exp(-inf) = 0
        total = total + jnp.sum(weights, axis=-1)
        out = out + jnp.einsum(spec, weights.astype(values.dtype), values, preferred_element_type=jnp.float32)
    if axis:
        total, out = jax.lax.psum(total, axis), jax.lax.psum(out, axis)
    return (out / jnp.maximum(total, jnp.finfo(jnp.float32).tiny)[..., None]).astype(parts[0][2].dtype)


def block(scores: jax.Array, ok: jax.Array, values: jax.Array, spec: str) -> tuple:
    """One block of keys' unnormalised softmax: (the row maxima m [...], Σ e^(score − m) [...], Σ
    e^(score − m)·v [..., V]; float32). Unseen keys weigh 0; a query that sees none of the block has m = −∞
    and zero sums."""
    sc = jnp.where(ok, scores, -jnp.inf)
    m = jax.lax.stop_gradient(jnp.max(sc, axis=-1))
    weights = jnp.exp(sc - jnp.where(jnp.isfinite(m), m, 0)[..., None])
    out = jnp.einsum(spec, weights.astype(values.dtype), values, preferred_element_type=jnp.float32)
    return m, jnp.sum(weights, axis=-1), out


def merged(a: tuple, b: tuple) -> tuple:
    """Two blocks' partial softmaxes (``block``) as one: each rescaled to the larger maximum."""
    m = jnp.maximum(a[0], b[0])
    shift = jnp.where(jnp.isfinite(m), m, 0)
    ra, rb = jnp.exp(a[0] - shift), jnp.exp(b[0] - shift)  # a block with m = −∞ contributes 0
    return m, a[1] * ra + b[1] * rb, a[2] * ra[..., None] + b[2] * rb[..., None]


def finished(partial: tuple, dtype) -> jax.Array:
    """The attention output of a partial softmax (zeros for a query that saw no key)."""
    _, total, out = partial
    return (out / jnp.maximum(total, jnp.finfo(jnp.float32).tiny)[..., None]).astype(dtype)


BLOCK_BYTES = 1 << 18  # the most pool bytes one step of ``over_pages`` gathers: they stay in cache while used


def pages_per_step(table: jax.Array, pools: Sequence[jax.Array]) -> int:
    """How many page columns one step of ``over_pages`` takes: the most that divide the table's width and
    whose pages (of every pool) fit in ``BLOCK_BYTES`` (at least one). A small cache is read in one step
    (a loop step costs more than its work there); a large one in blocks that stay in cache."""
    b, w = table.shape
    column = b * sum(math.prod(p.shape[1:]) * p.dtype.itemsize for p in pools)
    return max([c for c in range(1, w + 1) if w % c == 0 and c * column <= BLOCK_BYTES] or [1])


def over_pages(table, pools: Sequence[jax.Array], page: int, ok, held, attend: Callable, empty: tuple) -> tuple:
    """The partial softmax (``block``) of a call's queries over each row's pages, read where they lie: a
    ``scan`` over blocks of c page columns (``pages_per_step``), each step gathering row b's pages
    table[b, j·c … j·c + c − 1] of every pool ([B, c, ...] each) and handing them to ``attend(blocks,
    ok_c, held_c)`` (-> that block's partial softmax), merged into the running one (``empty`` to start).
    ok [B, T, W·page]: which slots each query sees; held [B, W·page]: which hold the row's own positions
    (``attend`` zeroes the others' values: a stale page may hold anything, NaN included, and 0·NaN would
    poison the weighted sum). Gathering every page of a large cache first would move the whole cache
    twice more (written gathered, read back), element by element on XLA:CPU."""
    b, w = table.shape
    t, c = ok.shape[1], pages_per_step(table, pools)
    n, width = w // c, c * page
    columns = (
        jnp.moveaxis(table.reshape(b, n, c), 1, 0),
        jnp.moveaxis(ok.reshape(b, t, n, width), 2, 0),
        jnp.moveaxis(held.reshape(b, n, width), 1, 0),
    )

    def step(partial, column):
        ids, ok_c, held_c = column
        return merged(partial, attend([p[ids] for p in pools], ok_c, held_c)), None

    return jax.lax.scan(step, empty, columns)[0]


def empty_partial(lead: tuple, width: int) -> tuple:
    """The partial softmax of no keys for queries of shape ``lead`` and values ``width`` wide."""
    return jnp.full(lead, -jnp.inf), jnp.zeros(lead), jnp.zeros((*lead, width))


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
        slots = next(a.shape[n.index("cache_length")] for a, n in zip(local_args, names) if "cache_length" in n)
        return body(*local_args, offset=jax.lax.axis_index(split) * slots, axis=split)

    specs = tuple(rules.spec(n) for n in names)
    out_specs = tuple(rules.spec(n) for n in out_names)
    return jax.shard_map(local, mesh=mesh, in_specs=specs, out_specs=out_specs)(*args)
