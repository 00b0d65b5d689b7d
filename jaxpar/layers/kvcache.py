"""The KV cache the attention layers read and write during generation.

Legend: B batch, T tokens of this call, S cache slots, K kv heads, G = N / K query heads per kv head,
N query heads, H head width, R MLA latent width (kv_lora_rank), Hr MLA rope-key width.

A layer is called in one of two modes (``Step.mode``):
    prefill  the prompts, right-padded to a bucket of T positions (row b's tokens are 0..lengths[b]-1):
             attention runs exactly as in training (ring attention when positions are split over
             ``sequence``), then the keys and values of the real tokens fill a fresh cache
    decode   T new tokens per row at ``positions`` [B, T] (one when decoding): attended over the cache
             as it was and over themselves, then written into it (``jaxpar.parallel.decode``: why in
             that order; a partial-softmax combine when the cache's slots are split over devices)
Position p lives in slot p mod S. A full-attention cache has S ≥ every position, so slot s holds
position s; a sliding-window cache keeps S = window slots as a ring, so at most the window is kept.

GQA caches keys [B, K, H, S] and values [B, K, S, H]: each in the layout its product reads (batched over
B and K, then the contracted axis, then the kept one), so neither is transposed in a step (kept as
[B, S, K, H], XLA:CPU transposed every layer's whole cache in every step). MLA caches what it needs to
rebuild them: the normalised latent [B, S, R] and the rotated rope key [B, S, Hr] shared by all heads;
decoding absorbs the up-projection of keys into the query and that of values into the output, so
per-head keys and values never exist. Every cache array carries logical names, one tuple per array
(``NAMES``: ``cache_batch``, ``cache_length``, ``cache_kv_heads``). A
model keeps one cache per layer ({stack: [cache of each layer]}, ``empty_cache``), each its own arrays,
so a decode step writes its new entries in place (the cache is donated) and copies nothing.

Paged caches (``PagedKVCache``, ``PagedLatentCache``; the serving engine's) keep one pool of pages
shared by all sequences and a page table [B, W] per call: row b's position p lives in page table[b, p //
page], at p mod page. GQA pools keep each page in the layout its product reads (keys [P, K, H, page],
values [P, K, page, H]); MLA pools keep latents and rope keys [P, page, ...]. Decoding runs over each
row's pages where they lie, a block of page columns at a time, a partial softmax per block merged as it
goes (``jaxpar.parallel.decode.over_pages``), then over the call's new tokens, and then writes them into
their pages. Slots from a row's first new position on are zeroed when read: a stale page may hold
anything, NaN included, and 0·NaN would poison the softmax-weighted sum. Page 0 is the all-zero null
page that unused table entries point at (``jaxpar.inference.pages``). Query positions < 0 are padding:
nothing is written for them and their outputs are meaningless but finite.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp

from jaxpar.parallel.decode import (
    after,
    block,
    empty_partial,
    finished,
    first_positions,
    merged,
    new_visible,
    old_visible,
    over_pages,
    run_over_slots,
    softmax_combine,
    write,
)
from jaxpar.rules import constrain

PREFILL, DECODE = "prefill", "decode"


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
    """One GQA layer's cache."""

    k: jax.Array  # [B, K, H, S]
    v: jax.Array  # [B, K, S, H]

    NAMES = (
        ("cache_batch", "cache_kv_heads", None, "cache_length"),
        ("cache_batch", "cache_kv_heads", "cache_length", None),
    )


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LatentCache:
    """One MLA layer's cache."""

    latent: jax.Array  # [B, S, R]   kv_a_norm of the compressed key/value
    rope_key: jax.Array  # [B, S, Hr]  the decoupled RoPE key, rotated

    NAMES = (("cache_batch", "cache_length", None),) * 2


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PagedKVCache:
    """One GQA layer's page pool and this call's page table."""

    k: jax.Array  # [P, K, H, page]
    v: jax.Array  # [P, K, page, H]
    table: jax.Array  # [B, W] int32 page ids

    NAMES = ((None, "cache_kv_heads", None, None),) * 2
    SLOT_AXES = (3, 2)  # where each pool keeps a page's positions


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PagedLatentCache:
    """One MLA layer's page pool of latents and rope keys, and this call's page table."""

    latent: jax.Array  # [P, page, R]
    rope_key: jax.Array  # [P, page, Hr]
    table: jax.Array  # [B, W] int32 page ids

    NAMES = ((None, None, None),) * 2


@dataclasses.dataclass(frozen=True)
class Step:
    """How a layer uses its cache in this call: ``mode`` (prefill or decode) and, for prefill, the
    prompts' lengths [B] (which of the padded positions are real)."""

    mode: str
    lengths: jax.Array | None = None


def map_arrays(cache, fn: Callable):
    """``cache`` (any of the four kinds) with ``fn(array, its logical names)`` applied to each array;
    a page table (or its absence) is kept as it is."""
    fields = [getattr(cache, f.name) for f in dataclasses.fields(cache)]
    mapped = [fn(x, names) for x, names in zip(fields, cache.NAMES)]
    return type(cache)(*mapped, *fields[len(cache.NAMES) :])


def slot_axis(names: tuple) -> int:
    """The axis of a cache array's slots, from its logical names."""
    return names.index("cache_length")


def keys_layout(x: jax.Array) -> jax.Array:
    """Keys [B, S, K, H] as the cache keeps them, [B, K, H, S]."""
    return jnp.einsum("bskh->bkhs", x)


def values_layout(x: jax.Array) -> jax.Array:
    """Values [B, S, K, H] as the cache keeps them, [B, K, S, H]."""
    return jnp.einsum("bskh->bksh", x)


def with_table(pools: dict, table: jax.Array) -> dict:
    """Page pools {stack: [Paged*Cache of each layer]} given this call's page table [B, W] (every layer
    reads the same table)."""
    return {name: [dataclasses.replace(c, table=table) for c in layers] for name, layers in pools.items()}


def without_table(pools: dict) -> dict:
    """Page pools {stack: [Paged*Cache of each layer]} with their table dropped (what a step keeps)."""
    return {name: [dataclasses.replace(c, table=None) for c in layers] for name, layers in pools.items()}


def filled(x: jax.Array, lengths: jax.Array, slots: int) -> jax.Array:
    """A fresh cache array [B, S, ...] holding prefill's x [B, T, ...] at the real positions (< lengths);
    empty slots are zero. When T > S (a prompt longer than a sliding window) slot s takes the newest real
    position ≡ s (mod S)."""
    b, t = x.shape[:2]
    tail = (1,) * (x.ndim - 2)
    if slots >= t:
        real = (jnp.arange(t)[None, :] < lengths[:, None]).reshape(b, t, *tail)
        x = jnp.where(real, x, 0)
        return jnp.pad(x, [(0, 0), (0, slots - t)] + [(0, 0)] * (x.ndim - 2))
    last = lengths[:, None] - 1
    held = last - jnp.mod(last - jnp.arange(slots)[None, :], slots)  # [B, S]
    picked = jnp.take_along_axis(x, jnp.maximum(held, 0).reshape(b, slots, *tail), axis=1)
    return jnp.where((held >= 0).reshape(b, slots, *tail), picked, 0)


def page_write(pool: jax.Array, new: jax.Array, positions: jax.Array, table: jax.Array, axis: int = 1) -> jax.Array:
    """pool [P, ...] (a page's positions on ``axis``) with new [B, T, ...] written at positions [B, T]
    through table [B, W]; padding (position < 0) and positions past the table are dropped."""
    size, width = pool.shape[axis], table.shape[1]
    index = positions // size
    page = jnp.take_along_axis(table, jnp.clip(index, 0, width - 1), axis=1)
    page = jnp.where((positions >= 0) & (index < width), page, pool.shape[0])  # dropped
    where = (page, *(slice(None),) * (axis - 1), jnp.mod(positions, size))
    return pool.at[where].set(new.astype(pool.dtype), mode="drop")


def _gqa_attend(q, k, v, ck, cv, positions, *, offset, slots: int, window, axis):
    """Grouped queries q [B, K, G, T, H] over the cache as it was, keys ck [B, K, H, S] and values cv
    [B, K, S, H], and the call's new keys and values k/v [B, U, K, H] -> [B, K, G, T, H]. The cache
    products read the cache as it lies; the new tokens' block is counted on the first device only."""
    f32, scale = jnp.float32, q.shape[-1] ** -0.5
    old = jnp.einsum("bkgth,bkhs->bkgts", q, ck, preferred_element_type=f32) * scale
    new = jnp.einsum("bkgth,bukh->bkgtu", q, k, preferred_element_type=f32) * scale
    parts = [
        (old, old_visible(positions, offset, cv.shape[2], slots, window)[:, None, None], cv, "bkgts,bksh->bkgth"),
        (new, new_visible(positions, window, counted=offset == 0)[:, None, None], v, "bkgtu,bukh->bkgth"),
    ]
    return softmax_combine(parts, axis)


def _grouped(q, kv: int):
    """q [B, T, N, H] -> [B, K, G, T, H]: query head i uses kv head i // G."""
    b, t, n, h = q.shape
    return jnp.einsum("btkgh->bkgth", q.reshape(b, t, kv, n // kv, h))


def _ungrouped(out):
    """[B, K, G, T, H] -> [B, T, N, H]."""
    b, kv, g, t, h = out.shape
    return jnp.einsum("bkgth->btkgh", out).reshape(b, t, kv * g, h)


def _written_after(out, *new):
    """The new entries, made to depend on the attention output ``out`` [B, K, ...] (one value per row
    and kv head), so the cache is written after every read of it (``jaxpar.parallel.decode.after``)."""
    done = out[:, :, 0, 0, 0][:, None, :, None]  # [B, 1, K, 1]
    return tuple(after(x, done) for x in new)


def _gqa_pages(q, cache: PagedKVCache, positions, window):
    """The partial softmax of grouped queries q [B, K, G, T, H] over each row's pages (positions before
    its first new token): keys [B, c, K, H, page] and values [B, c, K, page, H] a block (``over_pages``)."""
    b, w = cache.table.shape
    page = cache.v.shape[PagedKVCache.SLOT_AXES[1]]
    kv, h, slots = cache.k.shape[1], cache.k.shape[2], w * page
    scale = q.shape[-1] ** -0.5

    def attend(blocks, ok, held):
        keys = jnp.einsum("bckhp->bkhcp", blocks[0]).reshape(b, kv, h, -1)
        values = jnp.einsum("bckph->bkcph", blocks[1]).reshape(b, kv, -1, h)
        values = jnp.where(held[:, None, :, None], values, 0)
        scores = jnp.einsum("bkgth,bkhs->bkgts", q, keys, preferred_element_type=jnp.float32) * scale
        return block(scores, ok[:, None, None], values, "bkgts,bksh->bkgth")

    held = jnp.arange(slots)[None, :] < first_positions(positions)[:, None]
    ok = old_visible(positions, 0, slots, slots, window)
    return over_pages(cache.table, (cache.k, cache.v), page, ok, held, attend, empty_partial(q.shape[:4], h))


def paged_gqa_decode(q, k, v, cache: PagedKVCache, positions, *, window: int | None):
    """``gqa_decode`` over a page pool: same arguments and results. Each row's pages are attended where
    they lie (``_gqa_pages``), then the new tokens, and the new tokens are written into the pool after."""
    q = _grouped(q, k.shape[2])
    old = _gqa_pages(q, cache, positions, window)
    scores = jnp.einsum("bkgth,bukh->bkgtu", q, k, preferred_element_type=jnp.float32) * q.shape[-1] ** -0.5
    new = block(scores, new_visible(positions, window)[:, None, None], v, "bkgtu,bukh->bkgth")
    out = finished(merged(old, new), cache.v.dtype)
    k, v = _written_after(out, k, v)
    pools = (
        page_write(p, x, positions, cache.table, axis)
        for p, x, axis in zip((cache.k, cache.v), (k, v), PagedKVCache.SLOT_AXES)
    )
    pools = (constrain(p, names) for p, names in zip(pools, PagedKVCache.NAMES))
    return _ungrouped(out), PagedKVCache(*pools, cache.table)


def gqa_decode(q, k, v, cache: KVCache, positions, *, window: int | None) -> tuple[jax.Array, KVCache]:
    """q [B, T, N, H], new k/v [B, T, K, H] at positions [B, T] -> (attention output [B, T, N, H], cache)."""
    if isinstance(cache, PagedKVCache):
        return paged_gqa_decode(q, k, v, cache, positions, window=window)
    knames, vnames = KVCache.NAMES
    slots = cache.v.shape[slot_axis(vnames)]
    flat = ("cache_batch", None, "cache_kv_heads", None)  # q and the output: heads split as the cache's
    q = _grouped(constrain(q, flat), k.shape[2])

    def body(q, k, v, ck, cv, positions, *, offset, axis):
        out = _gqa_attend(q, k, v, ck, cv, positions, offset=offset, slots=slots, window=window, axis=axis)
        k, v = _written_after(out, k, v)
        ck = write(ck, k, positions, offset, slots, axis=slot_axis(knames))
        cv = write(cv, v, positions, offset, slots, axis=slot_axis(vnames))
        return out, ck, cv

    grouped, token = ("cache_batch", "cache_kv_heads", None, None, None), ("cache_batch", None, "cache_kv_heads", None)
    names = (grouped, token, token, knames, vnames, ("cache_batch", None))
    args = [constrain(a, nm) for a, nm in zip((q, k, v, cache.k, cache.v, positions), names)]
    out, ck, cv = run_over_slots(body, args, names, (grouped, knames, vnames))
    return constrain(_ungrouped(out), flat), KVCache(ck, cv)


def _mla_scores(ql, qr, c, kr, scale: float):
    """Absorbed MLA queries ql [B, T, N, R], qr [B, T, N, Hr] against latents c [B, S, R] and rope keys
    kr [B, S, Hr] -> float32 scores [B, N, T, S]."""
    f32 = jnp.float32
    latent = jnp.einsum("btnr,bsr->bnts", ql, c, preferred_element_type=f32)
    return (latent + jnp.einsum("btnh,bsh->bnts", qr, kr, preferred_element_type=f32)) * scale


def _mla_attend(ql, qr, c, kr, cc, ckr, positions, *, offset, slots: int, scale: float, axis):
    """Absorbed MLA queries ql [B, T, N, R], qr [B, T, N, Hr] over the cache as it was, latents cc
    [B, S, R] and rope keys ckr [B, S, Hr], and the call's new c [B, U, R], kr [B, U, Hr] -> [B, N, T, R]."""
    old_ok = old_visible(positions, offset, cc.shape[1], slots, None)[:, None]
    new_ok = new_visible(positions, None, counted=offset == 0)[:, None]
    parts = [
        (_mla_scores(ql, qr, cc, ckr, scale), old_ok, cc, "bnts,bsr->bntr"),
        (_mla_scores(ql, qr, c, kr, scale), new_ok, c, "bntu,bur->bntr"),
    ]
    return softmax_combine(parts, axis)


def _mla_pages(ql, qr, cache: PagedLatentCache, positions, scale: float):
    """The partial softmax of absorbed queries over each row's pages (positions before its first new
    token): latents [B, c, page, R] and rope keys [B, c, page, Hr] a block (``over_pages``)."""
    b, w = cache.table.shape
    page, slots = cache.latent.shape[1], w * cache.latent.shape[1]

    def attend(blocks, ok, held):
        c, kr = (x.reshape(b, -1, x.shape[-1]) for x in blocks)
        c = jnp.where(held[..., None], c, 0)
        return block(_mla_scores(ql, qr, c, kr, scale), ok[:, None], c, "bnts,bsr->bntr")

    held = jnp.arange(slots)[None, :] < first_positions(positions)[:, None]
    ok = old_visible(positions, 0, slots, slots, None)
    lead = (b, ql.shape[2], ql.shape[1])  # [B, N, T]
    pools = (cache.latent, cache.rope_key)
    return over_pages(cache.table, pools, page, ok, held, attend, empty_partial(lead, cache.latent.shape[-1]))


def mla_decode(q_latent, q_rope, latent, rope_key, cache: LatentCache, positions, *, scale: float):
    """MLA with absorbed up-projections: q_latent [B, T, N, R] (q_nope · W_k), q_rope [B, T, N, Hr], new
    latent [B, T, R] and rope_key [B, T, Hr] at positions [B, T] -> (softmax-weighted latents [B, T, N, R]
    for the caller to project by W_v, cache)."""
    done = lambda out: out[:, 0, 0, 0][:, None, None]  # [B, 1, 1]: one value per row
    if isinstance(cache, PagedLatentCache):
        old = _mla_pages(q_latent, q_rope, cache, positions, scale)
        scores = _mla_scores(q_latent, q_rope, latent, rope_key, scale)
        new = block(scores, new_visible(positions, None)[:, None], latent, "bntu,bur->bntr")
        out = finished(merged(old, new), cache.latent.dtype)
        new = (after(x, done(out)) for x in (latent, rope_key))
        pools = (page_write(p, x, positions, cache.table) for p, x in zip((cache.latent, cache.rope_key), new))
        return jnp.einsum("bntr->btnr", out), PagedLatentCache(*pools, cache.table)
    names = LatentCache.NAMES[0]
    slots = cache.latent.shape[slot_axis(names)]

    def body(ql, qr, c, kr, cc, ckr, positions, *, offset, axis):
        out = _mla_attend(ql, qr, c, kr, cc, ckr, positions, offset=offset, slots=slots, scale=scale, axis=axis)
        c, kr = after(c, done(out)), after(kr, done(out))
        return out, write(cc, c, positions, offset, slots), write(ckr, kr, positions, offset, slots)

    heads, token = ("cache_batch", None, None, None), ("cache_batch", None, None)
    names = (heads, heads, token, token, names, names, ("cache_batch", None))
    args = [
        constrain(a, nm)
        for a, nm in zip((q_latent, q_rope, latent, rope_key, cache.latent, cache.rope_key, positions), names)
    ]
    out, cc, ckr = run_over_slots(body, args, names, (heads, *LatentCache.NAMES))
    return jnp.einsum("bntr->btnr", out), LatentCache(cc, ckr)
