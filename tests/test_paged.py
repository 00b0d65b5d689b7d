"""Paged attention equals dense attention bit for bit: shuffled pages, NaN garbage in every unused slot."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpar.layers.kvcache import (
    KVCache,
    LatentCache,
    PagedKVCache,
    PagedLatentCache,
    gqa_decode,
    keys_layout,
    mla_decode,
    values_layout,
)

B, W, PAGE, K, G, H = 3, 4, 4, 2, 3, 8  # 3 rows, 4 pages of 4 slots each, GQA 6 query heads over 2
S = W * PAGE


def _pages(rng, pool_pages: int, used):
    """Row b's table: used[b] distinct shuffled page ids from 1..pool_pages-1, then the null page 0."""
    ids = rng.permutation(np.arange(1, pool_pages))[: B * W].reshape(B, W)
    ids[np.arange(W)[None, :] >= np.asarray(used)[:, None]] = 0
    return jnp.asarray(ids, jnp.int32)


def _dense_to_pool(dense, table, pool_pages: int, lengths):
    """A pool of NaN holding dense [B, S, ...] at positions < lengths in the table's pages; page 0 zero,
    every other slot (unwritten positions, pages no table holds) NaN."""
    pool = np.full((pool_pages, PAGE, *dense.shape[2:]), np.nan, np.float32)
    for b in range(B):
        for p in range(lengths[b]):
            pool[int(table[b, p // PAGE]), p % PAGE] = dense[b, p]
    pool[0] = 0
    return jnp.asarray(pool)


def _history(rng, lengths, *tail):
    """A dense cache holding random values at positions < lengths[b] and zeros elsewhere."""
    x = rng.normal(size=(B, S, *tail)).astype(np.float32)
    x[np.arange(S)[None, :] >= np.asarray(lengths)[:, None]] = 0
    return x


@pytest.mark.parametrize("t,window", [(1, None), (3, None), (3, 5)], ids=["decode", "chunk", "window"])
def test_paged_gqa_is_dense_gqa(t, window):
    rng = np.random.default_rng(t)
    lengths = np.array([5, 0, 9])  # tokens already cached per row
    positions = jnp.asarray(lengths[:, None] + np.arange(t)[None, :], jnp.int32)
    q = jnp.asarray(rng.normal(size=(B, t, K * G, H)), jnp.float32)
    k, v = (jnp.asarray(rng.normal(size=(B, t, K, H)), jnp.float32) for _ in range(2))
    ck, cv = _history(rng, lengths, K, H), _history(rng, lengths, K, H)
    table = _pages(rng, 20, -(-(lengths + t) // PAGE))
    paged = PagedKVCache(*(_dense_to_pool(a, table, 20, lengths) for a in (ck, cv)), table)

    want, dense = jax.jit(gqa_decode, static_argnames="window")(
        q, k, v, KVCache(keys_layout(jnp.asarray(ck)), values_layout(jnp.asarray(cv))), positions, window=window
    )
    got, pool = jax.jit(gqa_decode, static_argnames="window")(q, k, v, paged, positions, window=window)
    assert np.isfinite(np.asarray(got)).all()
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    for b in range(B):  # the new tokens landed in the row's pages
        rows = np.concatenate([np.asarray(pool.k)[int(p)] for p in table[b]])
        np.testing.assert_array_equal(
            rows[: lengths[b] + t], np.einsum("bkhs->bskh", np.asarray(dense.k))[b, : lengths[b] + t]
        )
    assert not np.asarray(pool.k)[0].any()  # the null page stays zero


def test_padding_queries_write_nothing():
    rng = np.random.default_rng(7)
    table = _pages(rng, 20, [W] * B)
    pool = jnp.asarray(rng.normal(size=(20, PAGE, K, H)), jnp.float32)
    positions = jnp.asarray([[3, -1], [-1, -1], [0, 1]], jnp.int32)
    new = jnp.ones((B, 2, K, H))
    q = jnp.ones((B, 2, K * G, H))
    out, after = gqa_decode(q, new, new, PagedKVCache(pool, pool, table), positions, window=None)
    assert np.isfinite(np.asarray(out)).all()
    changed = np.flatnonzero((np.asarray(after.k) != np.asarray(pool)).any(axis=(2, 3)).any(axis=1))
    assert sorted(changed) == sorted({int(table[0, 0]), int(table[2, 0])})


def test_paged_mla_is_dense_mla():
    rng = np.random.default_rng(3)
    n, r, hr, t = 4, 6, 2, 2
    lengths = np.array([2, 7, 13])
    positions = jnp.asarray(lengths[:, None] + np.arange(t)[None, :], jnp.int32)
    ql, qr = (jnp.asarray(rng.normal(size=(B, t, n, d)), jnp.float32) for d in (r, hr))
    lat, kr = (jnp.asarray(rng.normal(size=(B, t, d)), jnp.float32) for d in (r, hr))
    c, ckr = _history(rng, lengths, r), _history(rng, lengths, hr)
    table = _pages(rng, 16, -(-(lengths + t) // PAGE))
    paged = PagedLatentCache(*(_dense_to_pool(a, table, 16, lengths) for a in (c, ckr)), table)
    run = jax.jit(mla_decode, static_argnames="scale")
    want, _ = run(ql, qr, lat, kr, LatentCache(jnp.asarray(c), jnp.asarray(ckr)), positions, scale=0.3)
    got, _ = run(ql, qr, lat, kr, paged, positions, scale=0.3)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


@pytest.mark.parametrize("preset", ["tiny", "tiny-moe", "tiny-deepseek"])
def test_paged_model_is_dense_model(preset):
    """A model's decode path over page pools (shuffled pages) gives the dense cache's logits bit for bit:
    a prompt in two chunks, then single tokens."""
    from flax import nnx

    from jaxpar.inference.layouts import generation_execution
    from jaxpar.layers.kvcache import with_table, without_table
    from jaxpar.models import build_model, get_model_preset

    model = build_model(get_model_preset(preset), execution=generation_execution(), rngs=nnx.Rngs(0))
    rng = np.random.default_rng(1)
    ids = jnp.asarray(rng.integers(0, model.cfg.vocab_size, (2, 11)), jnp.int32)
    table = jnp.asarray(rng.permutation(np.arange(1, 9)).reshape(2, W), jnp.int32)
    step = nnx.jit(lambda m, x, pos, c: m.decode(x, pos, c))
    dense, pools = model.empty_cache(2, S), model.empty_pages(9, PAGE)
    for start, stop in [(0, 6), (6, 8), (8, 9), (9, 10), (10, 11)]:
        pos = jnp.broadcast_to(jnp.arange(start, stop, dtype=jnp.int32), (2, stop - start))
        want, dense = step(model, ids[:, start:stop], pos, dense)
        got, paged = step(model, ids[:, start:stop], pos, with_table(pools, table))
        pools = without_table(paged)
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
