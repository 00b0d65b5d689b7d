"""The KV cache the attention layers read and write during generation.

Legend: B batch, T tokens of this call, S cache slots, K kv heads, G = N / K query heads per kv head,
N query heads, H head width, R MLA latent width (kv_lora_rank), Hr MLA rope-key width.

A layer is called in one of two modes (``Step.mode``):
    prefill  the prompts, right-padded to a bucket of T positions (row b's tokens are 0..lengths[b]-1):
             attention runs exactly as in training (ring attention when positions are split over
             ``sequence``), then the keys and values of the real tokens fill a fresh cache
    decode   T new tokens per row at ``positions`` [B, T] (one when decoding): written into the cache,
             then attended over it (``jaxpar.parallel.decode``: a partial-softmax combine when the cache's
             slots are split over devices)
Position p lives in slot p mod S. A full-attention cache has S ≥ every position, so slot s holds
position s; a sliding-window cache keeps S = window slots as a ring, so at most the window is kept.

GQA caches K and V, [B, S, K, H] each. MLA caches what it needs to rebuild them: the normalised latent
[B, S, R] and the rotated rope key [B, S, Hr] shared by all heads; decoding absorbs the up-projection of
keys into the query and that of values into the output, so per-head keys and values never exist.
Every cache array carries logical names (``cache_batch``, ``cache_length``, ``cache_kv_heads``). A
model keeps one cache per layer ({stack: [cache of each layer]}, ``empty_cache``), each its own arrays,
so a decode step writes its new entries in place (the cache is donated) and copies nothing.

Paged caches (``PagedKVCache``, ``PagedLatentCache``; the serving engine's) keep one pool of pages
[P, page, ...] shared by all sequences and a page table [B, W] per call: row b's position p lives in
page table[b, p // page], at p mod page. Decoding writes the new tokens there, gathers each row's pages
into a dense [B, W·page, ...] cache (slots past the row's newest position zeroed: a stale page may hold
anything, NaN included, and 0·NaN would poison the softmax-weighted sum) and runs the same attention
code as the dense cache, so paged and dense attention agree bit for bit. Page 0 is the all-zero null
page that unused table entries point at (``jaxpar.inference.pages``). Query positions < 0 are padding:
nothing is written for them and their outputs are meaningless but finite.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxpar.parallel.decode import run_over_slots, softmax_combine, visible, write
from jaxpar.rules import constrain

PREFILL, DECODE = "prefill", "decode"


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
    """One GQA layer's cache."""

    k: jax.Array  # [B, S, K, H]
    v: jax.Array  # [B, S, K, H]

    NAMES = ("cache_batch", "cache_length", "cache_kv_heads", None)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LatentCache:
    """One MLA layer's cache."""

    latent: jax.Array  # [B, S, R]   kv_a_norm of the compressed key/value
    rope_key: jax.Array  # [B, S, Hr]  the decoupled RoPE key, rotated

    NAMES = ("cache_batch", "cache_length", None)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PagedKVCache:
    """One GQA layer's page pool and this call's page table."""

    k: jax.Array  # [P, page, K, H]
    v: jax.Array  # [P, page, K, H]
    table: jax.Array  # [B, W] int32 page ids

    NAMES = (None, None, "cache_kv_heads", None)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PagedLatentCache:
    """One MLA layer's page pool of latents and rope keys, and this call's page table."""

    latent: jax.Array  # [P, page, R]
    rope_key: jax.Array  # [P, page, Hr]
    table: jax.Array  # [B, W] int32 page ids

    NAMES = (None, None, None)


@dataclasses.dataclass(frozen=True)
class Step:
    """How a layer uses its cache in this call: ``mode`` (prefill or decode) and, for prefill, the
    prompts' lengths [B] (which of the padded positions are real)."""

    mode: str
    lengths: jax.Array | None = None


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


def page_write(pool: jax.Array, new: jax.Array, positions: jax.Array, table: jax.Array) -> jax.Array:
    """pool [P, page, ...] with new [B, T, ...] written at positions [B, T] through table [B, W];
    padding (position < 0) and positions past the table are dropped."""
    size, width = pool.shape[1], table.shape[1]
    index = positions // size
    page = jnp.take_along_axis(table, jnp.clip(index, 0, width - 1), axis=1)
    page = jnp.where((positions >= 0) & (index < width), page, pool.shape[0])  # dropped
    return pool.at[page, jnp.mod(positions, size)].set(new.astype(pool.dtype), mode="drop")


def page_gather(pool: jax.Array, table: jax.Array, limit: jax.Array) -> jax.Array:
    """Row b's pages as a dense cache [B, W·page, ...], slots ≥ limit[b] zeroed."""
    b, width = table.shape
    x = pool[table].reshape(b, width * pool.shape[1], *pool.shape[2:])
    held = (jnp.arange(x.shape[1])[None, :] < limit[:, None]).reshape(b, x.shape[1], *(1,) * (x.ndim - 2))
    return jnp.where(held, x, 0)


def _paged(pools: tuple, new: tuple, table, positions):
    """Write ``new`` into ``pools`` and gather them densely: (dense caches, pools, attention positions)."""
    pools = tuple(page_write(p, x, positions, table) for p, x in zip(pools, new))
    limit = jnp.max(positions, axis=1) + 1
    return tuple(page_gather(p, table, limit) for p in pools), pools, jnp.maximum(positions, 0)


def _gqa_attend(q, ck, cv, positions, *, offset, slots: int, window, axis):
    """Grouped queries q [B, T, K, G, H] over cache slots ck/cv [B, S, K, H] (already written)."""
    scores = jnp.einsum("btkgh,bskh->bkgts", q, ck, preferred_element_type=jnp.float32) * q.shape[-1] ** -0.5
    ok = visible(positions, offset, ck.shape[1], slots, window)[:, None, None]  # [B, 1, 1, T, S]
    out = softmax_combine(scores, ok, cv, "bkgts,bskh->bkgth", axis)
    return jnp.einsum("bkgth->btkgh", out)


def paged_gqa_decode(q, k, v, cache: PagedKVCache, positions, *, window: int | None):
    """``gqa_decode`` over a page pool: same arguments and results."""
    b, t, n, h = q.shape
    q = q.reshape(b, t, k.shape[2], n // k.shape[2], h)
    (ck, cv), (pk, pv), seen = _paged((cache.k, cache.v), (k, v), cache.table, positions)
    out = _gqa_attend(q, ck, cv, seen, offset=0, slots=ck.shape[1], window=window, axis=None)
    pools = (constrain(a, PagedKVCache.NAMES) for a in (pk, pv))
    return out.reshape(b, t, n, h), PagedKVCache(*pools, cache.table)


def gqa_decode(q, k, v, cache: KVCache, positions, *, window: int | None) -> tuple[jax.Array, KVCache]:
    """q [B, T, N, H], new k/v [B, T, K, H] at positions [B, T] -> (attention output [B, T, N, H], cache)."""
    if isinstance(cache, PagedKVCache):
        return paged_gqa_decode(q, k, v, cache, positions, window=window)
    b, t, n, h = q.shape
    kv, slots = k.shape[2], cache.k.shape[1]
    flat = ("cache_batch", None, "cache_kv_heads", None)  # q and the output in the cache's layout
    q = constrain(q, flat).reshape(b, t, kv, n // kv, h)  # query head i uses kv head i // G

    def body(q, k, v, ck, cv, positions, *, offset, axis):
        ck, cv = write(ck, k, positions, offset, slots), write(cv, v, positions, offset, slots)
        return _gqa_attend(q, ck, cv, positions, offset=offset, slots=slots, window=window, axis=axis), ck, cv

    grouped, token = ("cache_batch", None, "cache_kv_heads", None, None), ("cache_batch", None, "cache_kv_heads", None)
    names = (grouped, token, token, KVCache.NAMES, KVCache.NAMES, ("cache_batch", None))
    args = [constrain(a, nm) for a, nm in zip((q, k, v, cache.k, cache.v, positions), names)]
    out, ck, cv = run_over_slots(body, args, names, (grouped, KVCache.NAMES, KVCache.NAMES))
    return constrain(out.reshape(b, t, n, h), flat), KVCache(ck, cv)


def _mla_attend(ql, qr, cc, ckr, positions, *, offset, slots: int, scale: float, axis):
    """Absorbed MLA queries over latent slots cc [B, S, R] and rope keys ckr [B, S, Hr]."""
    f32 = jnp.float32
    scores = (
        jnp.einsum("btnr,bsr->bnts", ql, cc, preferred_element_type=f32)
        + jnp.einsum("btnh,bsh->bnts", qr, ckr, preferred_element_type=f32)
    ) * scale
    ok = visible(positions, offset, cc.shape[1], slots, None)[:, None]  # [B, 1, T, S]
    out = softmax_combine(scores, ok, cc, "bnts,bsr->bntr", axis)
    return jnp.einsum("bntr->btnr", out)


def mla_decode(q_latent, q_rope, latent, rope_key, cache: LatentCache, positions, *, scale: float):
    """MLA with absorbed up-projections: q_latent [B, T, N, R] (q_nope · W_k), q_rope [B, T, N, Hr], new
    latent [B, T, R] and rope_key [B, T, Hr] at positions [B, T] -> (softmax-weighted latents [B, T, N, R]
    for the caller to project by W_v, cache)."""
    if isinstance(cache, PagedLatentCache):
        (cc, ckr), pools, seen = _paged((cache.latent, cache.rope_key), (latent, rope_key), cache.table, positions)
        out = _mla_attend(q_latent, q_rope, cc, ckr, seen, offset=0, slots=cc.shape[1], scale=scale, axis=None)
        return out, PagedLatentCache(*pools, cache.table)
    slots = cache.latent.shape[1]

    def body(ql, qr, c, kr, cc, ckr, positions, *, offset, axis):
        cc, ckr = write(cc, c, positions, offset, slots), write(ckr, kr, positions, offset, slots)
        return _mla_attend(ql, qr, cc, ckr, positions, offset=offset, slots=slots, scale=scale, axis=axis), cc, ckr

    heads, token = ("cache_batch", None, None, None), ("cache_batch", None, None)
    names = (heads, heads, token, token, LatentCache.NAMES, LatentCache.NAMES, ("cache_batch", None))
    args = [
        constrain(a, nm)
        for a, nm in zip((q_latent, q_rope, latent, rope_key, cache.latent, cache.rope_key, positions), names)
    ]
    out, cc, ckr = run_over_slots(body, args, names, (heads, LatentCache.NAMES, LatentCache.NAMES))
    return out, LatentCache(cc, ckr)
